"""Preemption: a SIGTERM or SIGINT during training becomes a save and a clean exit.

Owns noticing the signal and deciding, at a loop boundary, that training must
stop. The training loop then saves, waits for the save, and raises
``Preempted``: a ``SystemExit`` with code ``PREEMPTED_EXIT_CODE`` (75,
``EX_TEMPFAIL``: "temporary failure, run me again"), which schedulers and
``estimax launch`` treat as "requeue from the latest checkpoint".

With one process, estimax installs its own handlers for the duration of
``train``. With several, JAX's preemption sync service (started by
``jax.distributed.initialize``) notices SIGTERM, and every process stops at
the same step.
"""

from __future__ import annotations

import logging
import signal
import threading

import jax

logger = logging.getLogger("estimax")

PREEMPTED_EXIT_CODE = 75


class Preempted(SystemExit):
    """Training stopped on a signal after saving a checkpoint at ``step``."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.signal_name = step, signal_name

    def __str__(self) -> str:
        return (
            f"{self.signal_name}: training stopped at step {self.step} after saving a checkpoint; "
            f"exit code {PREEMPTED_EXIT_CODE} (run the same command again to resume)."
        )


class PreemptionWatch:
    """While active, remembers a SIGTERM/SIGINT instead of dying on it.

    A second SIGINT (Ctrl-C twice) raises ``KeyboardInterrupt`` at once.
    """

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> PreemptionWatch:
        # Handlers can only be set from the main thread; JAX handles SIGTERM itself across processes.
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self._SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        logger.warning("%s received: finishing the current loop, then saving and exiting.", self.signal_name)

    def requested(self, step: int, since: int | None = None) -> bool:
        """Whether training must stop after ``step`` (the same answer on every process).

        ``since``: the step before the loop that just ran (default ``step - 1``).
        """
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            # JAX's sync point is the largest step any process had reported when the notice
            # came, plus one; Orbax reports steps too (at every save). A loop advances by
            # steps_per_loop, so every step of it is reported, or the sync point is skipped.
            first = step if since is None else since + 1
            if any([multihost_utils.reached_preemption_sync_point(s) for s in range(first, step + 1)]):
                self.signal_name = self.signal_name or "SIGTERM"
                return True
            return False
        return self.signal_name is not None
