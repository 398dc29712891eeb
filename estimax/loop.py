"""How compiled work is dispatched: the device loop and its modes.

Owns the jitted train/eval/predict functions with their shardings and
donation, the two ways of running ``steps_per_loop`` training steps (one
``lax.scan``, or one call per step with a bounded number in flight), and the
``auto`` choice between them. Does not own input, checkpoints or reporting.
"""

from __future__ import annotations

import logging
import sys
import time

import jax
import numpy as np

from estimax import metrics as metrics_lib
from estimax.data.feed import DeviceChunk
from estimax.step import eval_states_of

logger = logging.getLogger("estimax")

# Dispatching hundreds of collective-bearing calls without waiting starves
# XLA:CPU's all-reduce rendezvous; wait for the call this many steps back.
MAX_STEPS_IN_FLIGHT = 8
# auto mode: each round times this many steps of each candidate, for up to
# PROBE_ROUNDS rounds; it keeps "step" only when it is clearly faster, since a
# scan also frees the host, and stops early on an unambiguous difference.
MAX_PROBE_STEPS = 8
PROBE_ROUNDS = 3
STEP_MUST_WIN_BY = 1.2
CLEAR_RATIO, CLEAR_SECONDS = 3.0, 0.01


class TrainRunner:
    """Runs chunks of training steps on the mesh, as a scan or step by step.

    ``run`` only dispatches: it returns the new state and the per-step
    outputs as device arrays, without waiting for them.
    """

    def __init__(self, core, layout, loop: str, steps_per_loop: int):
        rep, state, stack, batch = layout.replicated, layout.state, layout.stack, layout.batch
        self.scan = jax.jit(core.train_loop, in_shardings=(state, stack), out_shardings=(state, rep), donate_argnums=0)
        self.step = jax.jit(
            _with_step_axis(core.train_step), in_shardings=(state, batch), out_shardings=(state, rep), donate_argnums=0
        )
        # Separate from the step so that a shorter final stack recompiles only this slice.
        self._batch_at = jax.jit(
            lambda s, i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), s),
            out_shardings=batch,
        )
        self._indices = [jax.device_put(np.int32(i), rep) for i in range(steps_per_loop)]
        if loop == "auto" and jax.default_backend() != "cpu":
            loop = "scan"  # the per-step penalty of a rolled loop is an XLA:CPU matter
        self.mode = loop
        self._probe_steps = p = min(MAX_PROBE_STEPS, steps_per_loop // (1 + 2 * PROBE_ROUNDS))
        if self.mode == "auto" and p < 2:
            self.mode = "step"  # too few steps per loop to time both; step is never slow
        self._probe_slice = jax.jit(
            lambda s, start: jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, p), s),
            out_shardings=stack,
        )

    def cache_size(self) -> int:
        """How many programs have been compiled so far (to attribute compile time)."""
        return self.scan._cache_size() + self.step._cache_size()

    def run(self, state, chunk: DeviceChunk):
        if self.mode == "scan":
            state, outputs = self.scan(state, chunk.stack)
            return state, [outputs]
        if self.mode == "auto" and chunk.num_steps >= (1 + 2 * PROBE_ROUNDS) * self._probe_steps:
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
        """Times both modes on this loop's steps and keeps the faster one from the next loop on.

        Every probed step is a real training step: results do not depend on
        the mode beyond float rounding. The scan candidate is compiled ahead of
        time, so no slow step is spent warming it up.
        """
        p, at, outputs = self._probe_steps, 0, []

        def steps(n):
            nonlocal state, at
            state, out = self._steps(state, chunk.stack, range(at, at + n))
            outputs.extend(out)
            at += n

        def scan():
            nonlocal state, at
            state, out = compiled_scan(state, self._probe_slice(chunk.stack, self._indices[at]))
            outputs.append(out)
            at += p

        def timed(run) -> float:
            jax.block_until_ready(state)  # host sync: time only this run
            start = time.perf_counter()
            run()
            jax.block_until_ready((state, outputs[-1]))
            return time.perf_counter() - start

        steps(p)  # compiles the per-step path
        compiled_scan = self.scan.lower(state, self._probe_slice(chunk.stack, self._indices[0])).compile()
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)  # the prefetch thread must not hold the GIL for 5 ms inside a window
        try:
            step_times, scan_times = [], []
            for _ in range(PROBE_ROUNDS):
                step_times.append(timed(lambda: steps(p)))
                scan_times.append(timed(scan))
                fast, slow = sorted((min(step_times), min(scan_times)))
                if slow > CLEAR_RATIO * fast and slow - fast > CLEAR_SECONDS:
                    break
        finally:
            sys.setswitchinterval(switch_interval)
        per_step, scanned = min(step_times), min(scan_times)
        self.mode = "step" if per_step * STEP_MUST_WIN_BY < scanned else "scan"
        logger.info(
            "loop=auto: %d steps took %.2f ms as a scan and %.2f ms step by step (best of %d); using %s",
            p,
            scanned * 1e3,
            per_step * 1e3,
            len(scan_times),
            self.mode,
        )
        steps(chunk.num_steps - at)  # the rest of this loop, on the already compiled path
        return state, outputs


def _with_step_axis(train_step):
    """``train_step`` whose outputs have a leading steps axis of 1, like a scan's."""

    def step(state, batch):
        state, outputs = train_step(state, batch)
        return state, jax.tree.map(lambda x: x[None], outputs)

    return step


def read_outputs(outputs: list[dict]) -> dict:
    """Per-step outputs of a loop on the host with a leading ``(num_steps,)`` axis: arrays,
    and metric states whose leaves have that axis."""
    host = jax.device_get(outputs)  # host sync: the loop that produced them is done
    return jax.tree.map(lambda *steps: np.concatenate(steps), *host)


class EvalRunner:
    """Merges metric states over evaluation batches: on the device within a segment of
    ``fold_every`` batches (int32 counts), then on the host in int64/float64.

    A segment's counts stay below ``fold_every`` x the global batch, so int32
    cannot overflow below a global eval batch of 2**31 / ``fold_every`` rows.
    """

    def __init__(self, core, layout, fold_every: int = 256):
        rep, state, batch = layout.replicated, layout.state, layout.batch
        self._core, self._replicated, self.fold_every = core, rep, fold_every
        self._prepared: dict = {}  # per batch signature: see _prepare
        # States are small: not donated, so the bound below can wait on old ones.
        self.step = jax.jit(core.eval_step, in_shardings=(state, rep, batch, batch), out_shardings=(rep, batch))
        self.predict = jax.jit(core.predict_step, in_shardings=(state, batch), out_shardings=batch)

    def totals(self, state, device_batches, should_stop=None, outputs=None) -> dict | None:
        """Host states merged over an iterator of ``DeviceBatch``; raises on scalar values in a padded batch.

        ``outputs``: an ``OutputRows`` that receives every batch's ``eval_outputs``.
        Returns ``None`` if there was no batch, or when ``should_stop()`` said so.
        """
        host, empty, carry, pending, scalars, num_batches = None, None, None, [], [], 0
        for db in device_batches:
            if should_stop is not None and should_stop():
                return None
            if empty is None:
                scalars, empty, has_outputs = self._prepare(state, db)
                if outputs is not None and not has_outputs:
                    raise ValueError(
                        "host_metrics needs per-example arrays on the host, but the model_fn returned no "
                        "Spec(eval_outputs=...) in EVAL mode. Fix: return e.g. "
                        "`ex.Spec(loss=loss, eval_outputs={'scores': probs, 'labels': labels})`."
                    )
                carry = empty
            if db.padded and scalars:
                raise ValueError(
                    f"model_fn returned scalar {scalars} in EVAL mode, but this batch is padded "
                    f"({db.num_valid} valid rows): a scalar would average padding in. Fix: return "
                    "per-example values of shape (batch,) and the engine masks the padding."
                )
            carry, batch_outputs = self.step(state, carry, db.batch, db.mask)
            if outputs is not None:
                outputs.add(batch_outputs, db.num_valid)
            num_batches += 1
            pending.append(carry)
            if len(pending) > MAX_STEPS_IN_FLIGHT:
                jax.block_until_ready(pending.pop(0))  # host sync: bound the queue
            if num_batches % self.fold_every == 0:
                host = _merged(host, carry)  # host sync: this segment is done
                carry, pending = empty, []
        if empty is None:
            return None
        return _merged(host, carry) if num_batches % self.fold_every else host

    def _prepare(self, state, db) -> tuple[list[str], dict, bool]:
        """``(names of scalar values, the empty carry on the mesh, whether there are eval_outputs)``,
        from one trace of the model_fn per batch signature (later evaluations reuse it)."""
        key = jax.tree.structure(db.batch), tuple((x.shape, x.dtype) for x in jax.tree.leaves(db.batch))
        if key not in self._prepared:

            def shapes(state, batch, mask):
                values, outputs = self._core.eval_values(state, batch)
                return values, outputs, eval_states_of(values, mask)

            values, outputs, states = jax.eval_shape(shapes, state, db.batch, db.mask)
            scalars = sorted(k for k, v in values.items() if not metrics_lib.is_metric_inputs(v) and v.ndim == 0)
            empty = jax.device_put({k: metrics_lib.empty_like(s) for k, s in states.items()}, self._replicated)
            self._prepared[key] = scalars, empty, bool(outputs)
        return self._prepared[key]


def _merged(host: dict | None, carry: dict) -> dict:
    carry = metrics_lib.to_host(carry)
    return carry if host is None else {k: host[k].merge(carry[k]) for k in host}
