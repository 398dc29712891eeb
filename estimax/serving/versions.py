"""The versions a server holds: one artifact, or the newest versions of an export base as they appear.

An export base is a directory whose integer-named subdirectories are versions,
``BASE/<step>/``, each an artifact complete once its ``signature.json`` is there
(export's ``publish`` renames a staged directory into place on disk and uploads
``signature.json`` last to an object store). Anything else under BASE (dot-names,
other names, a directory without ``signature.json``) is not a version.

Owns telling an artifact from a base, polling the base, loading and compiling a
version before it answers (so a swap drops no request), TF Serving's version
states (START, LOADING, AVAILABLE, UNLOADING, END), refusing a broken version
once (remembered by its files' fingerprint, retried only when they change)
while the old one keeps serving, and unloading a version that left the base or
fell out of the newest ``num_versions`` once its requests are answered.
Does not own HTTP (``server.py``), batching (``batching.py``) nor reading and
verifying an artifact (``artifact.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import os
import sys
import time

from estimax import storage
from estimax.errors import ArtifactError, StoreUnavailableError, one_line
from estimax.serving.batching import Batcher, calibrate, warm_up

SIGNATURE, ARTIFACT_FILES = "signature.json", ("model.jaxexport", "params")
START, LOADING, AVAILABLE, UNLOADING, END = "START", "LOADING", "AVAILABLE", "UNLOADING", "END"


@dataclasses.dataclass(frozen=True)
class Batching:
    """How every version batches: ``max_batch`` rows per call, waiting up to ``max_wait`` seconds;
    ``calibrate``: lower ``max_batch`` to the fastest size, timed on the first version loaded."""

    max_batch: int
    max_wait: float
    calibrate: bool


def is_base(path: str) -> bool:
    """Whether ``path`` is an export base (a directory that is not itself an artifact)."""
    if storage.exists(storage.join(path, SIGNATURE)) or not storage.isdir(path):
        return False  # an artifact, or nothing: loading it says what is wrong
    return not set(ARTIFACT_FILES) & set(storage.listdir(path))  # else an artifact that lost its signature


class Version:
    """One version: its state, and once AVAILABLE its model and batcher."""

    def __init__(self, number: int, path: str):
        self.number, self.path, self.state = number, path, START
        self.model, self.batcher, self._batching = None, None, None
        self.error_code, self.error = "OK", ""  # why it cannot be served (state END)
        self.in_flight = 0  # requests it is answering
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self, model, batching: Batching, executor) -> None:
        self.model = model
        self.batcher = Batcher(model, batching.max_batch, batching.max_wait, executor)
        self._batching = asyncio.create_task(self.batcher.run())
        self.state = AVAILABLE

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def unload(self) -> None:
        """Takes no new request, answers those it holds, then lets its model go."""
        self.state = UNLOADING
        await self._idle.wait()
        self.stop()

    def stop(self) -> None:
        if self._batching is not None:
            self._batching.cancel()
        self.model, self.batcher, self._batching, self.state = None, None, None, END

    def fail(self, error: BaseException) -> None:
        self.state, self.error = END, one_line(error)
        self.error_code = "DATA_LOSS" if isinstance(error, ArtifactError) else "UNKNOWN"

    def status(self) -> dict:
        """TF Serving's ``model_version_status`` entry."""
        return {
            "version": str(self.number),
            "state": self.state,
            "status": {"error_code": self.error_code, "error_message": self.error},
        }


@dataclasses.dataclass
class _Loaded:
    """What the loading thread hands back: the files' fingerprint, then the model or the error."""

    fingerprint: str
    model: object = None
    max_batch: int = 0
    error: BaseException | None = None
    load_seconds: float = 0.0
    compile_seconds: float = 0.0


class Versions:
    """The versions of one served model; requests ask ``pick`` which one answers.

    ``base``: the export base to follow, or None for one artifact (``hold``).
    Loading and compiling run on a thread of their own; everything else, on the
    event loop, so that picking a version and entering it happen at once.
    """

    def __init__(self, base: str | None, batching: Batching, executor, num_versions: int = 1):
        self.base, self.batching, self.executor, self.num_versions = base, batching, executor, num_versions
        self.table: dict[int, Version] = {}
        self.broken: dict[int, str] = {}  # number -> fingerprint of the files that failed to load
        self.max_batch = batching.max_batch  # calibrated on the first version, then kept
        self._calibrated = not batching.calibrate
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="estimax-load")
        self._available = asyncio.Event()
        self._store_trouble = ""
        self._unloading: set[asyncio.Task] = set()
        self.polls = 0  # polls of the base finished, failed ones included

    def hold(self, number: int, path: str, model) -> None:
        """Serves one artifact already loaded (and calibrated): ``estimax serve ARTIFACT``."""
        version = self.table[number] = Version(number, path)
        version.start(model, dataclasses.replace(self.batching, max_batch=self.max_batch), self.executor)
        self._available.set()

    def pick(self, number: int | None = None) -> Version | None:
        """The AVAILABLE version ``number``, or the newest AVAILABLE one; None when there is none."""
        if number is not None:
            version = self.table.get(number)
            return version if version is not None and version.state == AVAILABLE else None
        return max((v for v in self.table.values() if v.state == AVAILABLE), key=lambda v: v.number, default=None)

    def statuses(self, number: int | None = None) -> list[dict]:
        """TF Serving's ``model_version_status``: every version known (newest first), or ``number``'s."""
        chosen = sorted(self.table, reverse=True) if number is None else [number] if number in self.table else []
        return [self.table[n].status() for n in chosen]

    def in_flight(self) -> int:
        return sum(v.in_flight for v in self.table.values())

    async def wait_available(self) -> None:
        await self._available.wait()

    async def follow(self, poll_seconds: float) -> None:
        """Polls the base every ``poll_seconds`` for ever (cancel to stop)."""
        while True:
            try:
                await self.poll()
            except Exception as error:  # e.g. the base's bucket lost its permissions: keep serving, keep trying
                self._say_store_trouble(error)
            self.polls += 1
            await asyncio.sleep(poll_seconds)

    async def poll(self) -> None:
        """Loads the newest versions not held yet, newest first, then unloads those no longer wanted."""
        while True:
            held = {n for n, v in self.table.items() if v.state in (LOADING, AVAILABLE)}
            try:
                wanted, present = await asyncio.to_thread(_choose, self.base, self.num_versions, held, self.broken)
            except StoreUnavailableError as error:  # the store will answer again: keep serving meanwhile
                self._say_store_trouble(error)
                return
            self._store_trouble = ""
            for number in [n for n in self.table if n not in present and self.table[n].state == END]:
                del self.table[number]  # gone from the base: forgotten, and so is its failure
            self.broken = {n: f for n, f in self.broken.items() if n in present}
            missing = [(n, p) for n, p in wanted if n not in held]
            for number, path in missing:
                if self.table.get(number) is None or self.table[number].state == END:
                    self.table[number] = Version(number, path)
            if not missing:
                break
            await self._load(self.table[missing[0][0]])
        self._unload_unwanted({n for n, _ in wanted})

    async def _load(self, version: Version) -> None:
        version.state = LOADING
        calibrating = not self._calibrated
        loop = asyncio.get_running_loop()
        loaded = await loop.run_in_executor(self._loader, _load, version.path, self.max_batch, calibrating)
        if isinstance(loaded.error, StoreUnavailableError):
            del self.table[version.number]  # not the version's fault: tried again at the next poll
            self._say_store_trouble(loaded.error)
            return
        if loaded.error is not None:
            self.broken[version.number] = loaded.fingerprint
            version.fail(loaded.error)
            serving = self.pick()
            keeps = f"version {serving.number} keeps serving" if serving else "no version is serving yet"
            print(
                f"Version {version.number} ({version.path}) refused: {version.error} ({keeps}; tried again once "
                "its files change)",
                file=sys.stderr,
                flush=True,
            )
            return
        self.max_batch, self._calibrated = loaded.max_batch, True
        self.broken.pop(version.number, None)  # its files changed since: it loads now
        version.start(loaded.model, dataclasses.replace(self.batching, max_batch=self.max_batch), self.executor)
        self._available.set()
        newest = self.pick() is version
        print(
            f"Version {version.number} AVAILABLE (loaded in {loaded.load_seconds:.2f} s, compiled in "
            f"{loaded.compile_seconds:.2f} s){'; it answers new requests' if newest else ''}",
            file=sys.stderr,
            flush=True,
        )

    def _unload_unwanted(self, wanted: set[int]) -> None:
        """Unloads the AVAILABLE versions not wanted, oldest first, keeping at least the newest one."""
        available = sorted((v for v in self.table.values() if v.state == AVAILABLE), key=lambda v: -v.number)
        unwanted = [v for v in available if v.number not in wanted]
        if len(unwanted) == len(available):
            unwanted = unwanted[1:]  # none of the wanted ones could be loaded: the newest held keeps serving
        for version in reversed(unwanted):
            version.state = UNLOADING  # at once: no request picks it from now on
            task = asyncio.create_task(self._unload(version))
            self._unloading.add(task)
            task.add_done_callback(self._unloading.discard)

    async def _unload(self, version: Version) -> None:
        await version.unload()
        print(f"Version {version.number} unloaded", file=sys.stderr, flush=True)

    def _say_store_trouble(self, error: BaseException) -> None:
        message = one_line(error)
        if message != self._store_trouble:  # once per distinct trouble, not once per poll
            print(f"Polling {self.base}: {message} (the versions held keep serving)", file=sys.stderr, flush=True)
        self._store_trouble = message

    async def close(self) -> None:
        """Stops every version (after the server has answered its requests) and the loading thread."""
        for task in list(self._unloading):
            task.cancel()
        for version in self.table.values():
            version.stop()
        self._loader.shutdown(wait=False, cancel_futures=True)


def _choose(base: str, num_versions: int, held: set[int], broken: dict[int, str]):
    """``(wanted, present)``: the newest ``num_versions`` versions worth holding as ``[(number, path)]``,
    and every version number listed. A version is worth holding when held already, or complete and
    not remembered broken with the same files."""
    names = {int(n): n for n in storage.listdir(base) if n.isascii() and n.isdigit()}
    wanted = []
    for number in sorted(names, reverse=True):
        if len(wanted) == num_versions:
            break
        path = storage.join(base, names[number])
        if number in held:
            wanted.append((number, path))
        elif storage.exists(storage.join(path, SIGNATURE)):
            if number not in broken or _fingerprint_or_unreadable(path) != broken[number]:
                wanted.append((number, path))
    return wanted, set(names)


def fingerprint(path: str) -> str:
    """A digest of the version's signature.json and of its files' names, sizes and modification times:
    it changes when the version is written again or its copy goes on."""
    digest = hashlib.sha256(storage.read_bytes(storage.join(path, SIGNATURE)))
    for entry in sorted(_files(path)):
        digest.update(repr(entry).encode())
    return digest.hexdigest()


def _files(path: str) -> list[tuple[str, int, str]]:
    if not storage.is_url(path):
        return [
            (os.path.relpath(os.path.join(root, f), path), *_size_and_time(os.path.join(root, f)))
            for root, _, names in os.walk(path)
            for f in names
        ]

    def listing():
        fs, inner = storage.filesystem(path)
        fs.invalidate_cache(inner)
        found = fs.find(inner, detail=True)
        when = ("mtime", "updated", "LastModified")
        return [(k, v.get("size", 0), str(next((v[w] for w in when if w in v), ""))) for k, v in found.items()]

    return storage.bounded("listing", path, listing)


def _size_and_time(file: str) -> tuple[int, str]:
    stat = os.stat(file)
    return stat.st_size, str(stat.st_mtime_ns)


def _load(path: str, max_batch: int, calibrating: bool) -> _Loaded:
    """Runs on the loading thread: reads and verifies the version, then compiles every batch size."""
    from estimax.serving import artifact

    try:
        loaded = _Loaded(_fingerprint_or_unreadable(path))  # first: files changed later make a new one
    except StoreUnavailableError as error:
        return _Loaded("", error=error)
    try:
        start = time.perf_counter()
        loaded.model = artifact.load(path)  # a store's version: from a local copy, deleted once read
        loaded.load_seconds = time.perf_counter() - start
        start = time.perf_counter()
        if calibrating:
            loaded.max_batch = calibrate(loaded.model, max_batch)
        else:
            warm_up(loaded.model, max_batch)
            loaded.max_batch = max_batch
        loaded.compile_seconds = time.perf_counter() - start
    except Exception as error:  # a broken version is refused; the server keeps serving
        loaded.model, loaded.error = None, error
    return loaded


def _fingerprint_or_unreadable(path: str) -> str:
    try:
        return fingerprint(path)
    except StoreUnavailableError:
        raise
    except Exception:  # e.g. removed meanwhile: loading it fails and says why
        return "unreadable"
