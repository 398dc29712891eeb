"""Estimator: train, evaluate and predict one model_fn on every device.

The thin host shell around the compiled core: it resolves how many steps to
run, feeds stacks of batches, dispatches device loops, reads each loop's
outputs only after the next one is dispatched, checkpoints and reports.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Iterator

import jax
import optax

from estimax import checkpoint as checkpoint_lib
from estimax import mesh as mesh_lib
from estimax import report
from estimax.config import RunConfig
from estimax.data import feed
from estimax.loop import EvalRunner, TrainRunner, read_outputs
from estimax.model import NNXAdapter
from estimax.preemption import Preempted, PreemptionWatch
from estimax.step import Core
from estimax.warm_start import WarmStart

logger = logging.getLogger("estimax")


class Estimator:
    """One model definition, trained, evaluated and predicted on all devices.

    Args:
      model: factory ``(rngs, params) -> nnx.Module``.
      model_fn: ``model_fn(model, features, labels, mode, params) -> Spec``.
      optimizer: an optax ``GradientTransformation``.
      config: a ``RunConfig``; defaults to ``RunConfig()``.
      params: hyper-parameters handed to ``model`` and ``model_fn``;
        ``params["batch_size"]`` is set to the global batch of the mode.
      warm_start: initialise parameters from another run when ``model_dir``
        has no checkpoint yet (``WarmStart``).
    """

    def __init__(
        self,
        model: Callable,
        model_fn: Callable,
        optimizer: optax.GradientTransformation,
        config: RunConfig | None = None,
        params: dict | None = None,
        warm_start: WarmStart | None = None,
    ):
        _check_model_fn(model_fn)
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(
                f"Estimator(optimizer={optimizer!r}) is not an optax GradientTransformation; "
                "expected e.g. `optax.sgd(0.05)` or `optax.adam(1e-3)`."
            )
        self.config = config = config or RunConfig()
        self.params = dict(params or {})
        self.mesh = mesh_lib.make_mesh(_devices(config.num_devices))
        self._core = Core(NNXAdapter(model, self.params, config.seed), model_fn, optimizer, self.params, config.seed)
        self._replicated = mesh_lib.replicated(self.mesh)
        self._checkpointer = (
            None
            if config.model_dir is None
            else checkpoint_lib.Checkpointer.of_model_dir(config.model_dir, config.checkpoint)
        )
        self._warm_start = warm_start
        self._state, self._step, self._seen_latest = None, None, None
        self._train_runner: TrainRunner | None = None
        self._eval_runner: EvalRunner | None = None
        report.ensure_console()

    # -- state ---------------------------------------------------------------
    @property
    def step(self) -> int:
        """The number of training steps the current state has taken."""
        self._ensure_state()
        return self._step

    def state_shapes(self):
        """The ``TrainState`` as ``ShapeDtypeStruct``s (with shardings), without allocating it."""
        return checkpoint_lib.abstract_like(jax.eval_shape(self._core.init_state), self._replicated)

    def _ensure_state(self):
        """The latest good checkpoint in model_dir if newer than what is in memory, else a
        fresh initialisation (warm-started if asked)."""
        latest = self._checkpointer.latest_step() if self._checkpointer else None
        if latest is not None and latest != self._seen_latest and (self._state is None or latest > self._step):
            self._seen_latest = latest
            self._state, meta = self._checkpointer.restore(self.state_shapes())
            self._step = meta["step"]
        elif self._state is None:
            self._state = jax.jit(self._core.init_state, out_shardings=self._replicated)()
            if self._warm_start is not None:
                self._state = self._warm_start.apply(self._state)
            self._step = 0
        return self._state

    def _state_at(self, checkpoint: int | str | None):
        """The current state, or the one of ``checkpoint``: a step of model_dir or a path."""
        if checkpoint is None:
            return self._ensure_state()
        if isinstance(checkpoint, int) and not isinstance(checkpoint, bool):
            if self._checkpointer is None:
                raise ValueError(
                    f"checkpoint={checkpoint} is a step, but RunConfig(model_dir=None) has no "
                    "checkpoints; expected a path, or a model_dir."
                )
            checkpointer, step = self._checkpointer, checkpoint
        else:
            checkpointer, step = checkpoint_lib.locate(checkpoint)
        return checkpointer.restore(self.state_shapes(), step)[0]

    def model(self, checkpoint: int | str | None = None):
        """The model as a live NNX module in eval behaviour, for interactive use.

        ``checkpoint``: a step of model_dir or a checkpoint path; default: the current state.
        """
        state = self._state_at(checkpoint)
        return self._core.adapter.live(state.params, state.model_state)

    # -- train ---------------------------------------------------------------
    def train(
        self, input, *, max_steps: int | None = None, steps: int | None = None, epochs: int | None = None
    ) -> Estimator:
        """Trains until ``max_steps`` (absolute), for ``steps`` more, or until ``epochs`` are done.

        ``epochs`` counts from step 0 like ``max_steps`` (a resumed run
        finishes the same number of epochs); it needs an input of known size.
        """
        cfg = self.config
        mesh_lib.check_batch_size("train_batch_size", cfg.train_batch_size, self.mesh)
        host_batch = cfg.train_batch_size // jax.process_count()
        state = self._ensure_state()
        start = self._step
        target = _target_step(start, max_steps, steps, epochs, input, host_batch)
        if start >= target:
            logger.info("Already at step %d >= %d: nothing to train.", start, target)
            return self
        logger.info(
            "Training steps %d -> %d: global batch %d on %d devices, %d steps per loop",
            start,
            target,
            cfg.train_batch_size,
            self.mesh.size,
            cfg.steps_per_loop,
        )
        if self._train_runner is None:
            self._train_runner = TrainRunner(self._core, self.mesh, cfg.loop, cfg.steps_per_loop)
        runner = self._train_runner
        reporter = report.Reporter(cfg.model_dir, cfg.log_every_steps, cfg.train_batch_size)
        chunk_sizes = [min(cfg.steps_per_loop, target - s) for s in range(start, target, cfg.steps_per_loop)]
        stacks = feed.train_stacks(input, host_batch, chunk_sizes, seed=cfg.seed, start_step=start)
        step, pending = start, None
        checkpointer = self._checkpointer
        with (
            PreemptionWatch() as preemption,
            feed.Prefetch(feed.train_chunks(stacks, self.mesh, cfg.train_batch_size)) as chunks,
        ):
            for chunk in chunks:
                state, outputs = runner.run(state, chunk)
                chunks.busy = outputs  # input_wait_fraction counts the device's idle time only
                if pending is not None:
                    reporter.train(pending[0], pending[1], read_outputs(pending[2]), input_wait=chunks.wait_seconds)
                pending = (step, step + chunk.num_steps, outputs)
                step += chunk.num_steps
                self._state, self._step = state, step
                if preemption.requested(step):
                    break
                if checkpointer and checkpointer.due(pending[0], step):
                    checkpointer.save(step, state)
        if pending is not None:
            reporter.train(pending[0], pending[1], read_outputs(pending[2]), True, input_wait=chunks.wait_seconds)
        if checkpointer:
            checkpointer.save(step, state)
            checkpointer.wait()
        if preemption.signal_name is not None:
            preempted = Preempted(step, preemption.signal_name)
            logger.warning("%s", preempted)
            raise preempted
        if step < target:
            logger.info("Input ran out at step %d (before %d).", step, target)
        return self

    # -- evaluate and predict --------------------------------------------------
    def evaluate(self, input, *, steps: int | None = None, checkpoint: int | str | None = None) -> dict[str, float]:
        """Exact loss and metrics over the whole input (or its first ``steps`` batches).

        The last partial batch is padded and masked: every example counts
        once. Returns the averages and ``num_examples``. ``checkpoint``: a
        step of model_dir or a checkpoint path; default: the current state.
        """
        batch_size = self.config.global_eval_batch_size
        mesh_lib.check_batch_size("eval_batch_size", batch_size, self.mesh)
        state = self._state_at(checkpoint)
        batches = feed.eval_batches(input, batch_size // jax.process_count())
        if steps is not None:
            batches = itertools.islice(batches, steps)
        with feed.Prefetch(feed.eval_device_batches(batches, self.mesh, batch_size)) as device_batches:
            totals = self._evaluator().totals(state, device_batches)
        if totals is None:
            raise ValueError("Evaluation input yielded no batches; expected at least one example.")
        results = {name: mean.compute() for name, mean in totals.items()}
        if "num_examples" in results:
            raise ValueError("Spec(metrics=...) uses the reserved name 'num_examples'; rename that metric.")
        results["num_examples"] = float(next(iter(totals.values())).count)
        step = int(jax.device_get(state.step))
        report.Reporter(self.config.model_dir, self.config.log_every_steps, batch_size).eval(step, results)
        return results

    def predict(self, input, *, checkpoint: int | str | None = None) -> Iterator:
        """One prediction per example, in input order, as numpy (a dict if model_fn returned one).

        ``checkpoint``: a step of model_dir or a checkpoint path; default: the current state.
        """
        batch_size = self.config.global_predict_batch_size
        mesh_lib.check_batch_size("predict_batch_size", batch_size, self.mesh)
        state = self._state_at(checkpoint)
        predict = self._evaluator().predict
        batches = feed.eval_batches(input, batch_size // jax.process_count())
        pending = None
        with feed.Prefetch(feed.eval_device_batches(batches, self.mesh, batch_size)) as device_batches:
            for db in device_batches:
                predictions = predict(state, db.batch)
                if pending is not None:
                    yield from _rows(*pending)
                pending = (predictions, db.num_valid)
        if pending is not None:
            yield from _rows(*pending)

    def _evaluator(self) -> EvalRunner:
        if self._eval_runner is None:
            self._eval_runner = EvalRunner(self._core, self.mesh)
        return self._eval_runner


def _rows(predictions, num_valid: int) -> Iterator:
    host = jax.tree.map(mesh_lib.to_host_local, predictions)  # host sync: this batch is done
    for i in range(num_valid):
        yield jax.tree.map(lambda x, i=i: x[i], host)


def _target_step(start, max_steps, steps, epochs, input, host_batch) -> int:
    given = {k: v for k, v in (("max_steps", max_steps), ("steps", steps), ("epochs", epochs)) if v is not None}
    if len(given) != 1:
        raise ValueError(
            f"train() received {given or 'none of max_steps, steps, epochs'}; "
            "expected exactly one of them, e.g. `train(data, max_steps=1000)`."
        )
    ((name, value),) = given.items()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"train({name}={value!r}) must be a non-negative integer.")
    if name == "max_steps":
        return value
    if name == "steps":
        return start + value
    if not hasattr(input, "steps_per_epoch"):
        raise TypeError(
            f"train(epochs=...) needs an input of known size, e.g. estimax.data.from_arrays; "
            f"received {type(input).__name__}. Fix: pass max_steps or steps instead."
        )
    per_epoch = input.steps_per_epoch(host_batch, jax.process_count())
    dropped = len(input) - per_epoch * host_batch * jax.process_count()
    logger.info(
        "An epoch is %d steps of %d examples; %d examples per epoch are dropped (drop_remainder).",
        per_epoch,
        host_batch * jax.process_count(),
        dropped,
    )
    return value * per_epoch


def _devices(num_devices: int | None) -> list:
    devices = jax.devices()
    if num_devices is not None and num_devices > len(devices):
        raise ValueError(
            f"RunConfig(num_devices={num_devices}) exceeds the {len(devices)} devices available; "
            f"expected at most {len(devices)}."
        )
    return devices[:num_devices]


def _check_model_fn(model_fn) -> None:
    if not callable(model_fn):
        raise TypeError(
            f"Estimator(model_fn={model_fn!r}) is not callable; expected "
            "`def model_fn(model, features, labels, mode, params) -> ex.Spec`."
        )
    try:
        inspect.signature(model_fn).bind(None, None, None, None, None)
    except TypeError:
        raise TypeError(
            f"Estimator(model_fn=...) has signature {inspect.signature(model_fn)}; expected "
            "`model_fn(model, features, labels, mode, params)`: five positional arguments."
        ) from None
    except ValueError:  # builtins without a signature: accept
        pass
