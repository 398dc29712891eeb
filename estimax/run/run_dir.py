"""Everything estimax keeps for a run: ``RunDir`` owns the model_dir, ``NoRunDir`` stands for none.

A model_dir (a local path, ``file://``, ``gs://`` or ``s3://``) holds::

    checkpoints/<step>/     Orbax checkpoints of the TrainState (checkpoint.py)
    best/<step>/            the best checkpoint by an evaluation metric
    estimax.lock            one writer at a time (lock.py: a file, or a lease object)
    metrics.jsonl           the records of training and evaluation (writers.py)
    events.out.tfevents.*   TensorBoard event files: the run is one TensorBoard run (its
                            tags train/..., eval/..., eval_<set>/...; 0.1.0 wrote
                            tensorboard/<split>/, left as they are)
    profile/                jax.profiler traces
    trackers.json           the experiment trackers' run ids
    ended.json              the last checkpoint of a training call that ended normally (followers stop there)
    evaluations/<set>.jsonl a follower's records of each checkpoint it evaluated (follow.py)
    holds/<set>.json        a follower's hold on the checkpoints it has not read (holds.py)

Owns these names (``checkpoints`` is spelt in ``checkpoint.py``, which also
finds it in a model_dir given as a checkpoint path; ``estimax.lock`` in
``lock.py``), which object reads and writes each, taking the lock around
writing (process 0 takes it for the group, the others learn the outcome),
and refusing, before anything is written, a location that cannot hold a run.
Every other module asks a ``RunDir`` for a path; none joins one itself.
``NoRunDir`` (``RunConfig(model_dir=None)``) answers the same questions:
no checkpoints, no files, nothing to lock. Does not own what a checkpoint
holds (``checkpoint.py``) nor what a record says (``metric_logger.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import uuid

import jax

from estimax import errors, storage
from estimax.config import CheckpointPolicy
from estimax.errors import ConfigError, ModelDirLockedError, ModelDirNotWritableError, StorageError
from estimax.run.checkpoint import CHECKPOINTS, Checkpointer
from estimax.run.locks import lock_for
from estimax.run.run_setup import RunSetup

logger = logging.getLogger("estimax")

BEST, METRICS, PROFILE, TRACKERS = (
    "best",
    "metrics.jsonl",
    "profile",
    "trackers.json",
)
ENDED = "ended.json"  # removed when a training call starts, written when one ends normally


def open_run_dir(model_dir, policy: CheckpointPolicy, run_meta: RunSetup) -> RunDir | NoRunDir:
    """The run directory of ``RunConfig(model_dir=...)``: a ``RunDir``, or ``NoRunDir`` for ``None``."""
    return NoRunDir() if model_dir is None else RunDir(model_dir, policy, run_meta)


class RunDir:
    """The files of one run under ``url``; read-only until ``writing()``."""

    def __init__(self, model_dir, policy: CheckpointPolicy, run_meta: RunSetup | None = None):
        check_variables_set(model_dir)
        self.url = storage.resolve(model_dir)
        check_supported(self.url)
        check_not_below_file(self.url)
        # What a lost lock says to resume from: the checkpoints' last committed step.
        self.lock = lock_for(self.url, committed_step=lambda read=False: self.checkpoints.committed_step(read=read))
        self.checkpoints = Checkpointer(self.path(CHECKPOINTS), policy, read_only=True, lock=self.lock, setup=run_meta)
        self._attempt = uuid.uuid4().hex[:8]  # this process's name for its temporary folders (fenced_commit.py)

    def __repr__(self) -> str:
        return f"RunDir({self.url!r})"

    def path(self, *names: str) -> str:
        return storage.join(self.url, *names)

    @property
    def profile_dir(self) -> str:
        return self.path(PROFILE)

    @property
    def tensorboard_dir(self) -> str:
        """Where the event files go: the model_dir itself, so that ``tensorboard --logdir`` over runs side
        by side shows each as one run named after its directory."""
        return self.url

    @property
    def trackers_file(self) -> str:
        return self.path(TRACKERS)

    @property
    def name(self) -> str:
        return storage.name(self.url)

    def no_checkpoint(self) -> str:
        return f"model_dir {self.url!r} has no checkpoint"

    def best(self, metric: str, direction: str) -> Checkpointer:
        """The best checkpoint by ``metric`` (``direction`` "max" or "min"), opened by ``writing``."""
        policy = CheckpointPolicy(every_steps=None, keep=1)
        return Checkpointer(self.path(BEST), policy, read_only=True, best=(metric, direction), lock=self.lock)

    def file_writers(self, tensorboard: bool, continuing_from: int | None = None) -> list:
        """``metrics.jsonl`` and, with ``tensorboard``, the event files: each on a thread of its own.
        ``continuing_from``: the step training starts from; the records a dead run left past it are
        dropped (``writers.py``), so that the records read as one history."""
        from estimax.records.writer_thread import InBackground
        from estimax.records.writers import JsonlWriter, TensorBoardWriter

        # Nothing is written once the lock is lost, and an upload to a store first proves it is held.
        writable, fence = self.lock.writable, self.lock.prove
        metrics, events = self.path(METRICS), self.tensorboard_dir
        writers: list = [InBackground(JsonlWriter(metrics, continuing_from, fence), metrics, writable)]
        if tensorboard:
            writers.append(InBackground(TensorBoardWriter(events, continuing_from, fence), events, writable))
        return writers

    def records(self, split: str) -> list[dict]:
        """The ``metrics.jsonl`` records of ``split`` (``"train"``, ``"resize"``, ...), in order; none
        without the file."""
        path = self.path(METRICS)
        if not storage.exists(path):
            return []
        return [r for r in map(_record, storage.read_bytes(path).decode().splitlines()) if r.get("split") == split]

    def fence(self) -> None:
        """Raises once this process cannot prove it still holds the model_dir's lease (``lease.py``):
        training calls it before every save and at every loop boundary."""
        self.lock.check()

    @contextlib.contextmanager
    def writing(self, sync, best: Checkpointer | None = None):
        """Holds the lock while training writes here (process 0 takes it for the group; the others
        learn the outcome and fail alike); the checkpointers write until it ends, on every exit path."""
        primary = jax.process_index() == 0
        outcome = "ok"
        if primary:
            try:
                self.lock.acquire(training=True)  # names the run (ESTIMAX_RUN_ID): a later attempt takes over
            except (ModelDirLockedError, ModelDirNotWritableError, StorageError) as error:
                outcome = f"{type(error).__name__}:{error}"
        outcome = sync.share("taking the model_dir lock", outcome)
        # Every process saves the same steps: the steps left to an earlier holder are process 0's.
        shared = json.loads(sync.share("this attempt's name and the steps it leaves", json.dumps(
            {"attempt": self._attempt, "left": list(self.lock.left)})))  # fmt: skip
        if outcome != "ok":  # the same error on every process, rebuilt from the family by its name
            kind, text = outcome.split(":", 1)
            found = getattr(errors, kind, None)
            raise (found if isinstance(found, type) and issubclass(found, errors.EstimaxError) else StorageError)(text)
        try:
            if primary:
                self._end_marker(None)  # training again: a follower does not stop at an earlier end
            self.checkpoints.open_for_writing(primary, shared["attempt"], shared["left"])
            if best is not None:
                best.open_for_writing(primary, shared["attempt"])
            yield
            if best is not None:
                best.close_for_writing()
                best = None
            self.checkpoints.close_for_writing()  # the saves in flight committed: the last checkpoint is known
            if primary:
                self._end_marker(self.checkpoints.committed_step(read=True))
        finally:
            try:
                if best is not None:
                    best.close_for_writing()
                self.checkpoints.close_for_writing()
            finally:
                if primary:
                    self.lock.release()  # never raises: the error in flight, if any, is the one reported

    def _end_marker(self, checkpoint: int | None) -> None:
        """``ended.json``: removed with ``None`` (a call starts), else written with the last checkpoint of
        a call that ended normally (not when it failed or was preempted)."""
        path = self.path(ENDED)
        if checkpoint is None:
            if storage.exists(path):
                self.lock.prove()  # nothing is written after a takeover
                storage.remove(path)
            return
        self.lock.prove()
        storage.write_bytes(path, json.dumps({"checkpoint": checkpoint}).encode())

    def ended(self) -> dict | None:
        """``{"checkpoint": N}`` once the last training call ended normally with checkpoint N (``None``
        if none was saved); ``None`` while training runs, or before it started."""
        path = self.path(ENDED)
        storage.forget_listings(path)
        try:
            return _record(storage.read_bytes(path).decode()) or None
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def recording(self, what: str):
        """Yields whether this process may write a record here now: not while another process holds
        the lock (a run in training keeps its files to itself), nor when it is not writable; either
        is said. Holds the lock meanwhile unless this process holds it already."""
        if jax.process_index() != 0:
            yield False
            return
        if self.lock.held:
            yield True
            return
        try:
            self.lock.acquire()
        except (ModelDirLockedError, ModelDirNotWritableError, StorageError) as error:
            logger.warning("%s is not written to %s: %s", what, self.url, error)
            yield False
            return
        try:
            yield True
        finally:
            self.lock.release()


class NoCheckpoints:
    """The checkpoints of ``NoRunDir``: none, and saving keeps nothing."""

    directory = None
    saves = False

    def latest_step(self) -> None:
        return None

    def committed_step(self) -> None:
        return None

    def steps(self) -> list[int]:
        return []

    def due(self, step_before: int, step_after: int) -> bool:
        return False

    def clock_decides(self, step_before: int, step_after: int) -> bool:
        return False

    def restore(self, abstract_state, step: int | None = None):
        raise ConfigError(
            f"checkpoint={step} is a step, but RunConfig(model_dir=None) has no checkpoints; expected a "
            "checkpoint path, or a RunConfig(model_dir=...) that holds that step."
        )

    def refresh(self) -> None:
        pass

    def wait(self, prune: bool = False) -> None:
        pass


class NoRunDir:
    """``RunConfig(model_dir=None)``: nothing is kept, so there is nothing to lock or write."""

    url = None
    profile_dir = None
    trackers_file = None
    name = "estimax"

    def __init__(self):
        self.checkpoints = NoCheckpoints()

    def __repr__(self) -> str:
        return "NoRunDir()"

    def no_checkpoint(self) -> str:
        return "RunConfig(model_dir=None) has no checkpoint to restore"

    def best(self, metric: str, direction: str) -> None:
        return None

    def file_writers(self, tensorboard: bool, continuing_from: int | None = None) -> list:
        return []

    def records(self, split: str) -> list[dict]:
        return []

    def fence(self) -> None:
        pass  # no lock to lose

    @contextlib.contextmanager
    def writing(self, sync, best=None):
        yield

    @contextlib.contextmanager
    def recording(self, what: str):
        yield True  # nothing to lock: trackers may still record


_VARIABLE = re.compile(r"\$(?:(\w+)|\{(\w+)\})")  # $NAME or ${NAME}, as os.path.expandvars reads them


def check_variables_set(model_dir) -> None:
    """Refuses a model_dir that names an environment variable that is not set (``$RUNS/x`` would
    otherwise be a folder literally named ``$RUNS``); set ones are expanded (``storage.expand``)."""
    names = {match[1] or match[2] for match in _VARIABLE.finditer(os.fspath(model_dir))}
    unset = sorted(name for name in names if name not in os.environ)
    if unset:
        raise ConfigError(
            f"RunConfig(model_dir={os.fspath(model_dir)!r}) refers to {', '.join('$' + n for n in unset)}, not set "
            f"in this environment; expected a path whose variables are all set. Fix: export {unset[0]}=..., or "
            "write the path out."
        )


def check_not_below_file(url: str) -> None:
    """Refuses a local model_dir that is a file, or lies below one: it can never hold a run."""
    if storage.is_url(url):
        return
    path = url
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        where = "is" if path == url else f"lies below {path}, which is"
        raise ConfigError(
            f"RunConfig(model_dir={url!r}) {where} a file; expected a directory (new or existing) where "
            "checkpoints and metrics can be written. Fix: choose a path that is not a file and not below one."
        )


def check_supported(url: str) -> None:
    """Refuses, before anything is written, a model_dir whose store cannot hold checkpoints."""
    kind = storage.scheme(url)
    if kind in ("", "file", "gs", "s3"):
        return
    raise StorageError(
        f"model_dir {url}: {kind}:// cannot hold checkpoints (Orbax writes through tensorstore: local paths, "
        "gs:// and s3://). Expected one of them. Fix: use one of them; RunConfig(model_dir=None) keeps nothing."
    )


def _record(line: str) -> dict:
    """A record of ``metrics.jsonl``, else ``{}`` (a line cut short, or not a record)."""
    try:
        record = json.loads(line)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}
