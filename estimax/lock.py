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

from estimax import storage
from estimax.errors import ModelDirLockedError, ModelDirNotWritableError

logger = logging.getLogger("estimax")

LOCK_FILE = "estimax.lock"


from estimax.errors import ModelDirLocked, ModelDirNotWritable  # noqa: E402,F401  (earlier names)


class Lock:
    """The writer lock of one model_dir; ``acquire()`` raises ``ModelDirLocked`` naming the holder."""

    def __init__(self, model_dir: str):
        self.model_dir = storage.resolve(model_dir)
        self.path = os.path.join(self.model_dir, LOCK_FILE)
        self.held = False

    def acquire(self) -> Lock:
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
        record = holder_record()
        for _attempt in range(3):
            if self._create(record):
                self.held = True
                return self
            holder = read_holder(self.path)
            if holder is None:  # released (or half-written) in between: try again
                _check_not_garbage(self.path, self.model_dir)
                time.sleep(0.05)
                continue
            if not is_stale(holder):
                raise ModelDirLockedError(
                    f"model_dir {self.model_dir} is being written by another process: {describe(holder)}. "
                    "Expected one writer per model_dir. Fix: wait for it to finish, stop it, or use another "
                    f"model_dir; if that process is gone (another host), delete {self.path}."
                )
            if self._take_over(holder):
                logger.warning(
                    "Took over the stale lock of model_dir %s: its holder is gone (%s).",
                    self.model_dir,
                    describe(holder),
                )
        if self._create(record):
            self.held = True
            return self
        raise ModelDirLockedError(f"model_dir {self.model_dir}: could not take the lock {self.path}; try again.")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = read_holder(self.path)
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)

    def check(self) -> None:
        """Nothing to prove: a lock file on a disk stays this process's until it is released."""

    def writable(self) -> bool:
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


def holder_record() -> dict:
    """Who this process is, as written into the lock file."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "process_start": process_start(os.getpid()),
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime()),
        "command": shlex.join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]),
    }


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
    return (
        f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started_at')}, "
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
