"""One writer per model_dir on a disk: the lock file ``<model_dir>/estimax.lock``.

Owns taking, checking and releasing the lock file that a process holds while it
writes into a local model_dir (checkpoints, ``metrics.jsonl``, TensorBoard
files, profiles). The file is created atomically (``O_CREAT | O_EXCL``) and
holds its holder's record (``holder.py``: host, process id, the process's start
time and its command line). A lock whose holder ran on this host and is gone
(no such process, or the process id now belongs to a process started later) is
stale: it is taken over with a warning. On an object store the lock is a lease
object instead (``lease.py``); ``locks.lock_for`` chooses.

A training process may name the run it belongs to (``ESTIMAX_RUN_ID``, the
same across the run's restarts; ``estimax.ray.initialize()`` sets it to Ray
Train's run): its record then carries the run and when its process started,
and a later attempt of the same run takes the lock over at once, on a disk or
a bucket, without waiting for the earlier attempt to be found gone. The
earlier attempt, if it still runs, finds the lock taken before it writes
again (``check()``) and stops; an earlier attempt never takes a later one's
lock.

Readers (evaluating, predicting or exporting another run's checkpoints) take
no lock. Does not own who takes it (``RunDir.writing`` in ``run_dir.py``:
process 0 for the group, around each training call), which lock a model_dir
gets (``locks.lock_for``), the holder record (``holder.py``), nor what is
written under it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import time
from collections.abc import Callable

from estimax import storage
from estimax.errors import ModelDirLockedError, ModelDirNotWritableError
from estimax.run.holder import (
    LOCK_FILE,
    RUN_ID,
    Holder,
    continues,
    describe,
    is_stale,
    superseded,
    taken_over,
    this_process,
)

logger = logging.getLogger("estimax")


class Lock:
    """The writer lock of one model_dir; ``acquire()`` raises ``ModelDirLocked`` naming the holder."""

    def __init__(self, model_dir: str, committed_step: Callable[..., int | None] | None = None):
        """``committed_step(read=False)``: the last step saved for good, which a lost lock says to resume from."""
        self.model_dir = storage.resolve(model_dir)
        self.path = os.path.join(self.model_dir, LOCK_FILE)
        self.held = False
        self.committed_step = committed_step or (lambda read=False: None)
        self.left: tuple[int, ...] = ()  # on a disk every attempt writes a step under names of its own
        self._record = Holder()

    def acquire(self, training: bool = False) -> Lock:
        """Takes the lock; ``training``: this process names its run (``ESTIMAX_RUN_ID``), so that it takes
        over an earlier attempt's lock and a later attempt takes over its own (readers never do)."""
        if self.held:
            return self
        try:
            os.makedirs(self.model_dir, exist_ok=True)
        except OSError as error:
            raise not_writable(self.model_dir, error) from None
        if os.path.isdir(self.path):
            raise ModelDirLockedError(
                f"model_dir {self.model_dir} has a directory {self.path} where estimax keeps its lock file; "
                "expected a file or nothing. Fix: move that directory out of the model_dir (it is not "
                "estimax's), or use another model_dir."
            )
        record = this_process(training)
        for _attempt in range(3):
            if self._create(record):
                return self._hold(record)
            holder = read_holder(self.path)
            if holder is None:  # released (or half-written) in between: try again
                _check_not_garbage(self.path, self.model_dir)
                time.sleep(0.05)
                continue
            if continues(holder, record):
                raise superseded(self.model_dir, holder)
            earlier = continues(record, holder)
            if not earlier and not is_stale(holder):
                raise ModelDirLockedError(
                    f"model_dir {self.model_dir} is being written by another process: {describe(holder)}. "
                    "Expected one writer per model_dir. Fix: wait for it to finish, stop it, or use another "
                    f"model_dir; if that process is gone (another host), delete {self.path}."
                )
            if self._take_over(holder):
                if earlier:
                    why = f"lock of model_dir {self.model_dir}: it is held by an earlier attempt of this run"
                    why += f" ({RUN_ID}={holder.run})"
                else:
                    why = f"stale lock of model_dir {self.model_dir}: its holder is gone"
                logger.warning("Took over the %s (%s).", why, describe(holder))
        if self._create(record):
            return self._hold(record)
        raise ModelDirLockedError(f"model_dir {self.model_dir}: could not take the lock {self.path}; try again.")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = read_holder(self.path)
        if holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname():
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def _hold(self, record: Holder) -> Lock:
        self.held, self._record = True, record
        return self

    def check(self) -> None:
        """Raises ``LeaseLostError`` once a later attempt of this process's run took the lock over: only
        such a holder reads the lock file (a small read at each loop boundary and record); any other lock
        file stays this process's until it is released."""
        if not self.held or self._record.run is None:
            return
        holder = read_holder(self.path)
        deadline = time.monotonic() + _WRITING_SECONDS
        while holder is None and time.monotonic() < deadline:  # a taker moved it aside: its record follows
            time.sleep(0.05)
            holder = read_holder(self.path)
        if holder != self._record:
            raise taken_over(self.model_dir, self.path, holder, self._record, self.committed_step())

    def prove(self, saving: int | None = None) -> None:
        """``check()``: on a disk it reads the lock file each time (``saving`` is not needed here: every
        attempt writes a step under a temporary name of its own, see ``fenced_commit.py``)."""
        self.check()

    def writable(self) -> bool:
        """Whether this process may write under the lock now (``check()`` without the error)."""
        try:
            self.check()
        except ModelDirLockedError:
            return False
        return True

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _create(self, record: Holder) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as error:
            raise not_writable(self.model_dir, error) from None
        try:
            with os.fdopen(fd, "w") as f:
                f.write(record.to_json())
                f.flush()
                os.fsync(f.fileno())
        except OSError as error:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            raise not_writable(self.model_dir, error) from None
        return True

    def _take_over(self, stale: Holder) -> bool:
        """Moves the stale lock aside; ``False`` if another process took it over first."""
        aside = f"{self.path}.stale-{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        if read_holder(aside) != stale:  # another process replaced it in between: put it back
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
            os.remove(aside)
            return False
        os.remove(aside)
        return True


def read_holder(path: str) -> Holder | None:
    """The record of the lock file at ``path``; ``None`` when there is none, or none readable (yet)."""
    try:
        return Holder.from_json(storage.read_bytes(path))
    except FileNotFoundError:
        return None


# A lock is written within milliseconds of its creation: unreadable for longer, it is not one.
_WRITING_SECONDS = 2.0


def _check_not_garbage(path: str, model_dir: str) -> None:
    """Raises when the file at ``path`` has been unreadable as a lock for longer than a write takes."""
    try:
        age, content = time.time() - os.path.getmtime(path), storage.read_bytes(path)
    except FileNotFoundError:
        return  # released in between
    if age < _WRITING_SECONDS:
        return
    what = (
        "is empty"
        if not content.strip()
        else f"holds {len(content)} bytes that are not a lock record: {content[:40]!r}"
    )
    raise ModelDirLockedError(
        f"model_dir {model_dir} has a lock file {path} that {what}; expected the JSON record (host, pid, "
        "command) an estimax writer leaves there. It is no estimax lock (a copy, an editor or a full disk left "
        f"it). Fix: if no estimax process writes into this model_dir, delete {path}."
    )


def not_writable(directory: str, error: OSError) -> ModelDirNotWritableError:
    reason = os.strerror(error.errno) if error.errno else str(error)
    fix = (
        "free space on that file system"
        if error.errno in (errno.ENOSPC, errno.EDQUOT)
        else "use a directory this process can write, or fix its permissions"
    )
    return ModelDirNotWritableError(
        f"model_dir {directory} is not writable ({reason}); expected a directory where checkpoints and "
        f"metrics can be written. Fix: {fix}. Reading its checkpoints (evaluate, predict, "
        "checkpoint=...) needs no write access."
    )
