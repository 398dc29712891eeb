"""Which writer lock a model_dir gets: a lock file on a disk, a lease on an object store.

Owns the one choice between the two kinds (``lock.Lock``, ``lease.LeaseLock``),
which share their interface: ``acquire(training)``, ``release()``, ``check()``,
``prove(saving)``, ``writable()``, ``held`` and ``left``. Does not own either
kind nor who takes the lock (``run_dir.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from estimax import storage
from estimax.run.lease import LeaseLock
from estimax.run.lock import Lock


def lock_for(model_dir: str, committed_step: Callable[..., int | None] | None = None) -> Lock | LeaseLock:
    """The lock that fits where ``model_dir`` is: a file on disk, a lease on an object store;
    ``committed_step(read=False)``: what a lost lock says to resume from."""
    if storage.is_url(model_dir):
        return LeaseLock(model_dir, committed_step=committed_step)
    return Lock(model_dir, committed_step)
