"""The host loop of training: what happens between and around device loops.

Owns the order of events at a loop boundary: dispatch the next loop, read
the previous loop's outputs (never the one just dispatched, so the device is
not left idle), check them for NaN/Inf, hand records to the hooks, evaluate
when due, checkpoint when due, stop on preemption, early stopping or a
non-finite value, and account where the time went. The device loops
themselves are ``loop.py``'s; ``train_call.py`` sets each call up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from estimax import counting, eval_sets
from estimax import metrics as metrics_lib
from estimax.distributed import Sync
from estimax.errors import LeaseLostError, NonFiniteError, StoreUnavailableError
from estimax.group import preemption as preemption_lib
from estimax.group.preemption import PreemptionWatch
from estimax.hooks import EvalRecord, Hook, LoopRecord, RunInfo, Summary, may_stop, no_model
from estimax.loop import read_outputs
from estimax.records.profiling import Profiler
from estimax.records.summaries import Summaries
from estimax.run.saves import Saves
from estimax.state import has_deleted_arrays

logger = logging.getLogger("estimax")


@dataclasses.dataclass
class Evaluation:
    """Evaluations during training: when a multiple of ``every_steps`` is crossed, and at the end.

    ``run(name, state, should_stop)`` returns the metrics of the evaluation set ``name``, or
    ``None`` when ``should_stop()`` interrupted it. ``sets``: the names evaluated each time, in
    order (``(None,)``: one unnamed input, recorded as ``eval``). ``best`` keeps the best
    checkpoint by ``best_metric`` of the set ``best_set``.
    """

    run: Callable
    every_steps: int | None
    best: object | None = None
    best_metric: str | None = None
    sets: tuple[str | None, ...] = (None,)
    best_set: str | None = None


@dataclasses.dataclass
class _Loop:
    """A dispatched loop whose outputs (device arrays) are read later, once."""

    step_before: int
    step_after: int
    outputs: list
    input_state: object
    _host: dict[str, np.ndarray] | None = None

    def host(self) -> dict[str, np.ndarray]:
        if self._host is None:
            self._host = read_outputs(self.outputs)  # host sync: waits for this loop
        return self._host


class Laps:
    """Seconds between the reads of consecutive loops, less the host's pauses in between
    (checkpoints, evaluations): a loop's time once the device is the bottleneck."""

    def __init__(self):
        self.last_read: float | None = None
        self.paused = 0.0

    def lap(self, untimed: bool = False, final: bool = False) -> float | None:
        """The seconds since the last timed read; ``None`` where not comparable.

        The first read (compilation), the final one (nothing dispatched after it) and
        one read early for an evaluation are not timed; the read after an untimed one
        starts a new interval.
        """
        now = time.perf_counter()
        seconds = None if (self.last_read is None or final or untimed) else now - self.last_read - self.paused
        self.last_read, self.paused = (None if untimed else now), 0.0
        return seconds

    def pause(self, seconds: float) -> None:
        self.paused += seconds


class HostLoop:
    """One ``train`` / ``train_and_evaluate`` call's host loop."""

    def __init__(
        self,
        runner,
        saves: Saves,
        hooks: Sequence[Hook],
        param_names: list[str],
        *,
        skip_nonfinite: bool,
        profiler: Profiler,
        sync: Sync | None = None,
    ):
        self.runner, self.saves, self.hooks = runner, saves, list(hooks)
        self.param_names, self.skip_nonfinite, self.profiler = param_names, skip_nonfinite, profiler
        self.sync = sync or Sync()  # barriers and status with several processes; free with one
        # Whether a hook may stop after a loop (decided here only): then each loop is read before the next
        # is dispatched. The built-in hooks never stop (``may_stop = False``) and keep the overlap.
        self.exact_stops = any(map(may_stop, self.hooks))
        self.seconds = dict.fromkeys(("compile", "input_wait", "checkpoint", "evaluation"), 0.0)
        self.laps = Laps()
        self.last_results: dict = {}  # of the last evaluation: {set name (None: the unnamed input): metrics}
        self.last_eval_step: int | None = None
        self.stopped = False  # by a hook (early stopping)
        self._summaries = Summaries()  # the call's, from ``run``'s RunInfo
        self._stop_reason = ""
        self._unsaved_note = ""  # the last line's note of a call that ended without saving its step

    @property
    def last_metrics(self):
        """The last evaluation's results: one dict for an unnamed input, ``{name: results}`` for sets."""
        return eval_sets.returned(self.last_results) if self.last_results else {}

    def run(self, state, info: RunInfo, chunks, publish: Callable, evaluation: Evaluation | None, preemption):
        """Trains from ``info.start_step`` over ``chunks`` (a ``feed.Prefetch``); returns ``(state, step)``.

        ``publish(state, step, input_state)`` is called after every dispatch, so that the
        caller always holds the newest state (also when an error stops training). ``preemption``:
        the call's active ``PreemptionWatch``; a signal it caught stops training after a loop.
        """
        began = time.perf_counter()
        self._summaries = info.summaries
        for hook in self.hooks:
            hook.begin(info)
        # A process that is late here (a crash, another command line) is named, not waited for forever.
        self.sync.barrier(f"the first loop (training from step {info.start_step})")
        self.saves.begin()
        try:
            state, last, unread = self._loops(state, info.start_step, chunks, publish, evaluation, preemption)
            self._finish(state, last, unread, evaluation, preemption)
            step = info.start_step if last is None else last.step_after
            self._end(step, time.perf_counter() - began)
            if preemption.signal_name is not None:
                saved = self.saves.latest_step() == step
                stopped = preemption_lib.stopped(step, preemption.signal_name, self.saves.directory if saved else None)
                logger.warning("%s", stopped)
                raise stopped
            return state, step
        except BaseException as error:
            self.saves.wait()  # saves in flight complete: checkpoints already written stay valid
            if isinstance(error, StoreUnavailableError) and "resume from" not in str(error):
                # a store that stopped answering under a writer: the line says where the run resumes
                raise StoreUnavailableError(f"{str(error).rstrip('.')}; {self.saves.resume_note()}.") from None
            raise

    def _loops(self, state, step: int, chunks, publish: Callable, evaluation, preemption):
        """Dispatches a loop per chunk, then handles its boundary, until the input ends or
        training stops; returns ``(state, the last loop dispatched, the loop not yet read)``."""
        last = unread = None
        while (fetched := chunks.get(after=last and last.outputs)) is not None:
            chunk, waited = fetched
            self.seconds["input_wait"] += waited
            state, last = self._dispatch(state, step, chunk)
            step = last.step_after
            publish(state, step, last.input_state)
            unread, ends = self._boundary(state, last, unread, waited, evaluation, preemption)
            if ends:
                break
        return state, last, unread

    def _dispatch(self, state, step: int, chunk) -> tuple[object, _Loop]:
        self.sync.status(f"training: dispatching the loop of steps {step + 1}-{step + chunk.num_steps}")
        self.profiler.before_loop(step, step + chunk.num_steps, state)
        with self.profiler.annotate(step):
            state, outputs, compiling = self.runner.run(state, chunk)
        self.seconds["compile"] += compiling
        return state, _Loop(step, step + chunk.num_steps, outputs, chunk.input_state)

    def _boundary(self, state, current: _Loop, unread, waited: float, evaluation, preemption):
        """After ``current`` is dispatched: reads the loop before it, evaluates and saves when due.

        Returns ``(the loop left unread, whether training ends here)``. ``waited`` (the
        device's idle seconds before this dispatch) is reported with the next loop read.
        """
        before, step = current.step_before, current.step_after
        self.saves.fence()
        due, stop = self.saves.due(before, step), False
        with self._saving_on_error(state, current, due):
            if unread is not None:
                stop |= self._after_loop(unread, waited)
                waited = 0.0
            unread = current
            if self.exact_stops:  # a hook may stop here: it reads this loop before the next is dispatched
                stop |= self._after_loop(current, waited, state=state)
                unread = None
            self.profiler.after_loop(step, state)
            if preemption.requested(step, since=before):
                return unread, True
        evaluating = evaluation is not None and counting.crossed(evaluation.every_steps, before, step)
        # A failed evaluation ends training: the state it evaluated is saved first.
        with self._saving_on_error(state, current, due or evaluating and self.saves.enabled):
            if unread is not None and (evaluating or due):  # they wait for this loop anyway: report it, untimed
                stop |= self._after_loop(current, 0.0, untimed=True, state=state)
                unread = None
            if evaluating:
                stop |= self._evaluate(evaluation, state, current, preemption)
        if due:
            self._save(state, current)
        if stop:
            self.stopped = True
            logger.info("Training stopped at step %d: %s.", step, self._stop_reason)
        return unread, stop

    def _finish(self, state, last: _Loop | None, unread: _Loop | None, evaluation, preemption) -> None:
        """The last read, the final evaluation and save; waits for the saves in flight."""
        # Still watching: a signal during the final save is one line, and the save completes.
        with self._saving_on_error(state, last, self.saves.enabled and last is not None):
            if unread is not None:
                self._after_loop(unread, 0.0, final=True, state=state)  # the last loop: ``state`` is its
            if preemption.signal_name is None and evaluation is not None and not self.stopped:
                self._evaluate(evaluation, state, last, preemption, final=True)
        if last is not None and (self.saves.at_end or self.saves.enabled and preemption.signal_name):
            self._save(state, last)
        self.profiler.stop(state)
        timer = time.perf_counter()
        self.saves.finish()
        self.seconds["checkpoint"] += time.perf_counter() - timer
        if last is not None and self.saves.enabled and self.saves.saved_step != last.step_after:  # at_end=False
            latest = self.saves.latest_step()
            self._unsaved_note = f"; step {last.step_after} not saved (CheckpointPolicy(at_end=False)), " + (
                "no checkpoint yet" if latest is None else f"the last checkpoint is step {latest}"
            )

    # -- at a loop boundary ----------------------------------------------------
    @contextlib.contextmanager
    def _saving_on_error(self, state, loop: _Loop | None, due: bool):
        """A mistake found at a loop boundary (a hook, a writer, an evaluation) never discards
        the checkpoint that was due there: it is saved, then the error goes on."""
        try:
            yield
        except (NonFiniteError, LeaseLostError, StoreUnavailableError):
            raise  # never save a state that came out of a NaN, nor without the lease
        except Exception:
            if due and loop is not None:
                self._save(state, loop)
            raise

    def _after_loop(self, loop: _Loop, waited: float, final=False, untimed=False, state=None) -> bool:
        """Hands ``loop``'s record to the hooks; whether one asked to stop. ``state``: the state after
        ``loop``, where it is still on the devices (the record's ``model()``)."""
        outputs = self._checked(loop)
        seconds = self.laps.lap(untimed=untimed, final=final)
        record = LoopRecord(
            loop.step_before,
            loop.step_after,
            outputs,
            seconds,
            waited if seconds else 0.0,
            final,
            self.runner.flops_per_step,
            model=self._model(state, loop.step_after),
            summaries=self._summaries.at(loop.step_after, "train"),
        )
        stopping = [hook for hook in self.hooks if hook.after_loop(record)]  # every hook sees every loop
        return self._asked_to_stop(stopping, "after_loop", loop.step_after)

    def _model(self, state, step: int):
        """A record's ``model()``: ``state``'s model while it is on the devices."""
        if state is None:
            return no_model(step)
        return lambda: no_model(step)() if has_deleted_arrays(state) else self.runner.model(state)

    def _asked_to_stop(self, hooks: list[Hook], method: str, step: int) -> bool:
        if hooks and not self._stop_reason:
            names = ", ".join(type(hook).__name__ for hook in hooks)
            self._stop_reason = f"{names}.{method} asked to stop at step {step}"
        return bool(hooks)

    def _checked(self, loop: _Loop) -> dict[str, np.ndarray]:
        """The loop's outputs; raises ``NonFiniteError`` on a NaN/Inf (unless skipping them)."""
        outputs = loop.host()
        metrics_lib.check_training(outputs, loop.step_before)  # labels outside a metric's classes
        finite = outputs.get("finite_grads")
        bad = ~np.isfinite(outputs["loss"])
        if finite is not None:
            bad |= ~finite.all(axis=1)
        if self.skip_nonfinite:
            return {**outputs, "skipped_update_fraction": bad.astype(np.float64)}
        if bad.any():
            i = int(np.argmax(bad))
            names = (
                [n for n, ok in zip(self.param_names, finite[i], strict=True) if not ok] if finite is not None else []
            )
            last = self.saves.latest_step()
            raise NonFiniteError(
                f"Non-finite values at step {loop.step_before + i + 1} (in the loop of steps "
                f"{loop.step_before + 1}-{loop.step_after}): loss {outputs['loss'][i]}; non-finite gradients "
                f"of {names or 'no parameter'}. "
                + metrics_lib.nonfinite_note(outputs, i)
                + (f"The last checkpoint (step {last}) is kept. " if last is not None else "")
                + "Fix: lower the learning rate, check the input for NaN/Inf, or RunConfig(skip_nonfinite=True) "
                "to skip such updates on the device and count them."
            )
        return outputs

    def _save(self, state, loop: _Loop) -> None:
        if self.saves.saved_step == loop.step_after:  # saved on an error already
            return
        self._checked(loop)  # never save a state that came out of a NaN
        elapsed = self.saves.save(loop.step_after, state, loop.input_state, self.runner.loop)
        self.seconds["checkpoint"] += elapsed
        self.laps.pause(elapsed)

    def _evaluate(
        self, evaluation: Evaluation, state, loop: _Loop, preemption: PreemptionWatch, final: bool = False
    ) -> bool:
        if loop is None or (final and self.last_eval_step == loop.step_after):
            return False
        self._checked(loop)
        results, records = {}, []
        for name in evaluation.sets:  # each set exactly, one after the other; hooks see them all after
            timer = time.perf_counter()
            metrics = evaluation.run(name, state, lambda: preemption.signal_name is not None)
            elapsed = time.perf_counter() - timer
            self.seconds["evaluation"] += elapsed
            self.laps.pause(elapsed)
            if metrics is None:  # interrupted by a signal: the loop saves and exits
                return True
            results[name] = metrics
            split = eval_sets.split_of(name)
            records.append(
                EvalRecord(
                    loop.step_after,
                    split,
                    metrics,
                    elapsed,
                    model=self._model(state, loop.step_after),
                    summaries=self._summaries.at(loop.step_after, split),
                )
            )
        self.last_results, self.last_eval_step = results, loop.step_after
        # Every hook sees every set's record (a list, not a short-circuit); one that asks to stop is named once.
        stopping = [hook for hook in self.hooks if any([hook.after_eval(record) for record in records])]
        stop = self._asked_to_stop(stopping, "after_eval", loop.step_after)
        self.saves.save_best(loop.step_after, state, loop.input_state, results.get(evaluation.best_set))
        return stop and not final

    def _end(self, step: int, wall: float) -> None:
        seconds = dict(self.seconds)
        seconds["device"] = max(wall - sum(seconds.values()), 0.0)
        seconds["total"] = wall
        summary = Summary(step, seconds, eval_sets.flat(self.last_results) if self.last_results else {})
        logger.info(
            "Done at step %d in %.1f s: %s%s",
            step,
            wall,
            ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items() if k != "total"),
            self._unsaved_note,
        )
        for hook in self.hooks:
            hook.end(summary)
