"""The saves of one training call: when a checkpoint is due, the save itself, the best one, what is committed.

Owns the protocol of a save, in this order: whether it is due (the same answer on every
process: process 0's where the clock decides), the records up to its step made durable
(a checkpoint never gets ahead of the run's history), a barrier of the group, the fence
of the model_dir's lock, the input position, and the checkpoint with its meta; then the
best checkpoint of an evaluation, and what training asks about committed steps. Does
not own how a checkpoint is written, committed or pruned (``checkpoint.py``), when the
clock says a save is due (``save_schedule.py``), nor the guarantee that a mistake found
at a loop boundary still saves the checkpoint due there (``host_loop.py``).
"""

from __future__ import annotations

import logging
import time

from estimax.errors import ConfigError, LeaseLostError, StoreUnavailableError, one_line
from estimax.run.lock import resume

logger = logging.getLogger("estimax")


class Saves:
    """What a training call saves into its run directory (nothing with ``NoRunDir``).

    Args:
      run_dir: the ``RunDir`` (or ``NoRunDir``), held for writing by the caller.
      sync: the group's ``Sync`` (free with one process).
      records: the call's ``MetricLogger``: its records up to a step are made durable
        before that step's checkpoint starts.
      plan: the ``InputPlan``: what a checkpoint keeps of an input position.
      best: ``(checkpointer, metric)`` of ``train_and_evaluate``'s best checkpoint, or ``None``.
    """

    def __init__(self, run_dir, sync, records, plan, best: tuple | None = None):
        self.checkpoints = run_dir.checkpoints
        self._run_dir, self._sync, self._records, self._plan = run_dir, sync, records, plan
        self._best, self.best_metric = best or (None, None)
        self.saved_step: int | None = None  # of the last save this call started

    @property
    def enabled(self) -> bool:
        """Whether anything is saved (a model_dir)."""
        return self.checkpoints.saves

    @property
    def at_end(self) -> bool:
        """Whether a call saves its last step (``CheckpointPolicy(at_end=...)``)."""
        return self.enabled and self.checkpoints.policy.at_end

    @property
    def directory(self) -> str | None:
        return self.checkpoints.directory

    def begin(self) -> None:
        """A process of the group that is lost is named with the step to resume from: the last committed."""
        self._sync.track_checkpoints(self.checkpoints.committed_step)

    def fence(self) -> None:
        """Raises once this process cannot prove it still holds the model_dir's lock."""
        self._run_dir.fence()

    def due(self, step_before: int, step_after: int) -> bool:
        """Whether a save is due after this loop: the same answer on every process (process 0's,
        where it depends on the clock: ``every_seconds``, ``max_overhead``), or their barriers would part."""
        due = self.checkpoints.due(step_before, step_after)
        if self.checkpoints.clock_decides(step_before, step_after):
            due = self._sync.share(f"whether the checkpoint of step {step_after} is due", "due" if due else "") == "due"
        return due

    def save(self, step: int, state, input_state, loop: str) -> float:
        """Saves ``state`` at ``step`` once its records are durable; returns the seconds the host spent.
        ``loop``: the device loop mode the state was trained with (a resumed ``auto`` run keeps it)."""
        timer = time.perf_counter()
        try:
            self._records.flush()  # a checkpoint never gets ahead of the records
        except (LeaseLostError, StoreUnavailableError):
            raise  # nothing more may be written
        except Exception as error:  # a metric's compute, a writer: the state trained is saved all the same
            logger.warning("The records up to step %d could not be written (%s); the checkpoint is saved all "
                           "the same.", step, one_line(error))  # fmt: skip
        self._sync.barrier(f"the checkpoint of step {step}")
        self.checkpoints.save(step, state, self._plan.saved_position(input_state), loop=loop)
        self.saved_step = step
        return time.perf_counter() - timer

    def save_best(self, step: int, state, input_state, metrics: dict) -> None:
        """Offers the state evaluated at ``step`` to the best checkpoint (kept if its metric is among the best)."""
        if self._best is None:
            return
        if self.best_metric not in metrics:
            raise ConfigError(
                f"Best(metric={self.best_metric!r}) is not among the evaluation's metrics {sorted(metrics)}; "
                "expected one of them. Fix: pass one of those names."
            )
        self._best.save(step, state, self._plan.saved_position(input_state), metrics=metrics)

    def resume_note(self) -> str:
        """Where a run that stops here resumes: ``resume from step N``, N its last committed checkpoint."""
        return resume(self.checkpoints.committed_step())

    def latest_step(self) -> int | None:
        return self.checkpoints.latest_step()

    def wait(self) -> None:
        """Waits for the saves in flight: checkpoints already written stay valid (also on an error)."""
        self.checkpoints.wait()

    def finish(self) -> None:
        """The end of a call that trained to its end: the saves in flight committed, then the old
        checkpoints past ``keep`` deleted (on every process at once)."""
        self.checkpoints.wait(prune=True)
