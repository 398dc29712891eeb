"""Whether the holder of a lease may write now: the window of its last renewal, and its own pauses.

Owns the bookkeeping behind ``LeaseLock.check()`` (``lease.py``): a renewal
that began at ``t`` and succeeded lets this process write until ``t + 3L/4``
(``L``: the lease time), ``L/4`` before anyone else may take the lease over. A
holder that names its run may be taken over before its lease expires, so it
also watches for pauses of its own (a thread that looks at the clock every
``_TICK_SECONDS``; a gap of ``PAUSE_SECONDS`` is a pause: SIGSTOP, a frozen VM,
a starved process): after one it writes nothing until a renewal that began
after the pause succeeds. Does not own renewing the lease nor the store
(``lease.py``); every reader and writer of a ``Proof`` holds the lease's
condition (``changed``).
"""

from __future__ import annotations

import threading
import time

PAUSE_SECONDS = 1.0
"""A holder that names its run renews before writing again after a pause this long (SIGSTOP, a frozen VM,
a starved process): meanwhile a later attempt of its run may have taken the lease over."""
_TICK_SECONDS = 0.1  # how often the pause watcher looks at the clock


class Proof:
    """What the last renewal proved (monotonic times): this process may write until ``until``."""

    def __init__(self, writable_seconds: float, watches_pauses: bool, started: float):
        """``started``: the start of the renewal (or the take) that succeeded; ``watches_pauses``: whether a
        later attempt of the holder's run may take the lease over before it expires."""
        self.writable_seconds, self.watches_pauses = writable_seconds, watches_pauses
        self.started, self.until = started, started + writable_seconds
        self.ticked = time.monotonic()  # the pause watcher's last look at the clock
        self.paused_at = float("-inf")  # when the watcher last noticed a pause

    def renewed(self, started: float) -> None:
        """A renewal that began at ``started`` succeeded."""
        self.started, self.until = started, started + self.writable_seconds

    def holds(self, now: float) -> bool:
        """Whether this process may write at ``now``."""
        if now >= self.until:
            return False
        if not self.watches_pauses:
            return True
        # A stale tick: the watcher has not run since a pause (it is about to notice it).
        return now - self.ticked <= PAUSE_SECONDS and self.started > self.paused_at

    def watch(self, stop: threading.Event, changed: threading.Condition, wake: threading.Event) -> None:
        """Notices that this process was paused (a gap between two looks at the clock) and asks for a
        renewal (``wake``): until one that began after the pause succeeds, ``holds`` is false. Runs on
        a thread of its own until ``stop``."""
        last = time.monotonic()
        while not stop.wait(_TICK_SECONDS):
            now = time.monotonic()
            with changed:
                if now - last > PAUSE_SECONDS:
                    self.paused_at = now
                    wake.set()
                self.ticked = now
            last = now
