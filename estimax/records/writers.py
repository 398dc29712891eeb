"""Where metrics go: ``metrics.jsonl``, TensorBoard event files and the console.

A writer takes ``(split, step, values)`` with host floats and owns one
destination; one that wants every step's points (``every_step``) also takes a
loop's per-step columns in one ``write_steps`` call. Files go to a local disk
or an object store (``gs://``, ``s3://``): a store cannot append, so there a
writer keeps what it wrote and uploads whole objects at its flush points.
Owns no aggregation (``hooks/metric_logger.py`` decides what and when) and no thread
(``writer_thread.py`` keeps the file writers off the training thread).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from estimax import eval_sets, storage
from estimax.errors import LeaseLostError
from estimax.records import events
from estimax.records.summaries import overlay_value

logger = logging.getLogger("estimax")


class Writer(Protocol):
    def write(self, split: str, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlWriter:
    """``{"split": ..., "step": ..., **values}``, one JSON object per line of ``metrics.jsonl``; the
    records of a named evaluation set (split ``eval_<name>``) also carry ``"set": name``.

    On disk every record is appended and flushed at once (the file stays open
    until ``close``). On an object store the object is rewritten whole (it cannot
    be appended to): at every evaluation and summary, at most every
    ``STORE_FLUSH_SECONDS`` for train records, and at ``close``; a new writer
    continues the object a previous run left.

    ``continuing_from``: the step a training run starts from. The records past
    it, left by a run that died after its last checkpoint, are dropped before
    this run's first record (the file or object rewritten whole, atomically),
    so that a reader sees each step once, in order, after any restart.
    """

    STORE_FLUSH_SECONDS = 10.0

    def __init__(self, path: str, continuing_from: int | None = None, fence=lambda: None):
        self.path = path
        self.continuing_from = continuing_from
        self.fence = fence  # raises once this process may no longer write here (before every write to a store)
        self._on_store = storage.is_url(path)
        self._lines: list[str] | None = None  # on a store: what the object held, then this run's records
        self._object: VersionedObject | None = None  # on a store
        self._file = None  # on disk: open for appending from the first record to ``close``
        self._unflushed = False
        self._flushed = time.monotonic()

    def _open(self) -> str:
        """What the file holds, less the records past ``continuing_from``; on disk, with nothing to
        drop, nothing is read (records are appended)."""
        if self._on_store:
            self._object = self._object or VersionedObject(self.path)
            text = self._object.read().decode()
        elif self.continuing_from is None or not storage.exists(self.path):
            return ""
        else:
            text = storage.read_bytes(self.path).decode()
        if self.continuing_from is not None:
            kept = records_up_to(text, self.continuing_from)
            if kept != text:
                self._write_whole(kept.encode())
                text = kept
        return text

    def _write_whole(self, data: bytes) -> None:
        """The whole file: on a store only over the version this writer read or wrote last (``VersionedObject``)."""
        self.fence()
        if self._on_store:
            self._object.write(data)
        else:
            storage.write_bytes(self.path, data)

    def write(self, split: str, step: int, values: Mapping[str, float]) -> None:
        if self._lines is None:
            held = self._open()
            self._lines = [held] if self._on_store else []
        named = {"set": name} if (name := eval_sets.set_of(split)) is not None else {}
        line = json.dumps({"split": split, **named, "step": step, **values}) + "\n"
        if not self._on_store:
            if self._file is None:
                storage.makedirs(storage.parent(self.path))
                self._file = open(self.path, "a")  # noqa: SIM115 - kept open: a record is ~10x cheaper
            self._file.write(line)
            self._file.flush()
            return
        self._lines.append(line)
        self._unflushed = True
        if split != "train" or time.monotonic() - self._flushed > self.STORE_FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if self._unflushed:
            self._write_whole("".join(self._lines or []).encode())
            self._unflushed, self._flushed = False, time.monotonic()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file, file = None, self._file
            file.close()


class VersionedObject:
    """An object on a store written whole, each time only over the version this process read or wrote last
    (a conditional write): a process that was paused between its lock's proof and its upload, and whose
    model_dir another process took over and wrote meanwhile, cannot overwrite what that process wrote."""

    def __init__(self, path: str):
        from estimax.storage.conditional import open_object

        self.path = path
        self._object = open_object(path)
        self._version: str | None = None  # None: absent when read last

    def read(self) -> bytes:
        found = storage.bounded("reading", self.path, self._object.read, storage.deadline_seconds())
        self._version = found and found[1]
        return found[0] if found else b""

    def write(self, data: bytes) -> None:
        from estimax.storage.conditional import Changed

        timeout = storage.deadline_seconds()
        try:
            if self._version is None:
                version = storage.bounded("writing", self.path, self._object.create, data, timeout)
                if version is None:
                    raise Changed
            else:
                version = storage.bounded("writing", self.path, self._object.replace, data, self._version, timeout)
        except Changed:
            found = self._object.read(timeout)
            if not found or found[0] != data:  # (a retry after a write that landed finds its own bytes)
                raise LeaseLostError(
                    f"{self.path} was written by another process since this one last wrote it: another process "
                    "writes into this model_dir now, and this one stops writing. Expected one writer per "
                    "model_dir. Fix: none if a later attempt of this run carries it on; otherwise stop the other "
                    "process and run the same command again."
                ) from None
            version = found[1]
        self._version = version


_STEP_FIELD = re.compile(r'"step": (\d+)')  # as json.dumps writes a record's step


def records_up_to(text: str, step: int) -> str:
    """The lines of ``metrics.jsonl`` text a run continuing from ``step`` keeps: all but the records
    past ``step`` and a last line cut short (no newline: its writer was killed mid-line)."""
    # Every call of a run reads the file: it is parsed only when something may be dropped (every
    # record's step, and anything else that reads like one, is at most ``step``).
    if not text or (text.endswith("\n") and max(map(int, _STEP_FIELD.findall(text)), default=0) <= step):
        return text
    kept = []
    for line in text.splitlines(keepends=True):
        try:
            record_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            record_step = None  # not a record of ours: kept as it is
        if line.endswith("\n") and not (isinstance(record_step, int) and record_step > step):
            kept.append(line)
    return "".join(kept)


class TensorBoardWriter:
    """Scalars of every split in one TensorBoard run, the event files directly in ``logdir``: tags
    ``train/loss``, ``eval/accuracy``, ``eval_<set>/...`` (``events.tag``), which TensorBoard groups
    by split; the hparams and the summaries of a hook go into the same run, and a CUSTOM SCALARS
    layout that overlays each evaluated metric's splits on one chart (``summaries.overlay_value``).

    ``every_step``: the training report sends every step's scalar outputs in one
    ``write_steps`` call per loop, not one window mean per log line. Events are
    encoded directly (``events.py``) and buffered: on disk appended to this
    writer's own file every ``FLUSH_SECONDS``, on an object store uploaded as a
    new event file every ``STORE_FLUSH_SECONDS``; evaluations and summaries are
    flushed at once. Several writers may write the run at once (training and a
    follower, ``follow.py``), each into files of its own: TensorBoard reads the
    files of a run in name order, which is the order they were started, so on
    disk a writer whose file another one's newer file follows starts a new file
    before it appends (its events read after that one's start event).

    ``continuing_from``: the step a training run starts from. Its first event
    is a ``SessionLog.START`` at the next step, with which TensorBoard drops the
    events a run that died after its last checkpoint left past it; the files
    themselves are not rewritten.
    """

    every_step = True
    FLUSH_SECONDS = 2.0
    STORE_FLUSH_SECONDS = 10.0

    def __init__(self, logdir: str, continuing_from: int | None = None, fence=lambda: None):
        self.logdir = logdir
        self.fence = fence  # raises once this process may no longer write here (before every upload)
        self._on_store = storage.is_url(logdir)
        self._encoder = events.ScalarEncoder()
        # In order: encoded events, and loops' columns (``_Steps``) encoded at the flush.
        self._pending: list[bytes | _Steps] = []
        self._runs: dict[str, _Steps] = {}  # per split, the pending columns the next loop may continue
        self._file: str | None = None  # on disk: the event file this writer appends to
        self._flushed = time.monotonic()
        self._start = None if continuing_from is None else events.session_start(continuing_from + 1)
        self._overlaid: set[str] = set()  # the metrics the CUSTOM SCALARS layout written last has charts of

    def write(self, split: str, step: int, values: Mapping[str, float]) -> None:
        tagged = {events.tag(split, name): value for name, value in values.items()}
        self._pending.append(self._encoder.event(step, tagged, time.time()))
        if split == "eval" or eval_sets.set_of(split) is not None:
            self._overlay(values.keys())
        self._flush_if_due(split)

    def _overlay(self, metrics) -> None:
        """The CUSTOM SCALARS tab's charts, one per metric evaluated, of it in every split; written again
        (at step 0, where TensorBoard keeps the latest) when an evaluation brings a metric it lacked."""
        new = set(metrics) - self._overlaid - {"num_examples"}
        if new:
            self._overlaid |= new
            self._pending.append(events.summary_event(0, overlay_value(self._overlaid)))

    def write_summary(self, split: str, step: int, values: bytes) -> None:
        """Encoded ``Summary.Value`` messages (images, histograms, text: ``summaries.py``, which names
        their tags) at ``step``."""
        self._pending.append(events.summary_event(step, values))
        self._flush_if_due(split)

    def write_steps(
        self, split: str, first_step: int, columns: Mapping[str, np.ndarray], sampled: Sequence[str] = ()
    ) -> None:
        """One point per step from ``first_step``; a ``sampled`` column has no point where it is NaN.
        Kept as columns until the flush, where the consecutive loops since are encoded in one go
        (most of the cost of encoding a 50-step loop is numpy's per-call overhead, not its points):
        the points written in between (log lines' throughput, merged metrics) come after them. Each
        tag's points stay in step order, and TensorBoard reads each tag as a series of its own."""
        columns = {events.tag(split, name): column for name, column in columns.items()}
        sampled = [events.tag(split, name) for name in sampled]
        run = self._runs.get(split)
        if run is None or not run.extend(first_step, columns, sampled):
            run = self._runs[split] = _Steps(first_step, tuple(sampled))
            run.extend(first_step, columns, sampled)
            self._pending.append(run)
        self._flush_if_due(split)

    def _flush_if_due(self, split: str) -> None:
        every = self.STORE_FLUSH_SECONDS if self._on_store else self.FLUSH_SECONDS
        if split != "train" or time.monotonic() - self._flushed > every:
            self.flush()

    def flush(self) -> None:
        if self._start is not None:  # the first event of this writer's first file
            self._pending.insert(0, self._start)
            self._start = None
        if self._pending:
            data = b"".join(r if isinstance(r, bytes) else r.encode(self._encoder) for r in self._pending)
            if self._on_store:
                self.fence()
                storage.write_bytes(storage.join(self.logdir, events.file_name()), events.file_version() + data)
            else:
                if self._file is None or self._followed(self._file):
                    storage.makedirs(self.logdir)
                    self._file = storage.join(self.logdir, events.file_name())
                    data = events.file_version() + data
                with open(self._file, "ab") as f:
                    f.write(data)
            self._pending.clear()
        self._runs.clear()
        self._flushed = time.monotonic()

    def _followed(self, path: str) -> bool:
        """Whether another writer's event file in the run sorts after ``path`` (started later)."""
        name = storage.name(path)
        return any(other > name for other in storage.listdir(self.logdir) if other.startswith(events.FILE_PREFIX))

    def close(self) -> None:
        self.flush()


@dataclasses.dataclass
class _Steps:
    """The per-step columns of consecutive loops with the same tags, from ``first_step`` to ``end``,
    with the wall time each loop reached the writer (its steps' points carry it, not the flush's)."""

    first_step: int
    sampled: tuple[str, ...]
    end: int = dataclasses.field(init=False)
    columns: list[Mapping[str, np.ndarray]] = dataclasses.field(default_factory=list)
    times: list[float] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.end = self.first_step

    def extend(self, first_step: int, columns: Mapping[str, np.ndarray], sampled: Sequence[str]) -> bool:
        """Takes the next loop's columns if they continue these (or are the first); whether it did."""
        same_tags = not self.columns or columns.keys() == self.columns[0].keys()
        if first_step != self.end or not same_tags or tuple(sampled) != self.sampled:
            return False
        self.columns.append(columns)
        self.times.append(time.time())
        self.end += _length(columns)
        return True

    def encode(self, encoder: events.ScalarEncoder) -> bytes:
        joined = {tag: np.concatenate([c[tag] for c in self.columns]) for tag in self.columns[0]}
        times = np.repeat(self.times, [_length(c) for c in self.columns])
        return encoder.steps(self.first_step, joined, self.sampled, times)


def _length(columns: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(columns.values()), ()))


class ConsoleWriter:
    """One log line per write: ``train step 200  loss 0.0156  steps/s 30.1 ...`` (not for the summary).

    ``train_lines=False`` leaves train lines out (a progress bar shows them, or quiet).
    """

    def __init__(self, train_lines: bool = True):
        self.train_lines = train_lines

    def write(self, split: str, step: int, values: Mapping[str, float]) -> None:
        if split in ("summary", "resize"):  # the training loop logs its own lines for these
            return
        if (split != "train" or self.train_lines) and logger.isEnabledFor(logging.INFO):  # formatted only if shown
            logger.info("%s step %d  %s", split, step, format_values(values))

    def close(self) -> None:
        pass


def ensure_console() -> None:
    """Shows estimax's INFO lines on the console unless the application set up the
    ``estimax`` logger itself (absl, pulled in by Orbax, claims the root logger)."""
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s estimax  %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:  # distributed.initialize quiets processes other than 0
        logger.setLevel(logging.INFO)
    logger.propagate = False


def format_values(values: Mapping[str, float]) -> str:
    parts = []
    for name, value in values.items():
        if name == "num_examples":
            parts.append(f"{name} {int(value)}")
        elif name.endswith("_per_sec"):
            parts.append(f"{name.replace('_per_sec', '/s')} {value:.1f}")
        elif name.endswith("_fraction"):
            parts.append(f"{name.replace('_fraction', '')} {value:.0%}")
        else:
            parts.append(f"{name} {value:.4g}")
    return "  ".join(parts)
