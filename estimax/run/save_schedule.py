"""When training saves a checkpoint: a multiple of ``every_steps`` crossed, or ``every_seconds`` passed.

With ``CheckpointPolicy(max_overhead=f)`` (``RunConfig``'s default policy has 0.02) a save due by
steps is put off while saving would take more than that fraction of the time: a save that took
``c`` seconds, from its start until Orbax committed it, is followed by the next one due by steps
no sooner than ``c / f`` seconds after it started. A model that runs a thousand steps in a fraction
of a second would otherwise spend a quarter of its time saving; a slow one is not affected.
Saves at the end of training, on preemption, for the best evaluation and by ``every_seconds``
are never put off. The answer depends on this process's clock: with several processes the
training loop takes process 0's (``depends_on_clock``). Owns the decision only; ``checkpoint.py``
saves.
"""

from __future__ import annotations

import logging
import time

from estimax import counting
from estimax.config import CheckpointPolicy

logger = logging.getLogger("estimax")


class SaveSchedule:
    """Whether a checkpoint is due after a loop, from the policy and what the last save cost."""

    def __init__(self, policy: CheckpointPolicy):
        self.policy = policy
        self._started = time.monotonic()  # of the last save; before any, of this schedule
        self._cost: float | None = None  # seconds from the last finished save's start to its commit
        self._in_flight = False
        self._said = False

    def started(self) -> None:
        self._started, self._in_flight = time.monotonic(), True

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and not yet seen committed."""
        return self._in_flight

    def finished(self) -> None:
        """The save started last is committed (seen now: at a loop boundary, or after a wait)."""
        if self._in_flight:
            self._cost, self._in_flight = time.monotonic() - self._started, False

    def depends_on_clock(self, step_before: int, step_after: int) -> bool:
        """Whether ``due`` reads this process's clock for these steps (processes may then disagree)."""
        by_steps = counting.crossed(self.policy.every_steps, step_before, step_after)
        return self.policy.every_seconds is not None or (by_steps and self.policy.max_overhead is not None)

    def due(self, step_before: int, step_after: int) -> bool:
        policy, since = self.policy, time.monotonic() - self._started
        if policy.every_seconds is not None and since >= policy.every_seconds:
            return True
        if not counting.crossed(policy.every_steps, step_before, step_after):
            return False
        if policy.max_overhead is None or self._cost is None and not self._in_flight:
            return True
        cost = since if self._in_flight else self._cost  # a save still in flight costs at least this much
        if cost <= policy.max_overhead * since:
            return True
        if not self._said:
            self._said = True
            logger.info(
                "Step %d: the checkpoint due every %d steps is put off: the last save took %.2f s, more than "
                "max_overhead=%g of the %.2f s since it started; saves by steps now come at least %.1f s apart. "
                "CheckpointPolicy(max_overhead=None) saves at every multiple.",
                step_after,
                policy.every_steps,
                cost,
                policy.max_overhead,
                since,
                cost / policy.max_overhead,
            )
        return False
