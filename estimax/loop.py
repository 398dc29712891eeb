"""How compiled work is dispatched: the device loop and its kinds.

Owns the jitted train/eval/predict functions with their shardings and
donation, the two ways of running ``steps_per_loop`` training steps (one
``lax.scan``, or one call per step with a bounded number in flight), and the
``auto`` choice between them, made from the traced step before anything is
compiled. Does not own input, checkpoints or reporting.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import numpy as np

from estimax import counting
from estimax import metrics as metrics_lib
from estimax.data.feed import DeviceChunk
from estimax.errors import SpecError
from estimax.records import flops
from estimax.step import eval_states_of

logger = logging.getLogger("estimax")

# Dispatching hundreds of collective-bearing calls without waiting starves
# XLA:CPU's all-reduce rendezvous; wait for the call this many steps back.
MAX_STEPS_IN_FLIGHT = 8
# The primitives that XLA:CPU runs much slower inside a loop body than as separate calls.
SLOW_IN_CPU_LOOPS = ("conv_general_dilated",)
# Evaluation batches merged on the device before the host folds them in (see EvalRunner).
FOLD_EVERY = 256


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What an Estimator has compiled so far (``Estimator.compiled()``).

    Attributes:
      loop: the device loop training runs, ``"scan"`` or ``"step"``; ``RunConfig.loop``
        until the first training loop is dispatched.
      train_scan, train_step, eval_step, predict_step: how many programs of each
        kind were compiled (a shorter final loop or a new batch shape adds one).
    """

    loop: str
    train_scan: int = 0
    train_step: int = 0
    eval_step: int = 0
    predict_step: int = 0

    @classmethod
    def of(cls, loop: str, train: DeviceLoop | None, evaluation: EvalRunner | None) -> Compiled:
        counts = {}
        if train is not None:
            loop, counts["train_scan"], counts["train_step"] = train.loop, _count(train.scan), _count(train.step)
        if evaluation is not None:
            counts["eval_step"], counts["predict_step"] = _count(evaluation.step), _count(evaluation.predict)
        return cls(loop, **counts)


def _count(jitted) -> int:
    """How many versions of a jitted function were compiled, for ``Compiled``; never on the training path.

    JAX has no public count: this reads ``_cache_size()`` of its jitted functions, and gives -1 if that
    moved (``tests/test_training.py`` names it when it does).
    """
    versions = getattr(jitted, "_cache_size", None)
    return versions() if callable(versions) else -1


def live_model(core, layout, state):
    """``state``'s model in its framework's form (an NNX or bound Linen module, the Keras model, a
    bound function), in eval behaviour: on gathered copies (whole arrays on every device), which the
    next dispatch cannot donate away, so it stays valid whatever training does next."""
    params, model_state = _gathered_copy((state.params, state.model_state), layout.replicated)
    with jax.set_mesh(layout.mesh):
        return core.adapter.live(params, model_state)


@functools.partial(jax.jit, static_argnums=1)
def _gathered_copy(tree, replicated):
    return jax.lax.with_sharding_constraint(jax.tree.map(jax.numpy.copy, tree), replicated)


class DeviceLoop:
    """Runs chunks of training steps on the mesh, as a scan or step by step.

    ``run`` only dispatches: it returns the new state and the per-step
    outputs as device arrays, without waiting for them, and the seconds its
    calls spent compiling (tracing included). ``loop`` is ``"auto"``
    until the first ``run`` (or ``resume``) settles it on ``"scan"`` or ``"step"``.
    """

    def __init__(self, core, layout, loop: str, steps_per_loop: int):
        rep, state, stack, batch = layout.replicated, layout.state, layout.stack, layout.batch
        self._core, self._layout = core, layout
        self._batch_sharding, self._replicated = batch, rep
        self.scan = jax.jit(core.train_loop, in_shardings=(state, stack), out_shardings=(state, rep), donate_argnums=0)
        # ``measure`` (a device bool): like the scan, a loop reads every gradient on its last step only.
        self.step = jax.jit(
            _with_step_axis(core.train_step),
            in_shardings=(state, batch, rep),
            out_shardings=(state, rep),
            donate_argnums=0,
        )
        # Separate from the step so that a shorter final stack recompiles only this slice.
        self._batch_at = jax.jit(
            lambda s, i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), s),
            out_shardings=batch,
        )
        self._indices = [jax.device_put(np.int32(i), rep) for i in range(steps_per_loop)]
        self._measure = {last: jax.device_put(np.bool_(last), rep) for last in (False, True)}
        self._steps_per_loop = steps_per_loop
        self._micro_batches = core.grad_accum_steps
        self.loop = loop
        self.flops_per_step: float | None = None  # the compiler's count, once the first chunk is seen
        self._counted = False
        self._compiled: set = set()  # the programs and shapes already compiled: (scan, steps) or step

    def model(self, state):
        """``live_model`` of a state this runner trains."""
        return live_model(self._core, self._layout, state)

    def _timed(self, program, key, *args):
        """``(program(*args), seconds)``: the call's time when it compiled (the first call of ``key``,
        its shapes), else 0.

        Only the call that compiles is counted: a first loop run step by step also
        waits for its earlier steps to bound the queue, which is not compilation.
        """
        if key in self._compiled:
            return program(*args), 0.0
        start = time.perf_counter()
        result = program(*args)
        self._compiled.add(key)
        return result, time.perf_counter() - start

    def resume(self, loop: str, step: int) -> None:
        """Under ``auto``, keeps the loop a checkpoint was trained with (exact resume), without choosing."""
        if self.loop == "auto" and loop in ("scan", "step"):
            self.loop = loop
            logger.info("loop=auto: using %s, the loop the checkpoint of step %d was trained with", loop, step)

    def run(self, state, chunk: DeviceChunk):
        """``(state, outputs, seconds spent compiling)`` of one chunk's steps, dispatched (not waited for)."""
        if self.loop == "auto":
            self.loop, reason = self._choose(state, chunk)
            # An internal choice: in a notebook it would open every kernel's output, so it is logged at debug there.
            level = logging.DEBUG if counting.in_notebook() else logging.INFO
            logger.log(level, "loop=auto: using %s: %s", self.loop, reason)
        if not self._counted:  # one estimate per run, of the program the loop runs: lowered once (JAX's cache)
            self._counted = True
            if self.loop == "scan" and not self._core.last_step_apart:  # XLA counts a loop's body once: one step
                program, args = self.scan, (state, chunk.stack)
            else:  # (a last step apart is a second copy of the step in the rolled loop's program)
                program, args = self.step, (state, *self._step_args(chunk))
            self.flops_per_step = flops.step_flops(program, *args, micro_batches=self._micro_batches)
        if self.loop == "scan":  # a shorter final stack compiles once more
            (state, outputs), compiling = self._timed(self.scan, ("scan", chunk.num_steps), state, chunk.stack)
            return state, [outputs], compiling
        return self._steps(state, chunk.stack, chunk.num_steps)

    def _steps(self, state, stack, num_steps: int):
        outputs, compiling = [], 0.0
        for i in range(num_steps):
            batch, measure = self._batch_at(stack, self._indices[i]), self._measure[i == num_steps - 1]
            (state, out), seconds = self._timed(self.step, "step", state, batch, measure)  # one shape: compiled once
            compiling += seconds
            outputs.append(out)
            if len(outputs) > MAX_STEPS_IN_FLIGHT:
                jax.block_until_ready(outputs[-MAX_STEPS_IN_FLIGHT - 1])  # host sync: bound the queue
        return state, outputs, compiling

    def _choose(self, state, chunk: DeviceChunk) -> tuple[str, str]:
        """``(loop, reason)`` from the traced train step, without compiling or running a candidate.

        A rolled loop costs accelerators nothing, and saves the host one call per
        step; XLA:CPU runs convolutions inside a loop body up to 10x slower than
        as separate calls (jax issue 12868), so a step with convolutions on CPU
        runs step by step. The trace is the rolled loop's, which it compiles from when chosen.
        """
        backend = jax.default_backend()
        if backend != "cpu":
            return "scan", f"one compiled loop of {self._steps_per_loop} steps per host call on {backend}"
        if self._steps_per_loop == 1:
            return "step", "one step per loop"
        slow = count_primitives(self.scan.trace(state, chunk.stack).jaxpr, SLOW_IN_CPU_LOOPS)
        if slow:
            return "step", (
                f"the training step has {slow} convolutions, which XLA:CPU runs up to 10x slower inside "
                "a loop body (jax issue 12868)"
            )
        steps = self._steps_per_loop
        return "scan", f"no convolution in the training step: one compiled loop of {steps} steps per call"

    def _step_args(self, chunk: DeviceChunk) -> tuple:
        """The step's batch and ``measure`` as ``ShapeDtypeStruct``s placed as the step loop places them:
        the FLOP count and the step loop's first call share one trace and lowering (JAX's cache)."""
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=self._batch_sharding), chunk.stack
        )
        return batch, jax.ShapeDtypeStruct((), np.bool_, sharding=self._replicated)


def count_primitives(jaxpr, names: tuple[str, ...]) -> int:
    """How many equations of ``jaxpr`` and of the jaxprs inside it apply one of ``names``."""
    return sum(eqn.primitive.name in names for eqn in flops.equations(jaxpr))


def _with_step_axis(train_step):
    """``train_step`` whose outputs have a leading steps axis of 1, like a scan's."""

    def step(state, batch, measure):
        state, outputs = train_step(state, batch, measure)
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

    def __init__(self, core, layout, fold_every: int | None = None):
        rep, state, batch = layout.replicated, layout.state, layout.batch
        self._core, self._replicated, self.fold_every = core, rep, fold_every or FOLD_EVERY
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
                    raise SpecError(
                        "host_metrics needs per-example arrays on the host, but the model_fn returned no "
                        "Spec(eval_outputs=...) in EVAL mode. Fix: return e.g. "
                        "`ex.Spec(loss=loss, eval_outputs={'scores': probs, 'labels': labels})`."
                    )
                carry = empty
            if db.padded and scalars:
                raise SpecError(
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
