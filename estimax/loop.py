"""How compiled work is dispatched: the device loop and its modes.

Owns the jitted train/eval/predict functions with their shardings and
donation, the two ways of running ``steps_per_loop`` training steps (one
``lax.scan``, or one call per step with a bounded number in flight), and the
``auto`` choice between them. Does not own input, checkpoints or reporting.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from estimax import mesh as mesh_lib
from estimax import metrics as metrics_lib
from estimax.data.feed import DeviceChunk

logger = logging.getLogger("estimax")

# Dispatching hundreds of collective-bearing calls without waiting starves
# XLA:CPU's all-reduce rendezvous; wait for the call this many steps back.
MAX_STEPS_IN_FLIGHT = 8
# auto mode times this many steps per candidate (after one warm-up run each).
MAX_PROBE_STEPS = 8


class TrainRunner:
    """Runs chunks of training steps on the mesh, as a scan or step by step.

    ``run`` only dispatches: it returns the new state and the per-step
    outputs as device arrays, without waiting for them.
    """

    def __init__(self, core, mesh, loop: str, steps_per_loop: int):
        rep, stack = mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh, stacked=True)
        batch = mesh_lib.batch_sharding(mesh)
        self.scan = jax.jit(core.train_loop, in_shardings=(rep, stack), out_shardings=(rep, rep), donate_argnums=0)
        self.step = jax.jit(core.train_step, in_shardings=(rep, batch), out_shardings=(rep, rep), donate_argnums=0)
        # Separate from the step so that a shorter final stack recompiles only this slice.
        self._batch_at = jax.jit(
            lambda s, i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), s),
            out_shardings=batch,
        )
        self._slice = jax.jit(
            lambda s, start, stop: jax.tree.map(lambda x: x[start:stop], s), static_argnums=(1, 2), out_shardings=stack
        )
        self._indices = [jax.device_put(np.int32(i), rep) for i in range(steps_per_loop)]
        if loop == "auto" and jax.default_backend() != "cpu":
            loop = "scan"  # the per-step penalty of a rolled loop is an XLA:CPU matter
        self.mode = loop
        self._probe_steps = min(MAX_PROBE_STEPS, steps_per_loop // 4)
        if self.mode == "auto" and self._probe_steps < 2:
            self.mode = "step"  # too few steps per loop to time both; step is never slow

    def run(self, state, chunk: DeviceChunk):
        if self.mode == "scan":
            state, outputs = self.scan(state, chunk.stack)
            return state, [outputs]
        if self.mode == "auto" and chunk.num_steps >= 4 * self._probe_steps:
            return self._choose(state, chunk)
        return self._steps(state, chunk.stack, range(chunk.num_steps))

    def _steps(self, state, stack, indices):
        outputs = []
        for i in indices:
            state, out = self.step(state, self._batch_at(stack, self._indices[i]))
            outputs.append(out)
            if len(outputs) > MAX_STEPS_IN_FLIGHT:
                jax.block_until_ready(outputs[-MAX_STEPS_IN_FLIGHT - 1])  # host sync: bound the queue
        return state, outputs

    def _choose(self, state, chunk: DeviceChunk):
        """Times ``p`` steps of each mode (after a warm-up run of each) and keeps the faster.

        All of them are real training steps: results do not depend on the
        mode beyond float rounding.
        """
        p, outputs = self._probe_steps, []

        def timed(run):
            nonlocal state
            jax.block_until_ready(state)  # host sync: time only this run
            start = time.perf_counter()
            state, out = run()
            jax.block_until_ready((state, out))
            outputs.extend(out)
            return time.perf_counter() - start

        timed(lambda: self._steps(state, chunk.stack, range(0, p)))
        per_step = timed(lambda: self._steps(state, chunk.stack, range(p, 2 * p)))
        subs = [self._slice(chunk.stack, a, a + p) for a in (2 * p, 3 * p)]
        timed(lambda: (lambda s, o: (s, [o]))(*self.scan(state, subs[0])))
        scan = timed(lambda: (lambda s, o: (s, [o]))(*self.scan(state, subs[1])))
        self.mode = "scan" if scan < per_step else "step"
        logger.info(
            "loop=auto: %d steps took %.2f ms as a scan and %.2f ms step by step; using %s",
            p,
            scan * 1e3,
            per_step * 1e3,
            self.mode,
        )
        state, rest = self._steps(state, chunk.stack, range(4 * p, chunk.num_steps))
        return state, outputs + rest


def read_outputs(outputs: list[dict]) -> dict[str, np.ndarray]:
    """Per-step outputs of a loop as host arrays of shape ``(num_steps,)``."""
    host = jax.device_get(outputs)  # host sync: the loop that produced them is done
    return {k: np.concatenate([np.atleast_1d(o[k]) for o in host]) for k in host[0]}


class EvalRunner:
    """Accumulates exact masked sums over evaluation batches, on the device."""

    def __init__(self, core, mesh):
        rep, batch = mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)
        self._core, self._replicated = core, rep
        # Totals are a few scalars: not donated, so the bound below can wait on old ones.
        self.step = jax.jit(core.eval_step, in_shardings=(rep, rep, batch, batch), out_shardings=rep)
        self.predict = jax.jit(core.predict_step, in_shardings=(rep, batch), out_shardings=batch)

    def value_shapes(self, state, batch) -> dict:
        return jax.eval_shape(self._core.eval_values, state, batch)

    def totals(self, state, device_batches) -> dict[str, metrics_lib.Mean] | None:
        """Sums over an iterator of ``DeviceBatch``; raises on scalar values in a padded batch."""
        totals, pending, scalars = None, [], []
        for db in device_batches:
            if totals is None:
                shapes = self.value_shapes(state, db.batch)
                scalars = sorted(k for k, v in shapes.items() if v.ndim == 0)
                totals = jax.device_put(metrics_lib.zeros(shapes), self._replicated)
            if db.padded and scalars:
                raise ValueError(
                    f"model_fn returned scalar {scalars} in EVAL mode, but this batch is padded "
                    f"({db.num_valid} valid rows): a scalar would average padding in. Fix: return "
                    "per-example values of shape (batch,) and the engine masks the padding."
                )
            totals = self.step(state, totals, db.batch, db.mask)
            pending.append(totals)
            if len(pending) > MAX_STEPS_IN_FLIGHT:
                jax.block_until_ready(pending.pop(0))  # host sync: bound the queue
        return totals
