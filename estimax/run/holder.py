"""Who holds a model_dir's lock: the record in ``<model_dir>/estimax.lock``, and its process.

Owns the holder record (``Holder``: host, process id, the process's start time,
its command line, and for a training process that names its run the run and
when its attempt started; on a bucket also the lease time, the last renewal and
the steps a writer is saving or was left), its one writer (``to_json``) and
one reader (``from_json``; ``lease_holder`` also checks a lease's fields), and
what both kinds of lock ask of a holder: whether it is gone (``is_stale``),
whether one record is a later attempt of another's run (``continues``), which
steps a holder taken over may still be writing (``left_steps``), and the lines
that name it. Does not own taking
or keeping a lock (``lock.py`` on a disk, ``lease.py`` on a bucket, ``locks.py``
chooses).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import socket
import sys
import time

from estimax import storage
from estimax.errors import LeaseLostError, ModelDirLockedError, SupersededError

LOCK_FILE = "estimax.lock"

RUN_ID = "ESTIMAX_RUN_ID"
"""The environment variable naming the run a training process belongs to, the same across the run's
restarts (a job scheduler's job id): a later attempt of the run takes the model_dir's lock over at once."""


@dataclasses.dataclass(frozen=True)
class Holder:
    """The record a lock holds; a field a record read from the lock lacks is ``None``.

    ``run`` and ``attempt_started`` (seconds since the epoch) only for a training process that names its
    run; ``lease_seconds``, ``renewed_at`` (seconds since the epoch), ``left`` and ``saving`` only on a
    bucket: the steps an earlier holder may still be writing, and the step this one is about to save.
    """

    host: str | None = None
    pid: int | None = None
    process_start: int | None = None  # clock ticks since boot (``process_start``)
    started_at: str | None = None
    command: str | None = None
    run: str | None = None
    attempt_started: float | None = None
    lease_seconds: float | None = None
    left: tuple[int, ...] | None = None
    saving: int | None = None
    renewed_at: float | None = None

    def to_json(self) -> str:
        """The record as written into the lock (the same keys, in the same order, as every release wrote)."""
        record = {"host": self.host, "pid": self.pid, "process_start": self.process_start,
                  "started_at": self.started_at, "command": self.command}  # fmt: skip
        if self.run is not None:
            record.update(run=self.run, attempt_started=self.attempt_started)
        optional = {"lease_seconds": self.lease_seconds, "left": None if self.left is None else list(self.left),
                    "saving": self.saving, "renewed_at": self.renewed_at}  # fmt: skip
        record.update((key, value) for key, value in optional.items() if value is not None)
        return json.dumps(record)

    @classmethod
    def from_json(cls, content: bytes | str) -> Holder | None:
        """The record in ``content``; ``None`` when it is not a JSON object (half-written, or no lock's).
        Values are kept as they were read: the checks that use them say what they expect."""
        try:
            record = json.loads(content)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(record, dict):
            return None
        found = {field.name: record.get(field.name) for field in dataclasses.fields(cls)}
        if isinstance(found["left"], list):
            found["left"] = tuple(found["left"])
        return cls(**found)

    def same_process(self, other: Holder) -> bool:
        """Whether both records are of one process (of one attempt of its run), whatever their renewals."""
        identity = ("host", "pid", "process_start", "run", "attempt_started")
        return all(getattr(self, name) == getattr(other, name) for name in identity)


def this_process(training: bool = False) -> Holder:
    """Who this process is, as written into the lock file; in ``training`` with ``ESTIMAX_RUN_ID`` set,
    also its run and when its process started (seconds since the epoch): the attempts of a run are ordered
    by it, every attempt being new processes."""
    holder = Holder(
        host=socket.gethostname(),
        pid=os.getpid(),
        process_start=process_start(os.getpid()),
        started_at=time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime()),
        command=shlex.join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]),
    )
    run = os.environ.get(RUN_ID, "").strip()
    if training and run:
        import psutil

        holder = dataclasses.replace(holder, run=run, attempt_started=psutil.Process().create_time())
    return holder


def continues(record: Holder, holder: Holder) -> bool:
    """Whether ``record`` is a later attempt of the run ``holder`` belongs to: the same run, a process
    started later. It takes the lock over at once; the earlier attempt is over (Ray Train or a job
    scheduler started the later one) or stops when it finds the lock taken."""
    run, started, before = record.run, record.attempt_started, holder.attempt_started
    numbers = all(isinstance(t, int | float) and not isinstance(t, bool) for t in (started, before))
    return bool(run) and holder.run == run and numbers and before < started


def describe(holder: Holder) -> str:
    run = f", run {holder.run}" if holder.run else ""
    return f"host {holder.host}, pid {holder.pid}, started {holder.started_at}{run}, command `{holder.command}`"


def is_stale(holder: Holder) -> bool:
    """Whether the holder ran on this host and is gone (``process_gone``)."""
    return process_gone(holder.host, holder.pid, holder.process_start)


def process_gone(host, pid, started) -> bool:
    """Whether the process ``pid`` that started at ``started`` (``process_start``) on ``host`` ran on this
    host and is gone: its process id is free, or now names a process that started at another time (the id
    was reused). Another host's process cannot be checked from here: never gone."""
    if host != socket.gethostname():
        return False
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    now = process_start(pid)
    return now is not None and started is not None and now != started


def process_start(pid: int) -> int | None:
    """The start time of a process in clock ticks since boot (Linux ``/proc``), or ``None``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def superseded(model_dir: str, holder: Holder) -> SupersededError:
    """The error of a process of an earlier attempt that finds a later attempt of its run holding the lock."""
    return SupersededError(
        f"model_dir {model_dir} is being written by a later attempt of this process's run "
        f"({RUN_ID}={holder.run}): {describe(holder)}; this process started before it. Expected one writer "
        "per model_dir: the latest attempt of a run. Fix: none needed: the later attempt carries the run on."
    )


def taken_over(
    model_dir: str, path: str, taker: Holder | str | None, record: Holder, step: int | None
) -> LeaseLostError:
    """The error of a holder whose lock another process (``taker``: its record, or what is known of it) or a later
    attempt of its run took over, or that was deleted (``taker`` is ``None``)."""
    if not isinstance(taker, Holder) or not continues(taker, record):
        who = describe(taker) if isinstance(taker, Holder) else taker or "nobody holds it now (it was deleted)"
        lease = record.lease_seconds
        why = "" if lease is None else f" (this one was paused or cut off for longer than the {lease:g} s lease)"
        return LeaseLostError(
            f"model_dir {model_dir}: another process took over the lock {path} while this one held it{why}: {who}. "
            f"This process stopped writing{' before its lease could expire' if why else ''}; {resume(step)}. "
            "Expected one writer per model_dir. Fix: let the other process finish, or stop it and run the same "
            "command again."
        )
    return LeaseLostError(
        f"model_dir {model_dir}: a later attempt of this process's run ({RUN_ID}={record.run}) took over the "
        f"lock {path}: {describe(taker)}. This process stopped writing; the later attempt carries the run on "
        f"from its last committed checkpoint ({'none' if step is None else f'step {step}'}). Fix: none needed."
    )


def resume(step: int | None) -> str:
    """Where a run that stopped writing resumes: the step of its last committed checkpoint."""
    return "no checkpoint was saved: training starts over" if step is None else f"resume from step {step}"


def lease_holder(content: bytes, path: str) -> Holder:
    """The lease record in ``content``; a ``ModelDirLockedError`` saying what the object holds otherwise."""
    holder = Holder.from_json(content)
    if holder is not None:
        renewed, lease = holder.renewed_at, holder.lease_seconds
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in (renewed, lease)) and lease > 0:
            return holder
    what = (
        "is empty"
        if not content.strip()
        else f"holds {len(content)} bytes that are not a lease record: {content[:60]!r}"
        + ("..." if len(content) > 60 else "")
    )
    raise ModelDirLockedError(
        f"The lock {path} {what}; expected the JSON record (host, pid, renewed_at, lease_seconds) an estimax "
        "writer leaves there. It is no estimax lease (a copy or another tool left it). Fix: if no estimax "
        f"process writes into {storage.parent(path)}, delete it: {delete_command(path)}."
    )


def left_steps(holder: Holder, still_writing: bool = True, most: int = 16) -> tuple[int, ...]:
    """The steps a holder whose lease is taken over may still be writing, which its successor never
    writes: the one it was saving (unless it is gone: ``still_writing``) and those it was left itself
    (the newest ``most``)."""
    steps = {s for s in [holder.saving if still_writing else None, *(holder.left or ())] if isinstance(s, int)}
    return tuple(sorted(steps)[-most:])


def delete_command(path: str) -> str:
    return f"`gcloud storage rm {path}`" if storage.scheme(path) == "gs" else f"`aws s3 rm {path}`"
