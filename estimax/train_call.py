"""TrainCall: each ``train`` / ``train_and_evaluate`` call of an Estimator, wired around its host loop.

Owns what a call sets up and takes down around the ``HostLoop`` (``host_loop.py``): the
run directory held for writing, the steps to train, the refusal of an input that cannot
continue (before any writer opens), the device loop's runner (built at the first call, kept
for the next ones), the writers and built-in hooks (``call_writers.py``), the profiler, the
evaluations of ``train_and_evaluate`` with their best checkpoint and early stopping, and what
is closed when training fails. Does not own the order of events between loops
(``host_loop.py``), which state is current (``current_state.py``), nor batch sizes and input
positions (``data/plan.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax

from estimax import counting, eval_sets
from estimax import layout as layout_lib
from estimax import mesh as mesh_lib
from estimax.checks import validation
from estimax.config import Best, Epochs
from estimax.data import feed
from estimax.data.plan import describe_input
from estimax.data.source import Source
from estimax.group.preemption import PreemptionWatch
from estimax.hooks import EarlyStopping, Hook, RunInfo
from estimax.hooks.call_writers import CallWriters
from estimax.host_loop import Evaluation, HostLoop
from estimax.loop import DeviceLoop
from estimax.policies import checked_cadence
from estimax.records.profiling import Profiler
from estimax.records.summaries import Summaries
from estimax.run import resize, run_computation
from estimax.run.saves import Saves
from estimax.spec import EVAL, PREDICT, TRAIN
from estimax.state import leaf_names
from estimax.step import Core

logger = logging.getLogger("estimax")


@dataclasses.dataclass(frozen=True)
class ModelOnMesh:
    """The model a call trains: its pure functions (``step.Core``) and where its arrays live
    (``layout.Layout``: the mesh, the state's shardings and their plan)."""

    core: Core
    layout: layout_lib.Layout


class Evaluated(NamedTuple):
    """A ``train_and_evaluate`` call's training input, hooks and evaluations, checked (``TrainCall.evaluated``)."""

    train_input: object
    hooks: list[Hook]
    evaluation: Evaluation
    sets: dict  # each evaluation set's input by name, as the checks returned it


class TrainCall:
    """Trains one Estimator's current state.

    Args:
      config: the ``RunConfig``.
      model: the model's pure functions and where its arrays live (``ModelOnMesh``).
      plan: the ``InputPlan``; run_dir: the ``RunDir`` (or ``NoRunDir``); current: the ``CurrentState``.
      sync: the group's ``Sync``; writers: the Estimator's ``CallWriters``.
    """

    def __init__(self, config, model: ModelOnMesh, plan, run_dir, current, sync, writers: CallWriters):
        self.config, self.core, self.layout, self.plan = config, model.core, model.layout, plan
        self.run_dir, self.current, self.sync, self.writers = run_dir, current, sync, writers
        self.shape = resize.shape(model.layout.mesh)  # the processes, devices and mesh this run trains on
        self.param_names = leaf_names(model.layout.state.params)  # the state's tree, its leaves shardings
        self.runner: DeviceLoop | None = None  # compiled at the first call, kept for the next ones

    def hooks(self, hooks: Sequence[Hook], best: Best | None = None, best_set: str | None = None) -> list[Hook]:
        """The user's hooks, checked, then early stopping where ``best`` has a patience (watching the
        evaluation set ``best_set``; ``None``: the unnamed input)."""
        hooks = validation.check_hooks(hooks)
        if best is not None and best.patience is not None:
            split = eval_sets.split_of(best_set)
            hooks.append(EarlyStopping(best.metric, best.direction, best.patience, best.min_delta, split))
        return hooks

    def evaluated(
        self, train_input, eval_input, eval_every, best: Best | None, hooks: Sequence[Hook], checks, run: Callable
    ) -> Evaluated:
        """What ``train_and_evaluate`` trains with, checked in this order: the cadence (``eval_every``:
        steps or ``Epochs``), the evaluation sets of ``eval_input`` and the one ``best`` reads, the hooks
        with their early stopping and the splits they watch, the training input, then each set with the
        metrics the hooks and ``best`` use. ``checks``: the Estimator's ``ModeChecks``;
        ``run(name, input, state, should_stop=...)`` evaluates one set."""
        cadence = checked_cadence(eval_every)
        sets = eval_sets.named(eval_input)
        best_set = eval_sets.deciding(best, sets)
        every_steps = cadence.count * self.plan.steps_per_epoch(train_input) if isinstance(cadence, Epochs) else cadence
        hooks = self.hooks(hooks, best, best_set)  # with early stopping where best has a patience
        validation.check_watched_splits(hooks, [eval_sets.split_of(name) for name in sets])
        train_input = checks.train(train_input)
        used = validation.metrics_used(hooks, best.metric if best is not None else None)
        checked = {name: checks.evaluate(input, used) for name, input in sets.items()}
        evaluation = self.evaluation(
            lambda name, state, should_stop: run(name, checked[name], state, should_stop=should_stop),
            every_steps,
            best,
            tuple(checked),
            best_set,
        )
        return Evaluated(train_input, hooks, evaluation, checked)

    def evaluation(
        self, run: Callable, every_steps: int, best: Best | None, sets: tuple = (None,), best_set: str | None = None
    ) -> Evaluation:
        """Evaluations by ``run(name, state, should_stop)`` of each set of ``sets`` during training; the
        best one's checkpoint, by ``best``'s metric of the set ``best_set``, kept in ``<model_dir>/best``
        where ``best`` asks for it."""
        keep = best is not None and best.keep_checkpoint
        _note_cadence(every_steps, self.config.steps_per_loop)
        return Evaluation(
            run=run,
            every_steps=every_steps,
            best=self.run_dir.best(best.metric, best.direction) if keep else None,
            best_metric=best.metric if keep else None,
            sets=tuple(sets),
            best_set=best_set,
        )

    def train(
        self, input, lengths: tuple, hooks: Sequence[Hook], evaluation: Evaluation | None = None, computation=None
    ) -> HostLoop | None:
        """Trains over ``input`` for ``lengths`` (``(max_steps, steps, epochs)``, one of them set);
        returns the loop that ran, or ``None`` when the state is already at the target step. ``hooks``:
        as ``hooks()`` gave them; ``computation()``: the training step's fingerprint, which the run records."""
        self.plan.check(TRAIN, EVAL, PREDICT)
        # From the call's start: a signal while the lock is taken or the state restored ends the first loop
        # with a checkpoint, as one during training does, instead of killing a process that holds the lock.
        with PreemptionWatch(saves=self.run_dir.checkpoints.saves) as preemption:
            with self.run_dir.writing(self.sync, evaluation.best if evaluation is not None else None):
                return self._train(input, lengths, hooks, evaluation, computation, preemption)

    def _train(
        self, input, lengths: tuple, hooks: Sequence[Hook], evaluation: Evaluation | None, computation, preemption
    ):
        state = self.current.current()
        if jax.process_count() > 1:
            self.sync.barrier("the checkpoints were checked")  # process 0 may have moved damaged ones aside
            self.run_dir.checkpoints.refresh()
        start = self.current.step
        target, per_epoch = self.plan.target_step(start, *lengths, input)
        if start >= target:
            logger.info("Already at step %d >= %d: nothing to train.", start, target)
            return None
        run_computation.continuing(self.run_dir, start, computation)  # says when it is another computation
        restored = self.current.restored if self.current.origin == "restored" else None
        resized = resize.resumed(self.plan, input, restored, self.shape, start, self.run_dir.records)
        # Before any writer opens: an input that cannot continue from here is refused with nothing written.
        chunks = self.plan.train_chunks(input, start, target, self.current.input_state)
        if restored is not None and start > 0 and not isinstance(input, Source):
            logger.warning(
                "Resuming at step %d from a checkpoint with %s as the training input: estimax cannot know where "
                "an iterable stood at that step, so training goes on with the batches it gives now (a new "
                "generator starts again at its first batch). For an exact continuation, train from a "
                "random-access input (ex.data.from_arrays, ex.data.from_grain(MapDataset), the file readers) or a "
                "Grain IterDataset, whose position a checkpoint keeps.",
                start, describe_input(input),
            )  # fmt: skip
        self._log_start(start, target)
        runner = self._runner(start)
        writers = self.writers.writers(continuing_from=start)
        if resized is not None:
            for writer in writers:
                writer.write("resize", start, resized)
        metric_logger = self.writers.metric_logger(writers)
        best = (evaluation.best, evaluation.best_metric) if evaluation is not None and evaluation.best else None
        saves = Saves(self.run_dir, self.sync, metric_logger, self.plan, best)
        profiler = Profiler(self.config.profile_steps, self.run_dir.profile_dir, start, target)
        loop = HostLoop(
            runner, saves, [metric_logger, *self.writers.progress_bar(), *hooks], self.param_names,
            skip_nonfinite=self.config.skip_nonfinite, profiler=profiler, sync=self.sync,
        )  # fmt: skip
        summaries = Summaries([w for w in writers if getattr(w, "takes_summaries", False)])
        summaries.hparams(self.writers.hparams())
        info = RunInfo(start, target, self.config.train_batch_size, per_epoch, self.run_dir.url, summaries)
        with feed.Prefetch(chunks) as chunks:
            try:
                loop.run(state, info, chunks, self.current.publish, evaluation, preemption)
            except BaseException:
                metric_logger.close(raise_errors=False)  # its writers keep what they hold; the error in flight goes on
                raise
        if self.current.step < target and not loop.stopped:
            logger.info("Input ran out at step %d (before %d).", self.current.step, target)
        if resized is not None and (cost := resize.totals(self.run_dir.records, self.current.step)):
            logger.info("%s", cost)
        return loop

    def _runner(self, start: int) -> DeviceLoop:
        """The device loop's runner, built once; a restored checkpoint's loop mode carries on."""
        if self.runner is None:
            self.runner = DeviceLoop(self.core, self.layout, self.config.loop, self.config.steps_per_loop)
        if self.current.loop is not None:
            self.runner.resume(self.current.loop, start)
        return self.runner

    def _log_start(self, start: int, target: int) -> None:
        logger.info(
            "Training steps %d -> %d: global batch %d on %d devices (mesh %s), %d steps per loop, state %s per device",
            start,
            target,
            self.config.train_batch_size,
            self.layout.mesh.size,
            mesh_lib.describe(self.layout.mesh),
            self.config.steps_per_loop,
            layout_lib.format_bytes(self.layout.plan.totals["total"]),
        )


def _note_cadence(every_steps: int | None, steps_per_loop: int) -> None:
    """One line when evaluations cannot come at every multiple of ``every_steps``: they come at the
    boundaries of the loops that cross one, and a loop runs ``steps_per_loop`` steps."""
    if not every_steps or every_steps % steps_per_loop == 0:
        return
    boundaries = range(steps_per_loop, steps_per_loop * (every_steps + 3), steps_per_loop)
    at = [b for b in boundaries if counting.crossed(every_steps, b - steps_per_loop, b)][:3]
    logger.info(
        "Evaluating every %d steps with %d steps per loop: an evaluation runs at the end of the loop that "
        "crosses a multiple of %d (from step 0: steps %s, ...). For one at every multiple, make steps_per_loop "
        "divide %d.",
        every_steps, steps_per_loop, every_steps, ", ".join(map(str, at)), every_steps,
    )  # fmt: skip
