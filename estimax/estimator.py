"""Estimator: train, evaluate, predict and export one model_fn on every device.

A table of verbs. Each checks its arguments and its input, then hands the
work to the part that owns it: ``train_call.py`` (each training call),
``evaluations.py`` (the evaluation sets on the state a verb reads),
``evaluator.py`` (prediction), ``current_state.py`` (which state),
``serving/export.py``. The parts are built once, in ``assembly.py``; the
Estimator decides nothing they decide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import optax

from estimax import assembly, eval_sets, policies
from estimax import follow as follow_lib
from estimax.checks import calls, validation
from estimax.config import Best, Epochs, RunConfig
from estimax.data.plan import InputPlan
from estimax.fine_tuning import lora as lora_lib
from estimax.fingerprint import Computation
from estimax.follow import FollowPolicy
from estimax.hooks import Hook
from estimax.layout import ShardingPlan
from estimax.loop import Compiled, live_model
from estimax.metrics import Metric
from estimax.run.current_state import UntrainedWarning  # noqa: F401 (public here)
from estimax.run.warm_start import WarmStart
from estimax.serving import adapter_export
from estimax.serving import export as export_lib
from estimax.serving.export_base import ExportBase
from estimax.step import Core


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
        validation.check_arguments(model_fn, optimizer, host_metrics)
        self.config = config = config or RunConfig()
        self.params = dict(params or {})
        parts = assembly.assemble(model, model_fn, optimizer, config, self.params, warm_start, host_metrics)
        self.mesh, self.layout, self.run_dir = parts.mesh, parts.layout, parts.run_dir
        self._parts, self._current, self._plan, self._checks = parts, parts.current, parts.plan, parts.checks
        self._evaluator, self._evaluations, self._train_call = parts.evaluator, parts.evaluations, parts.train_call

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
        return self._evaluations.state_at(checkpoint, what)

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
        return Compiled.of(self.config.loop, self._train_call.runner, self._evaluator.runner)

    @property
    def plan(self) -> InputPlan:
        """The input side (``estimax.data.plan.InputPlan``): each mode's global and host batch, the
        batches on the mesh, the epoch arithmetic and the feature shapes of the last input."""
        return self._plan

    def sharding_plan(self) -> ShardingPlan:
        """Where every parameter lives: rows with ``path``, ``shape``, ``dtype``, ``spec``,
        ``bytes_per_device`` and the rule that placed it, and per-device totals (printable)."""
        return self.layout.plan

    def freeze_plan(self):
        """What trains: per phase of ``RunConfig(freeze=...)``, the counts and bytes of parameters
        trained and frozen, and the frozen paths (printable); ``None`` when nothing is frozen."""
        return self._parts.trainable

    def model(self, checkpoint: int | str | None = None):
        """The model in its framework's form (an NNX or bound Linen module, the Keras model,
        a bound function), in eval behaviour, for interactive use.

        Args:
            checkpoint: a step of model_dir or a checkpoint path; default: the current state.
        """
        state = self._at(checkpoint, "model")
        return live_model(self._parts.core, self.layout, state)

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
        self._train_call.train(
            input, (max_steps, steps, epochs), self._train_call.hooks(hooks), computation=self._checks.computation
        )
        return self

    @overload
    def train_and_evaluate(
        self, train_input, eval_input: Mapping[str, Any], **options
    ) -> dict[str, dict[str, float]]: ...
    @overload
    def train_and_evaluate(self, train_input, eval_input, **options) -> dict[str, float]: ...
    @calls.one_thread_at_a_time
    @policies.takes_old_arguments
    def train_and_evaluate(
        self,
        train_input,
        eval_input,
        *,
        max_steps: int | None = None,
        epochs: int | None = None,
        eval_every: int | Epochs | None = None,
        best: Best | None = None,
        hooks: Sequence[Hook] = (),
    ) -> dict[str, float] | dict[str, dict[str, float]]:
        """Alternates training and exact evaluation of ``eval_input``; returns the last evaluation
        (``{name: results}`` for a mapping of sets).

        Evaluates when a multiple of ``eval_every`` steps (or epochs) is crossed
        and at the end, without rebuilding or recompiling anything.

        Args:
            train_input: the training input (``estimax.data``).
            eval_input: the held-out input, evaluated exactly each time; or a mapping of set
                names to inputs (``{"val": ..., "test": ...}``), each evaluated exactly and
                recorded under its name (the split ``eval_<name>``).
            max_steps: the step to train until, counted from step 0.
            epochs: train until this many epochs of ``train_input`` are done.
            eval_every: evaluate when a multiple of this many steps is crossed; or
                ``estimax.Epochs(n)``: every ``n`` epochs of ``train_input`` (of known size).
            best: names the metric that decides which evaluation is the best
                (``estimax.Best``): its checkpoint is kept in ``<model_dir>/best``, and
                with ``patience`` training stops when it has not improved for that many
                evaluations. With several sets, ``Best(set=...)`` names the one that decides.
            hooks: run on the host after every loop (``estimax.hooks.Hook``).

        ``best_metric=``, ``mode=`` and ``patience=`` still work for one release (a
        ``DeprecationWarning``): they become ``best=Best(...)``; so do ``eval_every_steps=N``
        (``eval_every=N``) and ``eval_every_epochs=N`` (``eval_every=Epochs(N)``).
        """
        call = self._train_call.evaluated(
            train_input, eval_input, eval_every, best, hooks, self._checks, self._evaluations.one_set
        )
        lengths = (max_steps, None, epochs)
        loop = self._train_call.train(
            call.train_input, lengths, call.hooks, call.evaluation, computation=self._checks.computation
        )
        if loop is None:  # nothing left to train: the current state's evaluation
            return self.evaluate(eval_sets.returned(call.sets))
        return loop.last_metrics

    def check(self, mode: str, input):
        """Traces the model_fn abstractly in ``mode`` (``ex.TRAIN``, ``ex.EVAL``, ``ex.PREDICT``) on the
        first batch of ``input``, as that call does before its first step: nothing is compiled or run.
        Returns the input to use from now on (an iterator's first batch is put back)."""
        return self._checks.of_mode(mode, input)

    def computation(self, input) -> Computation | None:
        """What this Estimator's training step computes on ``input``'s batches, traced abstractly
        (``estimax.fingerprint.Computation``); ``None`` for batches that are not dicts, tuples and arrays.
        It reads the first batch: pass an input that can be read again (``estimax.data``), not a plain iterator."""
        self._checks.train(input)
        return self._checks.computation()

    # -- evaluate and predict --------------------------------------------------
    @overload
    def evaluate(
        self,
        input: Mapping[str, Any],
        *,
        steps: int | None = ...,
        checkpoint: int | str | None = ...,
        host_metrics: Callable | None = ...,
    ) -> dict[str, dict[str, float]]: ...
    @overload
    def evaluate(
        self, input, *, steps: int | None = ..., checkpoint: int | str | None = ..., host_metrics: Callable | None = ...
    ) -> dict[str, float]: ...
    @calls.one_thread_at_a_time
    def evaluate(
        self,
        input,
        *,
        steps: int | None = None,
        checkpoint: int | str | None = None,
        host_metrics: Callable | None = None,
    ) -> dict[str, float] | dict[str, dict[str, float]]:
        """Exact loss and metrics over the whole input (or its first ``steps`` batches).

        The last partial batch is padded and masked: every example counts
        once.

        Args:
            input: the input to evaluate (``estimax.data``), or a mapping of set names to
                inputs (``{"val": ..., "test": ...}``): each evaluated exactly and recorded
                under its name (the split ``eval_<name>``).
            steps: evaluate only the first ``steps`` batches (of each set).
            checkpoint: a step of model_dir or a checkpoint path; default: the current state.
            host_metrics: this call's, instead of the Estimator's.

        Returns:
            The results (``"<metric>/<field>"`` for metrics of several values) and
            ``num_examples``; for a mapping, ``{name: results}``.
        """
        return self._evaluations.evaluate(input, steps=steps, checkpoint=checkpoint, host_metrics=host_metrics)

    @calls.one_thread_at_a_time
    def evaluate_states(
        self, input, *, steps: int | None = None, checkpoint: int | str | None = None
    ) -> dict[str, Metric] | dict[str, dict[str, Metric]]:
        """The merged metric states of an evaluation (host numpy, int64/float64), by name:
        e.g. a confusion matrix, or the histograms an AUC comes from (``AUCState.points()``);
        for a mapping of named sets, ``{set name: states}``."""
        return self._evaluations.states(input, steps=steps, checkpoint=checkpoint)

    @calls.one_thread_at_a_time
    def follow(
        self,
        input,
        *,
        name: str = "eval",
        best: Best | None = None,
        export: ExportBase | None = None,
        policy: FollowPolicy | None = None,
    ) -> list[dict]:
        """Evaluates every checkpoint the run's trainer commits, once, in step order, until training ends.

        Runs beside the trainer (another process, host or mesh), and carries on where it stopped
        when started again (``estimax.follow``). Records go to ``<model_dir>/evaluations/<name>.jsonl``
        and TensorBoard's ``<name>`` run; the steps not yet read are held from the trainer's ``keep``.

        Args:
            input: the input to evaluate (``estimax.data``).
            name: the evaluation set's name: records, TensorBoard tags and hold are named after it.
            best: which evaluation is the best (``estimax.Best``): its checkpoint is kept in
                ``<model_dir>/evaluations/<name>-best``.
            export: an ``estimax.serving.ExportBase``: the best (or every) checkpoint exported to
                ``BASE/<step>/``, whole or not at all, keeping the newest few.
            policy: ``estimax.FollowPolicy``: newest only, how often to look, how long the hold lasts.

        Returns:
            This call's records (``"step"``, the results, ``"lag_seconds"``, ``"skipped"``, ``"best"``,
            ``"exported"``).
        """
        input = self._checks.evaluate(input)
        work = follow_lib.Work(
            restore=lambda step: self._at(step, "follow"),
            evaluate=lambda state: self._evaluations.one_set(None, input, state),
            best=best,
            export=lambda state, path: export_lib.export(
                *self._parts.exportable(state), path, self._plan.export_features(None)
            ),
            export_base=export,
        )
        return follow_lib.Follower(self.run_dir, work, name, policy or FollowPolicy(), self._train_call.sync).run()

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
        self,
        path: str,
        *,
        checkpoint: int | str | None = None,
        example_features=None,
        format: str = "jax",
        base_artifact: str | None = None,
    ) -> str:
        """Writes a self-contained artifact of the model to ``path``; returns that directory.

        Under ``RunConfig(lora=...)`` the artifact is the base model with each adapter merged
        into its kernel (``kernel + lora_a @ lora_b * alpha / rank``): one artifact, no adapters;
        with ``base_artifact``, the adapters alone on that export of the base.

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
            base_artifact: under LoRA, a whole export of the base model the adapters were
                trained on: the artifact then holds the adapters alone and names that base by
                its checksums (``estimax.serving.load(path)`` finds and checks it).
        """
        export_lib.check_format(format, base_artifact, self.config.lora)
        features = self._plan.export_features(example_features)
        state = self._at(checkpoint, "export")
        if base_artifact is not None:
            core, base, adapters, rules = lora_lib.adapters_on_base(self._parts.merged, state, self.config.lora)
            return adapter_export.export(core, base, path, features, base_artifact, adapters, rules)
        core, state = self._parts.exportable(state)
        if format == "tf_saved_model":
            from estimax.serving import export_tf

            return export_tf.export(core, state, path, features)
        return export_lib.export(core, state, path, features)

    def save_adapters(self, path: str, *, checkpoint: int | str | None = None) -> str:
        """Writes the LoRA adapters alone to ``path`` (``.npz``; local or a store URL); returns it.

        Start another run from them with ``RunConfig(lora=ex.LoRA(..., adapters=path))`` (its base
        from its own initialisation or a ``WarmStart``); ``WarmStart(path)`` also reads the file.

        Args:
            path: the file to write, ending in ``.npz``.
            checkpoint: a step of model_dir or a checkpoint path; default: the current state.
        """
        return lora_lib.save(self._at(checkpoint, "save_adapters").params, path)
