"""Where metrics go: ``metrics.jsonl``, TensorBoard event files and the console.

A writer takes ``(split, step, values)`` with host floats and owns one
destination. Owns no aggregation (``report.py`` decides what and when).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Protocol

logger = logging.getLogger("estimax")


class Writer(Protocol):
    def write(self, split: str, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlWriter:
    """Appends ``{"split": ..., "step": ..., **values}`` to a file, one JSON object per line."""

    def __init__(self, path: str):
        self.path = path

    def write(self, split: str, step: int, values: Mapping[str, float]) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"split": split, "step": step, **values}) + "\n")

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """Scalars in ``<logdir>/<split>/`` event files (tensorboardX), one run per split,
    so that train and eval curves of the same name overlay in TensorBoard.

    ``every_step``: the training report sends it every step's scalar outputs
    (they are on the host already), not one window mean per log line.
    """

    every_step = True
    FLUSH_SECONDS = 2.0  # every step is written: flush on a clock, not per write

    def __init__(self, logdir: str):
        try:
            from tensorboardX import FileWriter
            from tensorboardX.proto.summary_pb2 import Summary
        except ImportError:
            raise ImportError(
                "TensorBoard logging needs tensorboardX, which is not installed. "
                "Fix: pip install 'estimax[tensorboard]', or RunConfig(tensorboard=False)."
            ) from None
        self._file_writer, self._summary = FileWriter, Summary
        self.logdir = logdir
        self._writers: dict = {}
        self._flushed = 0.0

    def write(self, split: str, step: int, values: Mapping[str, float]) -> None:
        if split not in self._writers:
            self._writers[split] = self._file_writer(os.path.join(self.logdir, split), flush_secs=10)
        writer = self._writers[split]
        # One event per step with every value: a fraction of the cost of an event per scalar.
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        writer.add_summary(summary, step)
        if split != "train" or time.monotonic() - self._flushed > self.FLUSH_SECONDS:
            writer.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


class ConsoleWriter:
    """One log line per write: ``train step 200  loss 0.0156  steps/s 30.1 ...`` (not for the summary).

    ``train_lines=False`` leaves train lines out (a progress bar shows them, or quiet).
    """

    def __init__(self, train_lines: bool = True):
        self.train_lines = train_lines

    def write(self, split: str, step: int, values: Mapping[str, float]) -> None:
        if split == "summary":  # the training loop logs its own "Done at step ..." line
            return
        if split != "train" or self.train_lines:
            logger.info("%s step %d  %s", split, step, format_values(values))

    def close(self) -> None:
        pass


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
