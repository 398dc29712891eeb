"""Estimator: train, evaluate, predict and export one model_fn on every device.

A table of verbs. Each checks its arguments and its input, then hands the
work to the part that owns it: ``trainer.py`` (each training call),
``evaluator.py`` (evaluation and prediction), ``current_state.py`` (which
state), ``serving/export.py``. The parts are built once, in
``assembly.py``; the Estimator decides nothing they decide.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import jax
import optax

from estimax import assembly, averaging, calls, validation
from estimax import config as config_lib
from estimax import host_metrics as host_metrics_lib
from estimax.config import Best, RunConfig
from estimax.current_state import UntrainedWarning  # noqa: F401 (public here)
from estimax.data.plan import Plan
from estimax.errors import ConfigError, ConfigTypeError
from estimax.hooks import Hook
from estimax.layout import ShardingPlan
from estimax.loop import Compiled
from estimax.metrics import Metric
from estimax.serving import export as export_lib
from estimax.step import Core
from estimax.warm_start import WarmStart


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
      warm_start: initialise parameters from another run when ``model_dir``
        has no checkpoint yet (``WarmStart``).
      host_metrics: ``fn(outputs) -> dict[str, float]`` run on the host after
        each evaluation, where ``outputs`` holds the ``Spec(eval_outputs=...)``
        arrays of every valid example, in input order (O(examples) memory).
    """

    def __init__(
        self,
        model: Callable,
        model_fn: Callable,
        optimizer: optax.GradientTransformation,
        config: RunConfig | None = None,
        params: dict | None = None,
        warm_start: WarmStart | None = None,
        host_metrics: Callable | None = None,
    ):
        validation.check_model_fn(model_fn)
        host_metrics_lib.check(host_metrics)
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise ConfigTypeError(
                f"Estimator(optimizer={optimizer!r}) is not an optax GradientTransformation; "
                "expected e.g. `optax.sgd(0.05)` or `optax.adam(1e-3)`."
            )
        self.config = config = config or RunConfig()
        self.params = dict(params or {})
        parts = assembly.assemble(model, model_fn, optimizer, config, self.params, warm_start)
        self.mesh, self.layout, self.run_dir = parts.mesh, parts.layout, parts.run_dir
        self._parts, self._current, self._plan, self._checks = parts, parts.current, parts.plan, parts.checks
        self._evaluator, self._trainer = parts.evaluator, parts.trainer
        self._host_metrics = host_metrics

    # -- state ---------------------------------------------------------------
    @property
    def step(self) -> int:
        """The number of training steps the current state has taken."""
        self._current.current()
        return self._current.step

    def state(self):
        """The current ``TrainState``: the latest checkpoint of model_dir if newer, else what this
        Estimator trained, warm-started or initialised."""
        return self._current.current()

    def _at(self, checkpoint: int | str | None, what: str):
        """The state a verb uses, its ``params`` the weights ``RunConfig.eval_weights`` chooses."""
        calls.check_step(self.run_dir.checkpoints, checkpoint, what)
        return averaging.chosen(self._current.at(checkpoint, what), averaging.evaluates_average(self.config))

    def state_shapes(self):
        """The ``TrainState`` as ``ShapeDtypeStruct``s (with shardings), without allocating it."""
        return self._parts.state_shapes()

    @property
    def core(self) -> Core:
        """The model's pure device functions (``estimax.step.Core``): ``train_step``,
        ``train_loop``, ``eval_step`` and ``predict_step`` of ``(state, batch)``, to lower,
        inspect or build a reference from."""
        return self._parts.core

    def compiled(self) -> Compiled:
        """What has been compiled so far: the device loop training runs, and how many programs
        of each kind (``estimax.loop.Compiled``)."""
        return Compiled.of(self.config.loop, self._trainer.runner, self._evaluator.runner)

    @property
    def plan(self) -> Plan:
        """The input side (``estimax.data.plan.Plan``): each mode's global and host batch, the
        batches on the mesh, the epoch arithmetic and the feature shapes of the last input."""
        return self._plan

    def sharding_plan(self) -> ShardingPlan:
        """Where every parameter lives: rows with ``path``, ``shape``, ``dtype``, ``spec``,
        ``bytes_per_device`` and the rule that placed it, and per-device totals (printable)."""
        return self.layout.plan

    def model(self, checkpoint: int | str | None = None):
        """The model in its framework's form (an NNX or bound Linen module, the Keras model,
        a bound function), in eval behaviour, for interactive use.

        Args:
            checkpoint: a step of model_dir or a checkpoint path; default: the current state.
        """
        state = self._at(checkpoint, "model")
        # Gathered copies: whole arrays on every device, which the next train() cannot donate away.
        params, model_state = _gathered_copy(state.params, state.model_state, self.layout.replicated)
        with jax.set_mesh(self.mesh):
            return self._parts.core.adapter.live(params, model_state)

    # -- train ---------------------------------------------------------------
    @calls.one_thread_at_a_time
    def train(
        self,
        input,
        *,
        max_steps: int | None = None,
        steps: int | None = None,
        epochs: int | None = None,
        hooks: Sequence[Hook] = (),
    ) -> Estimator:
        """Trains until ``max_steps`` (absolute), for ``steps`` more, or until ``epochs`` are done.

        Args:
            input: the training input (``estimax.data``).
            max_steps: the step to train until, counted from step 0.
            steps: how many more steps to train.
            epochs: train until this many epochs are done; counts from step 0 like
                ``max_steps`` (a resumed run finishes the same number of epochs); it
                needs an input of known size.
            hooks: run on the host after every loop (``estimax.hooks.Hook``).
        """
        input = self._checks.train(input)
        self._trainer.train(input, (max_steps, steps, epochs), self._trainer.hooks(hooks))
        return self

    @calls.one_thread_at_a_time
    def train_and_evaluate(
        self,
        train_input,
        eval_input,
        *,
        max_steps: int | None = None,
        epochs: int | None = None,
        eval_every_steps: int | None = None,
        eval_every_epochs: int | None = None,
        best: Best | None = None,
        hooks: Sequence[Hook] = (),
        **deprecated,
    ) -> dict[str, float]:
        """Alternates training and exact evaluation of ``eval_input``; returns the last evaluation.

        Evaluates when a multiple of ``eval_every_steps`` (or of
        ``eval_every_epochs`` epochs) is crossed and at the end, without
        rebuilding or recompiling anything.

        Args:
            train_input: the training input (``estimax.data``).
            eval_input: the held-out input, evaluated exactly each time.
            max_steps: the step to train until, counted from step 0.
            epochs: train until this many epochs of ``train_input`` are done.
            eval_every_steps: evaluate when a multiple of this step is crossed.
            eval_every_epochs: evaluate every this many epochs instead.
            best: names the metric that decides which evaluation is the best
                (``estimax.Best``): its checkpoint is kept in ``<model_dir>/best``, and
                with ``patience`` training stops when it has not improved for that many
                evaluations.
            hooks: run on the host after every loop (``estimax.hooks.Hook``).
            **deprecated: ``best_metric=``, ``mode=`` and ``patience=`` still work for
                one release (a ``DeprecationWarning``): they become ``best=Best(...)``.
        """
        if (eval_every_steps is None) == (eval_every_epochs is None):
            raise ConfigError(
                "train_and_evaluate() needs exactly one of eval_every_steps and eval_every_epochs; "
                f"received {eval_every_steps=}, {eval_every_epochs=}."
            )
        best = config_lib.best_from(best, deprecated)
        every = eval_every_steps
        if eval_every_epochs is not None:
            every = eval_every_epochs * self._plan.steps_per_epoch(train_input)
        hooks = self._trainer.hooks(hooks, best)  # with early stopping where best has a patience
        train_input = self._checks.train(train_input)
        eval_input = self._checks.evaluate(eval_input, validation.metrics_used(hooks, best))
        evaluation = self._trainer.evaluation(
            lambda state, should_stop: self._evaluate(eval_input, state, should_stop=should_stop), every, best
        )
        loop = self._trainer.train(train_input, (max_steps, None, epochs), hooks, evaluation)
        if loop is None:  # nothing left to train: the current state's evaluation
            return self.evaluate(eval_input)
        return loop.last_metrics

    # -- evaluate and predict --------------------------------------------------
    @calls.one_thread_at_a_time
    def evaluate(
        self,
        input,
        *,
        steps: int | None = None,
        checkpoint: int | str | None = None,
        host_metrics: Callable | None = None,
    ) -> dict[str, float]:
        """Exact loss and metrics over the whole input (or its first ``steps`` batches).

        The last partial batch is padded and masked: every example counts
        once.

        Args:
            input: the input to evaluate (``estimax.data``).
            steps: evaluate only the first ``steps`` batches.
            checkpoint: a step of model_dir or a checkpoint path; default: the current state.
            host_metrics: this call's, instead of the Estimator's.

        Returns:
            The results (``"<metric>/<field>"`` for metrics of several values) and
            ``num_examples``.
        """
        host_metrics_lib.check(host_metrics)
        input = self._checks.evaluate(input)
        state = self._at(checkpoint, "evaluate")
        results = self._evaluate(input, state, steps=steps, host_metrics=host_metrics)
        self._parts.writers.record_evaluation(int(jax.device_get(state.step)), results)
        return results

    @calls.one_thread_at_a_time
    def evaluate_states(
        self, input, *, steps: int | None = None, checkpoint: int | str | None = None
    ) -> dict[str, Metric]:
        """The merged metric states of an evaluation (host numpy, int64/float64), by name:
        e.g. a confusion matrix, or the histograms an AUC comes from (``AUCState.points()``)."""
        input = self._checks.evaluate(input)
        state = self._at(checkpoint, "evaluate")
        return self._evaluator.states(input, state, steps=steps)[0]

    def _evaluate(self, input, state, *, steps=None, should_stop=None, host_metrics: Callable | None = None):
        """The results of ``state``'s chosen weights; with the average, ``ema_decay`` says so in its records."""
        average = averaging.evaluates_average(self.config)
        results = self._evaluator.results(
            input,
            averaging.chosen(state, average),
            steps=steps,
            should_stop=should_stop,
            host_metrics=host_metrics or self._host_metrics,
        )
        return results if results is None or not average else {**results, "ema_decay": self.config.ema_decay}

    @calls.one_thread_at_a_time
    def predict(self, input, *, checkpoint: int | str | None = None, gather: bool = False) -> Iterator:
        """One prediction per example, in input order, as numpy (a dict if model_fn returned one).

        With several processes, each yields the examples of its own shard.
        Input order assumes shards ``i::n``, as ``from_arrays`` and Grain
        ``MapDataset`` inputs have.

        Args:
            input: the examples to predict (``estimax.data``).
            checkpoint: a step of model_dir or a checkpoint path; default: the current state.
            gather: ``True``: process 0 yields every process's examples in input order and the
                others yield nothing (all must still iterate: it is a collective).
        """
        input = self._checks.predict(input)
        state = self._at(checkpoint, "predict")
        return self._evaluator.predict(input, state, gather)

    # -- export ------------------------------------------------------------------
    @calls.one_thread_at_a_time
    def export(
        self, path: str, *, checkpoint: int | str | None = None, example_features=None, format: str = "jax"
    ) -> str:
        """Writes a self-contained artifact of the model to ``path``; returns that directory.

        The artifact runs the PREDICT-mode model_fn without the model's code
        (``estimax.serving.load(path)``, ``estimax serve path``), for any batch
        size.

        Args:
            path: the directory to write.
            checkpoint: a step of model_dir or a checkpoint path; default: the current
                state (the latest checkpoint).
            example_features: a batch of features (arrays or ``ShapeDtypeStruct``s, any
                batch size) or an ``ex.data.from_arrays`` dataset, giving each feature's
                shape and dtype; default: those of the last input this Estimator
                trained, evaluated or predicted on.
            format: ``"jax"``, or ``"tf_saved_model"`` for a TensorFlow SavedModel
                instead (needs ``pip install 'estimax[tf]'``).
        """
        if format not in ("jax", "tf_saved_model"):
            raise ConfigError(f"export(format={format!r}); expected 'jax' (the default) or 'tf_saved_model'.")
        features = self._plan.export_features(example_features)
        state = self._at(checkpoint, "export")
        if format == "tf_saved_model":
            from estimax.serving import export_tf

            return export_tf.export(self._parts.core, state, path, features)
        return export_lib.export(self._parts.core, state, path, features)


@functools.partial(jax.jit, static_argnums=2)
def _gathered_copy(params, model_state, replicated):
    return jax.lax.with_sharding_constraint(jax.tree.map(jax.numpy.copy, (params, model_state)), replicated)
