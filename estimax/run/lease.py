"""The writer lock of a model_dir on a bucket: a lease, fenced, every call to the store bounded.

Owns taking, keeping and releasing ``<model_dir>/estimax.lock`` on an object store, and saying whether this
process may still write. The lock is an object holding its holder's record (``holder.Holder``) and the time of its
last renewal. It is taken by a conditional create, or by replacing exactly the version of an expired lease; a
background thread renews it by replacing exactly the version this process wrote last (``conditional.py``), so that
a renewal never overwrites another process's lease. A write the store applied but answered after the call's timeout
is recognised by its bytes (its renewal time is to the microsecond): its version is adopted, not taken for another
process's. The timeline of a lease of ``L`` seconds: a renewal every ``L/4``; each call to the store waits at most
``L/4``; this process may write until ``3L/4`` after the start of its last renewal that succeeded, ``L/4`` before
anyone else may take the lease over. A process paused past that point (SIGSTOP, a long GC, a frozen VM) writes
nothing more until a renewal proves that nobody took the lease meanwhile; if somebody did, ``check()`` raises
``LeaseLostError`` naming it, and if the store does not answer (also to a second try when the renewal under way was
cut off), ``StoreUnavailableError``. When the process is still running ``L/4`` after that verdict (blocked in a
write to a store that does not answer), the lease ends it: one line and exit code 74.

A training process that names its run (``ESTIMAX_RUN_ID``, see ``lock.py``) takes over at once a lease that an
earlier attempt of its run holds, by replacing exactly the version it read: of two later attempts, one wins. As a
lease can then be taken over before it expires, such a holder also watches for pauses of its own
(``lease_proof.py``: a gap of ``PAUSE_SECONDS`` in a thread that ticks): after one, it writes nothing until a
renewal proves the lease still its own. Taking and releasing the lock retry for ``deadline_seconds``, with a warning
per retry (``storage.Deadline``, the rule of every store operation). A lock object that holds no lease record is
reported with what it holds and how to delete it. Does not own the holder record (``holder.py``), the lock on a disk
(``lock.py``), which of the two a model_dir gets (``locks.py``), nor what is written under it (``run_dir.py`` asks
``check()``/``writable()``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from estimax import storage
from estimax.errors import (
    STORE_FAILURE_EXIT_CODE,
    LeaseLostError,
    ModelDirLockedError,
    StorageError,
    StoreUnavailableError,
    one_line,
)
from estimax.run.holder import (
    LOCK_FILE,
    RUN_ID,
    Holder,
    continues,
    delete_command,
    describe,
    is_stale,
    lease_holder,
    left_steps,
    resume,
    superseded,
    taken_over,
    this_process,
)
from estimax.run.lease_proof import Proof
from estimax.storage.conditional import Changed, open_object
from estimax.storage.deadlines import DEADLINE_SECONDS, Deadline, seconds_from_environment, unanswered

logger = logging.getLogger("estimax")

LEASE_SECONDS = "ESTIMAX_LEASE_SECONDS"
"""The environment variable that sets the lease time (default 60 s)."""


class LeaseLock:
    """The writer lock of a model_dir on an object store (see the module docstring).

    ``lease_seconds`` and ``deadline_seconds`` default to ``ESTIMAX_LEASE_SECONDS`` (60) and
    ``ESTIMAX_STORE_DEADLINE_SECONDS`` (120). ``committed_step``: the last step saved for good, which the lines about
    a failure tell the user to resume from (the run directory's checkpoints).
    """

    def __init__(
        self,
        model_dir: str,
        lease_seconds: float | None = None,
        deadline_seconds: float | None = None,
        committed_step: Callable[..., int | None] | None = None,
    ):
        self.model_dir = storage.resolve(model_dir)
        self.path = storage.join(self.model_dir, LOCK_FILE)
        self.lease_seconds = lease_seconds or seconds_from_environment(LEASE_SECONDS, 60.0)
        self.deadline_seconds = deadline_seconds or seconds_from_environment(DEADLINE_SECONDS, 120.0)
        self.committed_step = committed_step or (lambda read=False: None)
        self.held = False
        self.left: tuple[int, ...] = ()  # steps an earlier holder may still be writing: never written here
        self._object = None
        self._record = Holder()
        self._version: str | None = None
        self._unanswered: dict[bytes, float] = {}  # writes the store may have applied unseen: bytes -> their start
        self._proof = Proof(self._writable_seconds, watches_pauses=False, started=0.0)  # what the last renewal proved
        self._lost: StorageError | ModelDirLockedError | None = None
        self._composed = threading.Event()  # cleared while the line of a takeover is being composed
        self._composed.set()
        self._changed = threading.Condition()
        self._stop = threading.Event()  # one per hold: the threads of a hold end with it
        self._wake = threading.Event()  # renew now
        self._keeper: threading.Thread | None = None

    @property
    def _call_seconds(self) -> float:
        return self.lease_seconds / 4

    @property
    def _writable_seconds(self) -> float:
        """How long after a renewal's start this process may write: ``L/4`` before the lease could expire."""
        return 0.75 * self.lease_seconds

    # -- taking ------------------------------------------------------------------
    def acquire(self, training: bool = False) -> LeaseLock:
        """Takes the lease; ``training``: this process names its run (``ESTIMAX_RUN_ID``), so that it takes
        over an earlier attempt's lease at once and a later attempt takes over its own (readers never do)."""
        if self.held:
            return self
        self.left, self._unanswered = (), {}
        self._object = self._object or open_object(self.path)
        self._record = dataclasses.replace(this_process(training), lease_seconds=self.lease_seconds)
        deadline = Deadline("taking the lock", self.path, self.deadline_seconds, fix="nothing was written; run "
                            "the same command again once the store answers")  # fmt: skip
        while True:
            try:
                if self._try_take():
                    return self
            except Changed:
                pass  # another process changed it in between: look again
            except Exception as error:  # noqa: BLE001 - the clients' own kinds
                self._retry_or_fail(deadline, error)
                continue
            if deadline.left() < 0:
                raise ModelDirLockedError(
                    f"model_dir {self.model_dir}: other processes kept taking and releasing the lock {self.path} "
                    f"for {self.deadline_seconds:g} s ({DEADLINE_SECONDS}); expected one writer per model_dir. "
                    "Fix: stop the others, or use another model_dir."
                )

    def _try_take(self) -> bool:
        started = time.monotonic()
        version = self._object.create(self._sent(started), self._call_seconds)
        if version is not None:
            self._hold(version, started)
            return True
        found = self._object.read(self._call_seconds)
        if found is None:
            return False  # released in between
        applied = self._unanswered.get(found[0])  # an earlier try's create or replace, applied, its answer lost
        if applied is not None:
            self._hold(found[1], applied)
            return True
        holder = lease_holder(found[0], self.path)
        if continues(holder, self._record):
            raise superseded(self.model_dir, holder)
        age = time.time() - holder.renewed_at
        gone = is_stale(holder)  # a holder on this host can be checked at once: no need to wait
        earlier = continues(self._record, holder)  # an earlier attempt of this run: over, or it stops
        if age <= holder.lease_seconds and not gone and not earlier:
            raise ModelDirLockedError(
                f"model_dir {self.model_dir} is being written by another process: {describe(holder)}; its "
                f"lease was renewed {age:.0f} s ago. Expected one writer per model_dir. Fix: wait for it to "
                "finish, stop it, or use another model_dir; a holder that is gone releases the lock when its "
                f"lease expires ({holder.lease_seconds:g} s without renewal), or delete it: "
                f"{delete_command(self.path)}."
            )
        self.left = left_steps(holder, still_writing=not gone)
        self._record = dataclasses.replace(self._record, left=self.left)  # passed on: a paused holder may write them
        started = time.monotonic()
        self._hold(self._object.replace(self._sent(started), found[1], self._call_seconds), started)
        expired = "its holder is gone" if gone else f"its lease expired {age - holder.lease_seconds:.0f} s ago"
        reason = f"it is held by an earlier attempt of this run ({RUN_ID}={holder.run})" if earlier else expired
        logger.warning("Took over the lock of model_dir %s: %s (%s).", self.model_dir, reason, describe(holder))
        return True

    def _retry_or_fail(self, deadline: Deadline, error: BaseException) -> None:
        """Returns after a pause when the store did not answer and the ``deadline`` allows another try;
        raises otherwise."""
        if isinstance(error, ModelDirLockedError | StorageError):
            raise error
        if not unanswered(error):
            storage.check_store(self.model_dir, write=True)  # names a missing bucket, credentials, permission
            raise StorageError(f"{self.path}: {deadline.operation} failed: {one_line(error)}") from None
        time.sleep(deadline.pause_before_retry(error, self._call_seconds))

    # -- keeping -----------------------------------------------------------------
    def _hold(self, version: str, started: float) -> None:
        self._version, self._lost, self._unanswered = version, None, {}
        self._proof = Proof(self._writable_seconds, self._watches_pauses, started)
        self.held = True
        self._stop, self._wake = threading.Event(), threading.Event()
        self._keeper = threading.Thread(target=self._keep, args=(self._stop, self._wake), name="estimax-lease",
                                        daemon=True)  # fmt: skip
        self._keeper.start()
        if self._watches_pauses:
            threading.Thread(target=self._proof.watch, args=(self._stop, self._changed, self._wake),
                             name="estimax-lease-pauses", daemon=True).start()  # fmt: skip

    @property
    def _watches_pauses(self) -> bool:
        """Whether a later attempt of this holder's run may take the lease over before it expires."""
        return self._record.run is not None

    def _keep(self, stop: threading.Event, wake: threading.Event) -> None:
        """Renews the lease every L/4 (at once after a failure or a pause) until released or lost."""
        pause = self._call_seconds
        while True:
            wake.wait(pause)
            wake.clear()
            if stop.is_set():
                return
            started = time.monotonic()
            try:
                version = self._object.replace(self._sent(started), self._version, self._call_seconds)
            except Changed:
                with contextlib.suppress(Exception):  # a renewal applied, its answer lost: the lease is still its own
                    found = self._object.read(self._call_seconds)
                    applied = self._unanswered.get(found[0]) if found is not None else None
                    if applied is not None:
                        self._renewed(found[1], applied)
                        pause = 0.0
                        continue
                with self._changed:  # nothing is written from now on, however long the line takes to compose
                    self._composed.clear()
                    self._lost = LeaseLostError(f"model_dir {self.model_dir}: another process took over {self.path}.")
                return self._lose(self._taken_over())
            except Exception as error:  # noqa: BLE001 - the clients' own kinds
                if unanswered(error):
                    proof = Deadline("renewing the lease", self.path, self._writable_seconds, self._proof.started)
                    with contextlib.suppress(StoreUnavailableError):
                        pause = proof.pause_before_retry(error, min(1.0, self._call_seconds),
                                                         until=" before this process stops writing")  # fmt: skip
                        continue
                    if started < self._proof.until:
                        pause = 0.0  # a call begun in time, cut off (perhaps frozen mid-call): once more, now
                        continue
                return self._lose(self._unreachable(error))
            self._renewed(version, started)
            pause = self._call_seconds

    def _renewed(self, version: str, started: float) -> None:
        """The store holds this process's lease as ``version``, written by a renewal begun at ``started``."""
        with self._changed:
            if started > self._proof.until:
                logger.warning(
                    "%s: this process could not prove it held the lease for %.0f s (it was paused or starved "
                    "of CPU) and wrote nothing meanwhile; nobody took the lease over: writing goes on.",
                    self.path, started - self._proof.until,
                )  # fmt: skip
            self._version, self._unanswered = version, {}
            self._proof.renewed(started)
            self._changed.notify_all()

    def _lose(self, error: StorageError | ModelDirLockedError) -> None:
        stop = self._stop
        with self._changed:
            self._lost = error
            self._composed.set()
            self._changed.notify_all()
        # Writes that are under way may be stuck on a store that does not answer: end the process.
        if not stop.wait(self._call_seconds):
            print(f"estimax: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
            os._exit(STORE_FAILURE_EXIT_CODE)

    def _taken_over(self) -> LeaseLostError:
        step, taker = None, None
        try:
            found = self._object.read(self._call_seconds)
            taker = lease_holder(found[0], self.path) if found else None
            step = self.committed_step(read=True)  # the store answers: what is committed there now
        except Exception as error:  # noqa: BLE001 - the loss is what matters; who took it is a detail
            taker = f"unknown (reading the lock failed: {one_line(error)})"
        step = self.committed_step() if step is None else step
        return taken_over(self.model_dir, self.path, taker, self._record, step)

    def _unreachable(self, error: BaseException) -> StoreUnavailableError:
        waited = time.monotonic() - self._proof.started
        return StoreUnavailableError(
            f"{self.path}: renewing the lease: the store did not answer for {waited:.0f} s ({one_line(error)}); "
            f"this process stopped writing before its {self.lease_seconds:g} s lease could expire. "
            f"Fix: {resume(self.committed_step())} with the same command once the store answers."
        )

    def _expires(self) -> str:
        return f"none needed: the next run takes the lock over once its lease expires ({self.lease_seconds:g} s)"

    def _sent(self, started: float) -> bytes:
        """The record to write now, kept until the store answers (a write cut off by its timeout may be applied)."""
        data = dataclasses.replace(self._record, renewed_at=time.time()).to_json().encode()
        self._unanswered[data] = started
        return data

    # -- writing under it ----------------------------------------------------------
    def check(self) -> None:
        """Returns while this process provably holds the lease (or holds none: a reader); raises ``LeaseLostError`` or
        ``StoreUnavailableError`` once it cannot prove it. Past its proof (it was paused; a holder that names its
        run: after any pause of ``PAUSE_SECONDS``) it waits for the renewal thread's verdict, at most two calls to
        the store."""
        if not self.held:
            return
        with self._changed:
            if self._lost is None and not self._proof.holds(time.monotonic()):
                self._changed.wait_for(
                    lambda: self._lost is not None or self._proof.holds(time.monotonic()), 2 * self._call_seconds + 1
                )
            lost = self._lost
            if lost is None and not self._proof.holds(time.monotonic()):
                lost = self._unreachable(TimeoutError("no verdict from the renewal"))
        if lost is not None:
            raise self._said(lost)

    def prove(self, saving: int | None = None) -> None:
        """Returns when this process holds the lease now, not only within the window of its last renewal; raises as
        ``check()`` does. Called before a write that must not land after a takeover (a checkpoint's start and commit,
        a deletion, an upload of the records). A holder that a later attempt of its run may take over at any moment
        reads the lease (a takeover replaced it). ``saving``: the step of the checkpoint about to be written, named
        in the lease by a renewal that began after this call, so that a process that takes the lease over, even once
        it expired, never writes that step (``fenced_commit.py``)."""
        if not self.held:
            return
        self.check()
        if saving is None and not self._watches_pauses:
            return  # taken over only once expired, which ``check()`` rules out
        if saving is None:
            with contextlib.suppress(Exception):  # a read that failed: a renewal gives the verdict
                found = self._object.read(self._call_seconds)
                holder = lease_holder(found[0], self.path) if found else None
                if holder is not None and holder.same_process(self._record):
                    return
        began = time.monotonic()
        with self._changed:
            if saving is not None:
                self._record = dataclasses.replace(self._record, saving=saving)
            self._wake.set()
            self._changed.wait_for(lambda: self._lost is not None or self._proof.started >= began,
                                   2 * self._call_seconds + 1)  # fmt: skip
            lost = self._lost
            if lost is None and self._proof.started < began:
                lost = self._unreachable(TimeoutError("no verdict from the renewal"))
        if lost is not None:
            raise self._said(lost)

    def _said(self, lost: StorageError | ModelDirLockedError) -> StorageError | ModelDirLockedError:
        """The error to raise; after a takeover, the line naming the taker, which the renewal thread composes."""
        if not self._composed.wait(2 * self._call_seconds + 1):
            return type(lost)(str(lost))
        return type(self._lost)(str(self._lost))

    def writable(self) -> bool:
        """Whether this process may write under the lock now (``check()`` without the error)."""
        try:
            self.check()
        except (LeaseLostError, StoreUnavailableError):
            return False
        return True

    # -- releasing -----------------------------------------------------------------
    def release(self) -> None:
        """Deletes the lease object if it is still this process's, retrying until the deadline;
        never raises (it runs in a ``finally``): a failure is one warning line."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        self._wake.set()
        if self._keeper is not None:
            self._keeper.join(self._call_seconds + 1)
        if self._lost is not None:  # another process's lock now, or a store its keeper gave up on: left as it is
            if not isinstance(self._lost, ModelDirLockedError):
                waited = time.monotonic() - self._proof.started
                logger.warning("%s: releasing the lock: the store did not answer for %.0f s (renewing the lease). "
                               "Fix: %s.", self.path, waited, self._expires())  # fmt: skip
            return
        deadline = Deadline("releasing the lock", self.path, self.deadline_seconds, fix=self._expires())
        while True:
            try:
                found = self._object.read(self._call_seconds)
                if found is not None and (found[1] == self._version or found[0] in self._unanswered):
                    self._object.delete(found[1], self._call_seconds)
                return
            except Changed:
                return
            except Exception as error:  # noqa: BLE001 - the clients' own kinds
                try:
                    self._retry_or_fail(deadline, error)
                except Exception as failure:  # noqa: BLE001 - a warning: the error in flight is the one to report
                    logger.warning("%s", " ".join(str(failure).split()))
                    return

    def __enter__(self) -> LeaseLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
