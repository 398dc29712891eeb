"""Estimator: train, evaluate and predict one model_fn on every device.

The thin host shell around the compiled core: it resolves how many steps to
run, feeds stacks of batches, dispatches device loops, reads each loop's
outputs only after the next one is dispatched, checkpoints and reports.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence

import jax
import optax

from estimax import accumulation, compile_cache, report, run_record, trackers, validation
from estimax import checkpoint as checkpoint_lib
from estimax import export as export_lib
from estimax import host_metrics as host_metrics_lib
from estimax import layout as layout_lib
from estimax import mesh as mesh_lib
from estimax import metrics as metrics_lib
from estimax import predictions as predictions_lib
from estimax import training as training_lib
from estimax.config import RunConfig
from estimax.data import feed
from estimax.distributed import Sync
from estimax.hooks import EarlyStopping, Hook, RunInfo
from estimax.loop import EvalRunner, TrainRunner
from estimax.models import resolve as resolve_model
from estimax.profiling import Profiler
from estimax.progress import EvalProgress, ProgressBar
from estimax.report import MetricLogger
from estimax.run_dir import open_run_dir
from estimax.state import leaf_names
from estimax.step import Core
from estimax.training import Evaluation, TrainingLoop
from estimax.warm_start import WarmStart
from estimax.writers import ConsoleWriter

logger = logging.getLogger("estimax")


class UntrainedWarning(UserWarning):
    """evaluate, predict or model() used the initial weights: nothing was trained or restored."""


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
            raise TypeError(
                f"Estimator(optimizer={optimizer!r}) is not an optax GradientTransformation; "
                "expected e.g. `optax.sgd(0.05)` or `optax.adam(1e-3)`."
            )
        self.config = config = config or RunConfig()
        if config.skip_nonfinite:  # the update of a NaN/Inf gradient is skipped on the device
            optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=10**9)
        self.params = dict(params or {})
        compile_cache.enable(config.compilation_cache)
        self._run_record = run_record.record(config.train_batch_size, config.seed, optimizer)
        self.mesh = mesh_lib.make_mesh(validation.devices(config.num_devices), config.mesh)
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
        self._warm_start = warm_start
        self._host_metrics = host_metrics
        self._tracker_runs: dict = {}  # tracker -> run id: one tracker run per Estimator (and model_dir)
        self._state, self._step, self._seen_latest, self._input_state = None, None, None, None
        self._origin = None  # where the state came from: "initial", "warm_start", "restored", "trained"
        self._warned_untrained = False
        self._feature_spec = None  # per-example shapes of the last input seen, for export()
        self._loop_mode: str | None = None  # the loop mode of the restored checkpoint
        self._param_names = leaf_names(self._abstract_state.params)
        accumulation.warn_if_multisteps(self._abstract_state.opt_state)
        self._train_runner: TrainRunner | None = None
        self._eval_runner: EvalRunner | None = None
        report.ensure_console()

    # -- state ---------------------------------------------------------------
    @property
    def step(self) -> int:
        """The number of training steps the current state has taken."""
        self._ensure_state()
        return self._step

    def state(self):
        """The current ``TrainState``: the latest checkpoint of model_dir if newer, else what this
        Estimator trained, warm-started or initialised."""
        return self._ensure_state()

    def state_shapes(self):
        """The ``TrainState`` as ``ShapeDtypeStruct``s (with shardings), without allocating it."""
        return checkpoint_lib.abstract_like(self._abstract_state, self.layout.state)

    def sharding_plan(self) -> layout_lib.ShardingPlan:
        """Where every parameter lives: rows with ``path``, ``shape``, ``dtype``, ``spec``,
        ``bytes_per_device`` and the rule that placed it, and per-device totals (printable)."""
        return self.layout.plan

    def _ensure_state(self):
        """The latest good checkpoint in model_dir if newer than what is in memory, else a
        fresh initialisation (warm-started if asked)."""
        checkpoints = self.run_dir.checkpoints
        latest = checkpoints.latest_step()
        if latest is not None and latest != self._seen_latest and (self._state is None or latest > self._step):
            self._seen_latest = latest
            self._state, meta = checkpoints.restore(self.state_shapes())
            self._step, self._input_state, self._origin = meta["step"], meta.get("input_state"), "restored"
            self._loop_mode = meta.get("loop")
            run_record.warn_on_resume(meta.get("run"), self._run_record, self._step, checkpoints.directory)
        elif self._state is None:
            with jax.set_mesh(self.mesh):  # each array is created in its shards: never whole on one device
                self._state = jax.jit(self._core.init_state, out_shardings=self.layout.state)()
            self._origin = "initial"
            if self._warm_start is not None:
                self._state, self._origin = self._warm_start.apply(self._state), "warm_start"
            self._step = 0
        return self._state

    def _warn_if_untrained(self, what: str) -> None:
        """Warns once when ``what`` uses the initial weights: nothing trained, restored or warm-started."""
        if self._origin != "initial" or self._warned_untrained:
            return
        self._warned_untrained = True
        warnings.warn(
            f"Estimator.{what}() uses the initial, untrained weights: {self.run_dir.no_checkpoint()} and this "
            "Estimator has not "
            "trained. Fix: train() first, set model_dir to a trained run, or pass checkpoint=<step or path>.",
            UntrainedWarning,
            stacklevel=4,
        )

    def _state_at(self, checkpoint: int | str | None, what: str):
        """The current state, or the one of ``checkpoint``: a step of model_dir or a path."""
        if checkpoint is None:
            state = self._ensure_state()
            self._warn_if_untrained(what)
            return state
        if isinstance(checkpoint, int) and not isinstance(checkpoint, bool):
            checkpointer, step = self.run_dir.checkpoints, checkpoint
        else:
            checkpointer, step = checkpoint_lib.locate(checkpoint)
        return checkpointer.restore(self.state_shapes(), step)[0]

    def model(self, checkpoint: int | str | None = None):
        """The model in its framework's form (an NNX or bound Linen module, the Keras model,
        a bound function), in eval behaviour, for interactive use.

        ``checkpoint``: a step of model_dir or a checkpoint path; default: the current state.
        """
        state = self._state_at(checkpoint, "model")
        # Gathered copies: whole arrays on every device, which the next train() cannot donate away.
        params, model_state = _gathered_copy(state.params, state.model_state, self.layout.replicated)
        with jax.set_mesh(self.mesh):
            return self._core.adapter.live(params, model_state)

    # -- train ---------------------------------------------------------------
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

        ``epochs`` counts from step 0 like ``max_steps`` (a resumed run
        finishes the same number of epochs); it needs an input of known size.
        ``hooks`` run on the host after every loop (``estimax.hooks.Hook``).
        """
        self._train(input, (max_steps, steps, epochs), hooks)
        return self

    def train_and_evaluate(
        self,
        train_input,
        eval_input,
        *,
        max_steps: int | None = None,
        epochs: int | None = None,
        eval_every_steps: int | None = None,
        eval_every_epochs: int | None = None,
        best_metric: str | None = None,
        mode: str = "max",
        patience: int | None = None,
        hooks: Sequence[Hook] = (),
    ) -> dict[str, float]:
        """Alternates training and exact evaluation of ``eval_input``; returns the last evaluation.

        Evaluates when a multiple of ``eval_every_steps`` (or of
        ``eval_every_epochs`` epochs) is crossed and at the end, without
        rebuilding or recompiling anything. ``best_metric`` keeps the best
        checkpoint by that metric (``mode`` "max" or "min") in
        ``<model_dir>/best``; ``patience`` stops when it has not improved for
        that many evaluations (``best_metric``, or the loss, with ``mode``).
        """
        if (eval_every_steps is None) == (eval_every_epochs is None):
            raise ValueError(
                "train_and_evaluate() needs exactly one of eval_every_steps and eval_every_epochs; "
                f"received {eval_every_steps=}, {eval_every_epochs=}."
            )
        if mode not in ("max", "min"):
            raise ValueError(f"train_and_evaluate(mode={mode!r}); expected 'max' or 'min'.")
        every = eval_every_steps
        if eval_every_epochs is not None:
            every = eval_every_epochs * training_lib.steps_per_epoch(
                train_input, self.config.train_batch_size // jax.process_count()
            )
        hooks = validation.check_hooks(hooks)
        if patience is not None:
            hooks.append(EarlyStopping(best_metric or "loss", mode if best_metric else "min", patience))
        self._check_metric_names(eval_input, train_input, validation.metrics_used(hooks, best_metric))
        best = None if best_metric is None else self.run_dir.best(best_metric, mode)
        evaluation = Evaluation(
            run=lambda state, should_stop: self._evaluate(eval_input, state, should_stop=should_stop),
            every_steps=every,
            best=best,
            best_metric=best_metric,
        )
        loop = self._train(train_input, (max_steps, None, epochs), hooks, evaluation)
        if loop is None:  # nothing left to train: the current state's evaluation
            return self.evaluate(eval_input)
        return loop.last_metrics

    def _check_batch_sizes(self) -> None:
        cfg = self.config
        if cfg.grad_accum_steps > 1:  # first: its nearest sizes also split over the devices
            accumulation.check_batch_size(cfg.train_batch_size, cfg.grad_accum_steps, self.layout.batch)
        mesh_lib.check_batch_size("train_batch_size", cfg.train_batch_size, self.mesh)
        mesh_lib.check_batch_size("eval_batch_size", cfg.global_eval_batch_size, self.mesh)
        mesh_lib.check_batch_size("predict_batch_size", cfg.global_predict_batch_size, self.mesh)

    def _check_metric_names(self, eval_input, train_input, used: dict[str, str]) -> None:
        """Raises unless every metric in ``used`` is among the evaluation's outputs, traced abstractly
        on the first batch of the evaluation input (or of the training input, when only that one
        can be read again); nothing is compiled or evaluated. Plain iterables are checked at the
        first evaluation instead."""
        if not used:
            return
        size = self.config.global_eval_batch_size
        batch = validation.first_eval_batch(eval_input, size // jax.process_count())
        if batch is None:
            batch = validation.first_eval_batch(train_input, size // jax.process_count())
        if batch is None:
            return
        with jax.set_mesh(self.mesh):  # modules that declare shardings need a mesh to trace
            values, _ = jax.eval_shape(
                self._core.eval_values, self._abstract_state, validation.abstract_batch(batch, size)
            )
        validation.check_metric_names(used, validation.metric_names(metrics_lib.result_names(values, size)))

    def _train(self, input, lengths: tuple, hooks: Sequence[Hook], evaluation: Evaluation | None = None):
        hooks = validation.check_hooks(hooks)
        self._check_batch_sizes()
        with self.run_dir.writing(self._sync, evaluation.best if evaluation is not None else None):
            return self._train_steps(input, lengths, hooks, evaluation)

    def _train_steps(self, input, lengths: tuple, hooks: Sequence[Hook], evaluation: Evaluation | None):
        cfg = self.config
        host_batch = cfg.train_batch_size // jax.process_count()
        state = self._ensure_state()
        if jax.process_count() > 1:
            self._sync.barrier("the checkpoints were checked")  # process 0 may have moved damaged ones aside
            self.run_dir.checkpoints.refresh()
        start = self._step
        target, per_epoch = training_lib.target_step(start, *lengths, input, host_batch)
        if start >= target:
            logger.info("Already at step %d >= %d: nothing to train.", start, target)
            return None
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
        if self._loop_mode is not None:
            self._train_runner.resume(self._loop_mode, start)
        loop = TrainingLoop(
            self._train_runner,
            self.run_dir.checkpoints,
            self._hooks(hooks),
            self._param_names,
            skip_nonfinite=cfg.skip_nonfinite,
            profiler=Profiler(cfg.profile_steps, self.run_dir.profile_dir),
            sync=self._sync,
        )
        chunk_sizes = [min(cfg.steps_per_loop, target - s) for s in range(start, target, cfg.steps_per_loop)]
        stacks = feed.train_stacks(
            input, host_batch, chunk_sizes, seed=cfg.seed, start_step=start, input_state=self._input_state
        )

        def publish(state, step, input_state):
            self._state, self._step, self._input_state, self._origin = state, step, input_state, "trained"

        info = RunInfo(start, target, cfg.train_batch_size, per_epoch, self.run_dir.url)
        chunks = self._noting_features(feed.train_chunks(stacks, self.mesh, cfg.train_batch_size), stacked=True)
        with feed.Prefetch(chunks) as chunks:
            loop.run(state, info, chunks, publish, evaluation)
        if self._step < target and not loop.stopped:
            logger.info("Input ran out at step %d (before %d).", self._step, target)
        return loop

    def _hooks(self, extra: Sequence[Hook] = ()) -> list[Hook]:
        """The built-in hooks (metric logging, progress bar) and the user's."""
        cfg = self.config
        hooks: list[Hook] = [MetricLogger(self._writers(), cfg.log_every_steps, cfg.train_batch_size)]
        if not cfg.quiet and jax.process_index() == 0 and sys.stderr.isatty():
            hooks.append(ProgressBar(cfg.train_batch_size))
        return hooks + list(extra)

    def _writers(self, files: bool = True) -> list:
        """metrics.jsonl, TensorBoard, tracker and console writers; files and trackers on process 0 only,
        and only with ``files`` (what this process may write)."""
        cfg = self.config
        writers: list = [ConsoleWriter(train_lines=not cfg.quiet and not sys.stderr.isatty())]
        if jax.process_index() != 0 or not files:
            return writers
        tensorboard = cfg.tensorboard or (cfg.tensorboard is None and bool(importlib.util.find_spec("tensorboardX")))
        writers += self.run_dir.file_writers(tensorboard)
        return writers + trackers.writers(cfg, self.params, self._tracker_runs, self.run_dir)

    # -- evaluate and predict --------------------------------------------------
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
        once. Returns the results (``"<metric>/<field>"`` for metrics of
        several values) and ``num_examples``. ``checkpoint``: a step of
        model_dir or a checkpoint path; default: the current state.
        ``host_metrics``: this call's, instead of the Estimator's.
        """
        host_metrics_lib.check(host_metrics)
        state = self._state_at(checkpoint, "evaluate")
        results = self._evaluate(input, state, steps=steps, host_metrics=host_metrics)
        self._record_evaluation(int(jax.device_get(state.step)), results)
        return results

    def _record_evaluation(self, step: int, results: dict[str, float]) -> None:
        """Writes an evaluation to the console, and to model_dir's files when this process may write
        there: not while another process holds its lock (a run in training keeps its files to
        itself), nor when it is not writable; either is said, and the results are still returned."""
        with self.run_dir.recording(f"The evaluation of step {step}") as files:
            try:
                for writer in self._writers(files):
                    writer.write("eval", step, results)
                    writer.close()
            except OSError as error:
                logger.warning("The evaluation of step %d was not written to %s: %s", step, self.run_dir.url, error)

    def evaluate_states(
        self, input, *, steps: int | None = None, checkpoint: int | str | None = None
    ) -> dict[str, metrics_lib.Metric]:
        """The merged metric states of an evaluation (host numpy, int64/float64), by name:
        e.g. a confusion matrix, or the histograms an AUC comes from (``AUCState.points()``)."""
        return self._evaluate_states(input, self._state_at(checkpoint, "evaluate"), steps=steps)[0]

    def _evaluate(
        self, input, state, *, steps: int | None = None, should_stop=None, host_metrics: Callable | None = None
    ) -> dict[str, float] | None:
        """The metrics of ``state`` on ``input``; ``None`` if ``should_stop()`` interrupted it."""
        host_metrics = host_metrics or self._host_metrics
        totals, rows = self._evaluate_states(
            input, state, steps=steps, should_stop=should_stop, rows=bool(host_metrics)
        )
        if totals is None:
            return None
        results = {}
        for name in sorted(totals, key=lambda n: n == metrics_lib.NUM_EXAMPLES):  # num_examples last
            results.update(metrics_lib.results(name, totals[name]))
        if host_metrics is not None:
            results.update(host_metrics_lib.results(host_metrics, rows.rows(), results))
        return results

    def _evaluate_states(self, input, state, *, steps=None, should_stop=None, rows: bool = False):
        """``(states, OutputRows or None)``; ``(None, None)`` if ``should_stop()`` interrupted it."""
        batch_size = self.config.global_eval_batch_size
        mesh_lib.check_batch_size("eval_batch_size", batch_size, self.mesh)
        batches = feed.eval_batches(input, batch_size // jax.process_count())
        if steps is not None:
            batches = itertools.islice(batches, steps)
        outputs = host_metrics_lib.OutputRows() if rows else None
        device_batches = self._noting_features(feed.eval_device_batches(batches, self.mesh, batch_size))
        with feed.Prefetch(device_batches) as device_batches:
            bar = self._eval_bar(input, batch_size, steps)
            try:
                totals = self._evaluator().totals(state, bar.wrap(device_batches), should_stop, outputs)
            finally:
                bar.close()
        if totals is None:
            if should_stop is not None and should_stop():
                return None, None
            raise ValueError("Evaluation input yielded no batches; expected at least one example.")
        return totals, outputs

    def _eval_bar(self, input, batch_size: int, steps: int | None) -> EvalProgress:
        shown = not self.config.quiet and jax.process_index() == 0 and sys.stderr.isatty()
        total = -(-len(input) // batch_size) if hasattr(input, "steps_per_epoch") else None
        return EvalProgress(min(filter(None, (total, steps)), default=None), shown)

    def predict(self, input, *, checkpoint: int | str | None = None, gather: bool = False) -> Iterator:
        """One prediction per example, in input order, as numpy (a dict if model_fn returned one).

        With several processes, each yields the examples of its own shard;
        ``gather=True``: process 0 yields every process's examples in input
        order and the others yield nothing (all must still iterate: it is a
        collective). Input order assumes shards ``i::n``, as ``from_arrays``
        and Grain ``MapDataset`` inputs have. ``checkpoint``: a step of
        model_dir or a checkpoint path; default: the current state.
        """
        batch_size = self.config.global_predict_batch_size
        mesh_lib.check_batch_size("predict_batch_size", batch_size, self.mesh)
        state = self._state_at(checkpoint, "predict")
        predict = self._evaluator().predict
        rows = predictions_lib.gathered_rows if gather and jax.process_count() > 1 else predictions_lib.rows
        batches = feed.eval_batches(input, batch_size // jax.process_count())
        pending = None
        device_batches = self._noting_features(feed.eval_device_batches(batches, self.mesh, batch_size))
        with feed.Prefetch(device_batches) as device_batches:
            for db in device_batches:
                predictions = predict(state, db.batch)
                if pending is not None:
                    yield from rows(*pending)
                pending = (predictions, db.num_valid)
        if pending is not None:
            yield from rows(*pending)

    def _noting_features(self, items: Iterator, stacked: bool = False) -> Iterator:
        """``items`` (device chunks or batches) unchanged; remembers the first one's feature shapes."""
        for i, item in enumerate(items):
            if i == 0:
                features = (item.stack if stacked else item.batch)[0]
                self._feature_spec = export_lib.feature_spec(features, leading_axes=2 if stacked else 1)
            yield item

    # -- export ------------------------------------------------------------------
    def export(
        self, path: str, *, checkpoint: int | str | None = None, example_features=None, format: str = "jax"
    ) -> str:
        """Writes a self-contained artifact of the model to ``path``; returns that directory.

        The artifact runs the PREDICT-mode model_fn without the model's code
        (``estimax.serving.load(path)``, ``estimax serve path``), for any batch
        size. ``checkpoint``: a step of model_dir or a checkpoint path;
        default: the current state (the latest checkpoint).
        ``example_features``: a batch of features (arrays or
        ``ShapeDtypeStruct``s, any batch size) or an ``ex.data.from_arrays``
        dataset, giving each feature's shape and dtype; default: those of the
        last input this Estimator trained, evaluated or predicted on.
        ``format="tf_saved_model"``: a TensorFlow SavedModel instead (needs
        ``pip install 'estimax[tf]'``).
        """
        if format not in ("jax", "tf_saved_model"):
            raise ValueError(f"export(format={format!r}); expected 'jax' (the default) or 'tf_saved_model'.")
        if example_features is not None:
            features = export_lib.feature_spec(getattr(example_features, "features", example_features))
        elif self._feature_spec is not None:
            features = self._feature_spec
        else:
            raise ValueError(
                "export() needs the shape and dtype of each feature, and this Estimator has not seen any input "
                "yet. Fix: pass a batch, e.g. `est.export(path, example_features={'image': images[:1]})`, or "
                "call train/evaluate/predict first."
            )
        state = self._state_at(checkpoint, "export")
        if format == "tf_saved_model":
            from estimax import export_tf

            return export_tf.export(self._core, state, path, features)
        return export_lib.export(self._core, state, path, features)

    def _evaluator(self) -> EvalRunner:
        if self._eval_runner is None:
            self._eval_runner = EvalRunner(self._core, self.layout)
        return self._eval_runner


@functools.partial(jax.jit, static_argnums=2)
def _gathered_copy(params, model_state, replicated):
    return jax.lax.with_sharding_constraint(jax.tree.map(jax.numpy.copy, (params, model_state)), replicated)
