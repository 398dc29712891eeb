"""What a run tells its user: train log lines, eval results and ``metrics.jsonl``.

Owns aggregating per-step outputs between log points, the console line, and
appending one JSON object per train log and per evaluation to
``<model_dir>/metrics.jsonl``. Receives host values only; never touches devices.
"""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np

logger = logging.getLogger("estimax")


class Reporter:
    def __init__(self, model_dir: str | None, log_every_steps: int, global_batch_size: int):
        self.path = None if model_dir is None else os.path.join(model_dir, "metrics.jsonl")
        self.log_every_steps = log_every_steps
        self.global_batch_size = global_batch_size
        self._sums: dict[str, float] = {}
        self._steps = 0  # steps since the last line, for the averages
        # Throughput is timed between reads of a loop's outputs, each made once the next
        # loop is dispatched. The first read (compilation) and the last one (nothing
        # dispatched after it, so it comes earlier in the loop's life) are not timed.
        self._timed_steps = 0
        self._since = self._until = None
        # input_wait_fraction: seconds the loop waited for input over the wall time of each line.
        self._wall_mark, self._wait_mark = time.perf_counter(), 0.0

    def train(
        self,
        step_before: int,
        step_after: int,
        outputs: dict[str, np.ndarray],
        final: bool = False,
        input_wait: float | None = None,
    ):
        """Adds a loop's per-step outputs (read when the loop is done); logs when a multiple
        of ``log_every_steps`` was crossed, or at the end with ``final``. ``input_wait`` is
        the total time the loop has waited for input so far."""
        now = time.perf_counter()
        for name, values in outputs.items():
            self._sums[name] = self._sums.get(name, 0.0) + float(np.sum(values, dtype=np.float64))
        self._steps += step_after - step_before
        if self._since is None:
            self._since = now
        elif not final:
            self._timed_steps, self._until = self._timed_steps + step_after - step_before, now
        crossed = step_after // self.log_every_steps > step_before // self.log_every_steps
        if not (crossed or final) or self._steps == 0:
            return
        record = {name: total / self._steps for name, total in self._sums.items()}
        if self._timed_steps:
            steps_per_sec = self._timed_steps / max(self._until - self._since, 1e-9)
            record.update(steps_per_sec=steps_per_sec, examples_per_sec=steps_per_sec * self.global_batch_size)
        if input_wait is not None:
            record["input_wait_fraction"] = (input_wait - self._wait_mark) / max(now - self._wall_mark, 1e-9)
            self._wall_mark, self._wait_mark = now, input_wait
        logger.info("step %d  %s", step_after, _format(record))
        self._write({"split": "train", "step": step_after, **record})
        self._sums, self._steps, self._timed_steps, self._since = {}, 0, 0, self._until

    def eval(self, step: int, results: dict[str, float], split: str = "eval") -> None:
        logger.info("%s at step %d  %s", split, step, _format(results))
        self._write({"split": split, "step": step, **results})

    def _write(self, record: dict) -> None:
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _format(record: dict) -> str:
    parts = []
    for name, value in record.items():
        if name == "num_examples":
            parts.append(f"{name} {int(value)}")
        elif name.endswith("_per_sec"):
            parts.append(f"{name.replace('_per_sec', '/s')} {value:.1f}")
        else:
            parts.append(f"{name} {value:.4f}")
    return "  ".join(parts)


def ensure_console() -> None:
    """Shows estimax's INFO lines on the console unless the application set up the
    ``estimax`` logger itself (absl, pulled in by Orbax, claims the root logger)."""
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s estimax  %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
