"""Estimator: train, evaluate and predict one model_fn on every device.

The thin host shell around the compiled core: it resolves how many steps to
run, feeds stacks of batches, dispatches device loops, reads each loop's
outputs only after the next one is dispatched, checkpoints and reports.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence

import jax
import optax

from estimax import accumulation, calls, compile_cache, recording, report, resize, run_record, validation
from estimax import checkpoint as checkpoint_lib
from estimax import config as config_lib
from estimax import host_metrics as host_metrics_lib
from estimax import layout as layout_lib
from estimax import mesh as mesh_lib
from estimax import metrics as metrics_lib
from estimax.config import Best, RunConfig
from estimax.current_state import CurrentState, UntrainedWarning  # noqa: F401 (UntrainedWarning: public here)
from estimax.data import feed
from estimax.data.plan import Plan
from estimax.distributed import Sync
from estimax.errors import ConfigError, ConfigTypeError
from estimax.evaluator import Evaluator
from estimax.hooks import EarlyStopping, Hook, RunInfo, may_stop
from estimax.loop import Compiled, TrainRunner
from estimax.models import resolve as resolve_model
from estimax.profiling import Profiler
from estimax.run_dir import open_run_dir
from estimax.serving import export as export_lib
from estimax.spec import EVAL, PREDICT, TRAIN
from estimax.state import leaf_names
from estimax.step import Core
from estimax.training import Evaluation, TrainingLoop
from estimax.warm_start import WarmStart

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
        if config.skip_nonfinite:  # the update of a NaN/Inf gradient is skipped on the device
            optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=10**9)
        self.params = dict(params or {})
        compile_cache.enable(config.compilation_cache)
        self.mesh = mesh_lib.make_mesh(validation.devices(config.num_devices), config.mesh)
        self._run_record = run_record.record(config.train_batch_size, config.seed, optimizer, resize.shape(self.mesh))
        with jax.set_mesh(self.mesh):  # modules that declare shardings (nnx.with_partitioning) need a mesh to trace
            adapter = resolve_model(model, self.params, config.seed)
            self._core = Core(
                adapter,
                model_fn,
                optimizer,
                self.params,
                config.seed,
                config.compute_dtype,
                config.grad_accum_steps,
                measure_every_step=config.skip_nonfinite,  # every skipped update is counted
            )
            self._abstract_state = jax.eval_shape(self._core.init_state)  # shapes only: traced once
        self.layout = layout_lib.build(
            self.mesh, self._abstract_state, optimizer, config.sharding_rules, config.fsdp_min_bytes
        )
        self._sync = Sync(config.sync_timeout_seconds)
        self.run_dir = open_run_dir(config.model_dir, config.checkpoint, self._run_record)
        self._host_metrics = host_metrics
        self._tracker_runs: dict = {}  # tracker -> run id: one tracker run per Estimator (and model_dir)
        self._current = CurrentState(self.run_dir, self.state_shapes, self._initialise, warm_start, self._run_record)
        self._plan = Plan(config, self.layout, self._sync)
        self._param_names = leaf_names(self._abstract_state.params)
        accumulation.warn_if_multisteps(self._abstract_state.opt_state)
        self._train_runner: TrainRunner | None = None
        self._checks = validation.ModeChecks(self._core, self._abstract_state, self._plan)
        self._evaluator = Evaluator(self._core, self.layout, self._plan, config.quiet)
        report.ensure_console()

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
        calls.check_step(self.run_dir.checkpoints, checkpoint, what)
        return self._current.at(checkpoint, what)

    def state_shapes(self):
        """The ``TrainState`` as ``ShapeDtypeStruct``s (with shardings), without allocating it."""
        return checkpoint_lib.abstract_like(self._abstract_state, self.layout.state)

    def _initialise(self):
        with jax.set_mesh(self.mesh):  # each array is created in its shards: never whole on one device
            return jax.jit(self._core.init_state, out_shardings=self.layout.state)()

    @property
    def core(self) -> Core:
        """The model's pure device functions (``estimax.step.Core``): ``train_step``,
        ``train_loop``, ``eval_step`` and ``predict_step`` of ``(state, batch)``, to lower,
        inspect or build a reference from."""
        return self._core

    def compiled(self) -> Compiled:
        """What has been compiled so far: the device loop training runs, and how many programs
        of each kind (``estimax.loop.Compiled``)."""
        return Compiled.of(self.config.loop, self._train_runner, self._evaluator.runner)

    @property
    def plan(self) -> Plan:
        """The input side (``estimax.data.plan.Plan``): each mode's global and host batch, the
        batches on the mesh, the epoch arithmetic and the feature shapes of the last input."""
        return self._plan

    def sharding_plan(self) -> layout_lib.ShardingPlan:
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
            return self._core.adapter.live(params, model_state)

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
        self._train(input, (max_steps, steps, epochs), hooks)
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
        hooks = validation.check_hooks(hooks)
        if best is not None and best.patience is not None:
            hooks.append(EarlyStopping(best.metric, best.direction, best.patience, best.min_delta))
        train_input = self._checks.train(train_input)
        eval_input = self._checks.evaluate(eval_input, validation.metrics_used(hooks, best))
        keep = best is not None and best.keep_checkpoint
        evaluation = Evaluation(
            run=lambda state, should_stop: self._evaluate(eval_input, state, should_stop=should_stop),
            every_steps=every,
            best=self.run_dir.best(best.metric, best.direction) if keep else None,
            best_metric=best.metric if keep else None,
        )
        loop = self._train(train_input, (max_steps, None, epochs), hooks, evaluation)
        if loop is None:  # nothing left to train: the current state's evaluation
            return self.evaluate(eval_input)
        return loop.last_metrics

    def _train(self, input, lengths: tuple, hooks: Sequence[Hook], evaluation: Evaluation | None = None):
        hooks = validation.check_hooks(hooks)
        self._plan.check(TRAIN, EVAL, PREDICT)
        with self.run_dir.writing(self._sync, evaluation.best if evaluation is not None else None):
            return self._train_steps(input, lengths, hooks, evaluation)

    def _train_steps(self, input, lengths: tuple, hooks: Sequence[Hook], evaluation: Evaluation | None):
        cfg = self.config
        state = self._current.current()
        if jax.process_count() > 1:
            self._sync.barrier("the checkpoints were checked")  # process 0 may have moved damaged ones aside
            self.run_dir.checkpoints.refresh()
        start = self._current.step
        target, per_epoch = self._plan.target_step(start, *lengths, input)
        if start >= target:
            logger.info("Already at step %d >= %d: nothing to train.", start, target)
            return None
        restored = self._current.restored if self._current.origin == "restored" else None
        resized = resize.resumed(self._plan, input, restored, self._run_record["shape"], start, self.run_dir.records)
        # Before any writer opens: an input that cannot continue from here is refused with nothing written.
        chunks = self._plan.train_chunks(input, start, target, self._current.input_state)
        logger.info(
            "Training steps %d -> %d: global batch %d on %d devices (mesh %s), %d steps per loop, state %s per device",
            start,
            target,
            cfg.train_batch_size,
            self.mesh.size,
            mesh_lib.describe(self.mesh),
            cfg.steps_per_loop,
            layout_lib.format_bytes(self.layout.plan.totals["total"]),
        )
        if self._train_runner is None:
            self._train_runner = TrainRunner(self._core, self.layout, cfg.loop, cfg.steps_per_loop)
        if self._current.loop is not None:
            self._train_runner.resume(self._current.loop, start)
        exact_stops = any(map(may_stop, hooks))  # the built-in hooks never stop after a loop
        writers = self._writers(continuing_from=start)
        if resized is not None:
            for writer in writers:
                writer.write("resize", start, resized)
        hooks = recording.builtin_hooks(self.config, writers, self.mesh.size) + list(hooks)
        profiler = Profiler(cfg.profile_steps, self.run_dir.profile_dir, start, target)
        loop = TrainingLoop(
            self._train_runner, self.run_dir.checkpoints, hooks, self._param_names, skip_nonfinite=cfg.skip_nonfinite,
            profiler=profiler, sync=self._sync, exact_stops=exact_stops, saved_position=self._plan.saved_position,
            fence=self.run_dir.fence,
        )  # fmt: skip
        info = RunInfo(start, target, cfg.train_batch_size, per_epoch, self.run_dir.url)
        with feed.Prefetch(chunks) as chunks:
            try:
                loop.run(state, info, chunks, self._current.publish, evaluation)
            except BaseException:
                hooks[0].close(raise_errors=False)  # the metric logger's files: the error in flight goes on
                raise
        if self._current.step < target and not loop.stopped:
            logger.info("Input ran out at step %d (before %d).", self._current.step, target)
        if resized is not None and (cost := resize.totals(self.run_dir.records, self._current.step)):
            logger.info("%s", cost)
        return loop

    def _writers(self, files: bool = True, continuing_from: int | None = None) -> list:
        return recording.writers(self.config, self.run_dir, self.params, self._tracker_runs, files, continuing_from)

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
        recording.record_evaluation(self.run_dir, self._writers, int(jax.device_get(state.step)), results)
        return results

    @calls.one_thread_at_a_time
    def evaluate_states(
        self, input, *, steps: int | None = None, checkpoint: int | str | None = None
    ) -> dict[str, metrics_lib.Metric]:
        """The merged metric states of an evaluation (host numpy, int64/float64), by name:
        e.g. a confusion matrix, or the histograms an AUC comes from (``AUCState.points()``)."""
        input = self._checks.evaluate(input)
        state = self._at(checkpoint, "evaluate")
        return self._evaluator.states(input, state, steps=steps)[0]

    def _evaluate(self, input, state, *, steps=None, should_stop=None, host_metrics: Callable | None = None):
        return self._evaluator.results(
            input, state, steps=steps, should_stop=should_stop, host_metrics=host_metrics or self._host_metrics
        )

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

            return export_tf.export(self._core, state, path, features)
        return export_lib.export(self._core, state, path, features)


@functools.partial(jax.jit, static_argnums=2)
def _gathered_copy(params, model_state, replicated):
    return jax.lax.with_sharding_constraint(jax.tree.map(jax.numpy.copy, (params, model_state)), replicated)
