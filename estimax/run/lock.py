"""One writer per model_dir: the lock ``<model_dir>/estimax.lock``, a file or a lease object.

Owns taking, describing and releasing the lock that a process holds while it
writes into a model_dir (checkpoints, ``metrics.jsonl``, TensorBoard files,
profiles). The lock is created atomically and names its holder: host,
process id, the process's start time and its command line.

- On a disk (``Lock``): ``O_CREAT | O_EXCL``. A lock whose holder ran on this
  host and is gone (no such process, or the process id now belongs to a
  process started later) is stale: it is taken over with a warning.
- On an object store (``lease.LeaseLock``): a lease object, taken and renewed
  by conditional writes; a pid on another host cannot be checked, so a lease
  not renewed for its lease time means the holder is gone.

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
gets (``lease.lock_for``), nor what is written under it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable

from estimax import storage
from estimax.errors import LeaseLostError, ModelDirLockedError, ModelDirNotWritableError, SupersededError

logger = logging.getLogger("estimax")

LOCK_FILE = "estimax.lock"

RUN_ID = "ESTIMAX_RUN_ID"
"""The environment variable naming the run a training process belongs to, the same across the run's
restarts (a job scheduler's job id): a later attempt of the run takes the model_dir's lock over at once."""


from estimax.errors import ModelDirLocked, ModelDirNotWritable  # noqa: E402,F401  (earlier names)


class Lock:
    """The writer lock of one model_dir; ``acquire()`` raises ``ModelDirLocked`` naming the holder."""

    def __init__(self, model_dir: str, committed_step: Callable[..., int | None] | None = None):
        """``committed_step(read=False)``: the last step saved for good, which a lost lock says to resume from."""
        self.model_dir = storage.resolve(model_dir)
        self.path = os.path.join(self.model_dir, LOCK_FILE)
        self.held = False
        self.committed_step = committed_step or (lambda read=False: None)
        self.left: tuple[int, ...] = ()  # on a disk every attempt writes a step under names of its own
        self._record: dict = {}

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
        record = holder_record(training)
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
                    why += f" ({RUN_ID}={holder['run']})"
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
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def _hold(self, record: dict) -> Lock:
        self.held, self._record = True, record
        return self

    def check(self) -> None:
        """Raises ``LeaseLostError`` once a later attempt of this process's run took the lock over: only
        such a holder reads the lock file (a small read at each loop boundary and record); any other lock
        file stays this process's until it is released."""
        if not self.held or "run" not in self._record:
            return
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

    def _create(self, record: dict) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as error:
            raise not_writable(self.model_dir, error) from None
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as error:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            raise not_writable(self.model_dir, error) from None
        return True

    def _take_over(self, stale: dict) -> bool:
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


def holder_record(training: bool = False) -> dict:
    """Who this process is, as written into the lock file; in ``training`` with ``ESTIMAX_RUN_ID`` set,
    also its run and when its process started (seconds since the epoch): the attempts of a run are ordered
    by it, every attempt being new processes."""
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": process_start(os.getpid()),
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime()),
        "command": shlex.join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]),
    }
    run = os.environ.get(RUN_ID, "").strip()
    if training and run:
        import psutil

        record.update(run=run, attempt_started=psutil.Process().create_time())
    return record


def continues(record: dict, holder: dict) -> bool:
    """Whether ``record`` is a later attempt of the run ``holder`` belongs to: the same run, a process
    started later. It takes the lock over at once; the earlier attempt is over (Ray Train or a job
    scheduler started the later one) or stops when it finds the lock taken."""
    run, started = record.get("run"), record.get("attempt_started")
    before = holder.get("attempt_started")
    numbers = all(isinstance(t, int | float) and not isinstance(t, bool) for t in (started, before))
    return bool(run) and holder.get("run") == run and numbers and before < started


def superseded(model_dir: str, holder: dict) -> SupersededError:
    """The error of a process of an earlier attempt that finds a later attempt of its run holding the lock."""
    return SupersededError(
        f"model_dir {model_dir} is being written by a later attempt of this process's run "
        f"({RUN_ID}={holder['run']}): {describe(holder)}; this process started before it. Expected one writer "
        "per model_dir: the latest attempt of a run. Fix: none needed: the later attempt carries the run on."
    )


def taken_over(model_dir: str, path: str, taker: dict | None, record: dict, step: int | None) -> LeaseLostError:
    """The error of a holder whose lock a later attempt of its run took over (or that was deleted)."""
    if taker is None or not continues(taker, record):
        who = describe(taker) if taker else "nobody holds it now (it was deleted)"
        return LeaseLostError(
            f"model_dir {model_dir}: another process took over the lock {path} while this one held it: {who}. "
            f"This process stopped writing; {resume(step)}. Expected one writer per model_dir. Fix: let the "
            "other process finish, or stop it and run the same command again."
        )
    return LeaseLostError(
        f"model_dir {model_dir}: a later attempt of this process's run ({RUN_ID}={record['run']}) took over the "
        f"lock {path}: {describe(taker)}. This process stopped writing; the later attempt carries the run on "
        f"from its last committed checkpoint ({'none' if step is None else f'step {step}'}). Fix: none needed."
    )


def resume(step: int | None) -> str:
    """Where a run that stopped writing resumes: the step of its last committed checkpoint."""
    return "no checkpoint was saved: training starts over" if step is None else f"resume from step {step}"


def read_holder(path: str) -> dict | None:
    try:
        holder = json.loads(storage.read_bytes(path))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


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


def describe(holder: dict) -> str:
    run = f", run {holder['run']}" if holder.get("run") else ""
    return (
        f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started_at')}{run}, "
        f"command `{holder.get('command')}`"
    )


def is_stale(holder: dict) -> bool:
    """Whether the holder ran on this host and is gone: its process id is free, or now names a
    process that started at another time (the id was reused)."""
    if holder.get("host") != socket.gethostname():
        return False  # another machine's process cannot be checked from here
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    started = process_start(pid)
    return started is not None and holder.get("process_start") is not None and started != holder["process_start"]


def process_start(pid: int) -> int | None:
    """The start time of a process in clock ticks since boot (Linux ``/proc``), or ``None``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


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
