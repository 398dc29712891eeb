"""Holds: a follower's claim, under ``<model_dir>/holds/<name>.json``, on the checkpoints it has not read yet.

A hold says "keep every committed step from ``floor`` on" and expires at ``expires_at``
(wall-clock seconds) unless its follower renews it; a follower that dies stops renewing,
so a dead one never makes the trainer keep everything. One follower per name: a second
is refused while the hold is live (``ModelDirLockedError``, exit status 2), unless the holder ran on
this host and its process is gone (then it is taken over at once, as ``lock.py`` does).
On a bucket every write is conditional on the version this process read or wrote last
(``conditional.py``): a follower whose hold was taken over learns it at its next
renewal and stops. Owns the hold's record, taking, renewing and releasing it, and
``live_floors`` (what pruning reads). Does not own which steps a follower reads
(``follow.py``) nor what the trainer deletes (``pruning.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time

from estimax import storage
from estimax.errors import LeaseLostError, ModelDirLockedError
from estimax.run.lock import is_stale, process_start

HOLDS = "holds"  # a model_dir's folder of holds


def hold_path(model_dir: str, name: str) -> str:
    return storage.join(model_dir, HOLDS, f"{name}.json")


class _Object:
    """The hold's object: read with a version, created if absent, replaced if unchanged. On a bucket
    by generation or ETag; on disk by the content's digest (one machine's processes, pid-checked)."""

    def __init__(self, path: str):
        self.path = path
        self._store = None
        if storage.is_url(path):
            from estimax.storage.conditional import open_object

            self._store = open_object(path)

    def read(self) -> tuple[bytes, str] | None:
        if self._store is not None:
            return storage.bounded("reading a hold", self.path, self._store.read, storage.deadline_seconds())
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def create(self, data: bytes) -> str | None:
        if self._store is not None:
            return storage.bounded("writing a hold", self.path, self._store.create, data, storage.deadline_seconds())
        storage.makedirs(storage.parent(self.path))
        return hashlib.sha256(data).hexdigest() if storage.create_exclusive(self.path, data) else None

    def replace(self, data: bytes, version: str) -> str | None:
        """The new version, or ``None`` when the object is no longer ``version``."""
        if self._store is not None:
            from estimax.storage.conditional import Changed

            try:
                timeout = storage.deadline_seconds()
                return storage.bounded("writing a hold", self.path, self._store.replace, data, version, timeout)
            except Changed:
                return None
        found = self.read()
        if found is None or found[1] != version:
            return None
        storage.write_bytes(self.path, data)
        return hashlib.sha256(data).hexdigest()

    def delete(self, version: str) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):  # taken over or gone: not ours to delete
                storage.bounded("deleting a hold", self.path, self._store.delete, version, storage.deadline_seconds())
            return
        found = self.read()
        if found is not None and found[1] == version:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


class Hold:
    """This process's hold on the steps of ``model_dir`` it has not read (``name``: the evaluation set).

    Args:
      model_dir: the run's directory (a path or URL).
      name: the follower's name (its evaluation set); one live hold per name.
      seconds: how long the hold lives unless renewed; renewed every third of it by ``keep_alive``.
    """

    def __init__(self, model_dir: str, name: str, seconds: float):
        self.path = hold_path(model_dir, name)
        self.name, self.seconds = name, seconds
        self.floor = 0
        self._object = _Object(self.path)
        self._version: str | None = None
        self._writing = threading.Lock()  # the renewing thread and the follower's floor updates
        self._lost: BaseException | None = None

    def _record(self) -> bytes:
        pid = os.getpid()
        return json.dumps({
            "name": self.name, "floor": self.floor, "expires_at": time.time() + self.seconds,
            "host": socket.gethostname(), "pid": pid, "process_start": process_start(pid),
        }).encode()  # fmt: skip

    def take(self, floor: int) -> None:
        """Takes the hold from ``floor`` on; raises ``ModelDirLockedError`` while another live follower holds it."""
        self.floor = floor
        found = self._object.read()
        if found is None:
            self._version = self._object.create(self._record())
            if self._version is not None:
                return
            found = self._object.read()
        holder = _parse(found[0]) if found else {}
        if found is not None and not (holder.get("expires_at", 0) < time.time() or is_stale(holder)):
            raise ModelDirLockedError(
                f"Another follower of {storage.parent(storage.parent(self.path))} for {self.name!r} is running "
                f"(host {holder.get('host')}, pid {holder.get('pid')}; its hold {self.path} expires in "
                f"{holder.get('expires_at', 0) - time.time():.0f} s unless it renews it); expected one follower per "
                "run and evaluation set. Fix: stop it, or start this one once it has ended (a follower that died "
                "is replaced after its hold expires), or follow another set with --set-name."
            )
        version = self._object.replace(self._record(), found[1]) if found else self._object.create(self._record())
        if version is None:
            raise ModelDirLockedError(
                f"Another follower took the hold {self.path} at the same time as this one; expected one follower "
                "per run and evaluation set. Fix: let that one run, or stop it and start this one again."
            )
        self._version = version

    def move(self, floor: int) -> None:
        """Keeps the steps from ``floor`` on (and no longer those before it)."""
        self.floor = floor
        self.renew()

    def renew(self) -> None:
        """Writes the hold again with a new expiry; raises ``LeaseLostError`` once another follower took it."""
        if self._lost is not None:
            raise self._lost
        with self._writing:
            version = self._object.replace(self._record(), self._version)
            if version is None:
                self._lost = LeaseLostError(
                    f"The hold {self.path} was taken over by another follower (this one was paused or cut off for "
                    f"longer than its {self.seconds:g} s); this one stops. Expected one follower per run and "
                    "evaluation set. Fix: none if the other one carries on; otherwise run this one again."
                )
                raise self._lost
            self._version = version

    @contextlib.contextmanager
    def keep_alive(self):
        """Renews the hold every third of its life on a thread of its own while the block runs (an
        evaluation may take longer than the hold lives); releases it when the block ends normally."""
        stop = threading.Event()

        def renew():
            while not stop.wait(self.seconds / 3):
                try:
                    self.renew()
                except LeaseLostError:
                    return  # said by the follower's next ``check``
                except Exception:  # noqa: S112 - a store that did not answer: tried again at the next beat
                    continue

        thread = threading.Thread(target=renew, name="estimax-hold", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
        self.release()  # at a normal end only: after an error it expires (a restart takes it over)

    def check(self) -> None:
        if self._lost is not None:
            raise self._lost

    def release(self) -> None:
        with self._writing:
            if self._version is not None:
                self._object.delete(self._version)
                self._version = None


def live_floors(model_dir: str) -> list[int]:
    """The floors of the holds of ``model_dir`` that have not expired (what pruning keeps from)."""
    folder = storage.join(model_dir, HOLDS)
    try:
        names = storage.listdir(folder)
    except FileNotFoundError:
        return []
    floors, now = [], time.time()
    for name in names:
        if not name.endswith(".json"):
            continue
        with contextlib.suppress(FileNotFoundError):
            holder = _parse(storage.read_bytes(storage.join(folder, name)))
            # Live until it expires, even when its process is gone: a follower restarted meanwhile finds its steps.
            if holder.get("expires_at", 0) >= now and isinstance(holder.get("floor"), int):
                floors.append(holder["floor"])
    return floors


def _parse(data: bytes) -> dict:
    try:
        record = json.loads(data)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}
