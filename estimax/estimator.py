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

from estimax import mesh as mesh_lib
from estimax import report
from estimax.checkpoint import Checkpointer, abstract_like
from estimax.config import RunConfig
from estimax.data import feed
from estimax.loop import EvalRunner, TrainRunner, read_outputs
from estimax.models import resolve as resolve_model
from estimax.step import Core

logger = logging.getLogger("estimax")


class Estimator:
    """One model definition, trained, evaluated and predicted on all devices.

    Args:
      model: an NNX factory ``(rngs, params) -> nnx.Module``, or a model
        wrapped by ``estimax.models`` (``linen``, ``keras``, ``functional``).
      model_fn: ``model_fn(model, features, labels, mode, params) -> Spec``.
      optimizer: an optax ``GradientTransformation``.
      config: a ``RunConfig``; defaults to ``RunConfig()``.
      params: hyper-parameters handed to ``model`` and ``model_fn``;
        ``params["batch_size"]`` is set to the global batch of the mode.
    """

    def __init__(
        self,
        model: Callable,
        model_fn: Callable,
        optimizer: optax.GradientTransformation,
        config: RunConfig | None = None,
        params: dict | None = None,
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
        adapter = resolve_model(model, self.params, config.seed)
        self._core = Core(adapter, model_fn, optimizer, self.params, config.seed, config.compute_dtype)
        self._replicated = mesh_lib.replicated(self.mesh)
        self._checkpointer = (
            None
            if config.model_dir is None
            else Checkpointer(config.model_dir, save_every_steps=config.save_every_steps, keep=config.keep_checkpoints)
        )
        self._state, self._step = None, None
        self._train_runner: TrainRunner | None = None
        self._eval_runner: EvalRunner | None = None
        report.ensure_console()

    # -- state ---------------------------------------------------------------
    @property
    def step(self) -> int:
        """The number of training steps the current state has taken."""
        self._ensure_state()
        return self._step

    def _ensure_state(self):
        """The latest checkpoint in model_dir if newer than what is in memory, else a fresh init."""
        latest = self._checkpointer.latest_step() if self._checkpointer else None
        if latest is not None and (self._state is None or latest > self._step):
            abstract = abstract_like(jax.eval_shape(self._core.init_state), self._replicated)
            self._state, self._step = self._checkpointer.restore(abstract), latest
        elif self._state is None:
            self._state = jax.jit(self._core.init_state, out_shardings=self._replicated)()
            self._step = 0
        return self._state

    def model(self):
        """The current model in its framework's form (an NNX or bound Linen module, the Keras
        model, a bound function), in eval behaviour, for interactive use."""
        state = self._ensure_state()
        # Copies: the next train() donates the state's buffers, which would delete the model's arrays.
        params, model_state = jax.tree.map(jax.numpy.copy, (state.params, state.model_state))
        return self._core.adapter.live(params, model_state)

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
        with feed.Prefetch(feed.train_chunks(stacks, self.mesh, cfg.train_batch_size)) as chunks:
            for chunk in chunks:
                state, outputs = runner.run(state, chunk)
                if pending is not None:
                    reporter.train(pending[0], pending[1], read_outputs(pending[2]))
                pending = (step, step + chunk.num_steps, outputs)
                step += chunk.num_steps
                self._state, self._step = state, step
                if self._checkpointer and self._checkpointer.due(pending[0], step):
                    self._checkpointer.save(step, state)
        if pending is not None:
            reporter.train(pending[0], pending[1], read_outputs(pending[2]), final=True)
        if step < target:
            logger.info("Input ran out at step %d (before %d).", step, target)
        if self._checkpointer:
            self._checkpointer.save(step, state)
            self._checkpointer.wait()
        return self

    # -- evaluate and predict --------------------------------------------------
    def evaluate(self, input, *, steps: int | None = None) -> dict[str, float]:
        """Exact loss and metrics over the whole input (or its first ``steps`` batches).

        The last partial batch is padded and masked: every example counts
        once. Returns the averages and ``num_examples``.
        """
        batch_size = self.config.global_eval_batch_size
        mesh_lib.check_batch_size("eval_batch_size", batch_size, self.mesh)
        state = self._ensure_state()
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
        report.Reporter(self.config.model_dir, self.config.log_every_steps, batch_size).eval(self._step, results)
        return results

    def predict(self, input) -> Iterator:
        """One prediction per example, in input order, as numpy (a dict if model_fn returned one)."""
        batch_size = self.config.global_predict_batch_size
        mesh_lib.check_batch_size("predict_batch_size", batch_size, self.mesh)
        state = self._ensure_state()
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
