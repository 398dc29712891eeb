"""What a run tells its user: train metrics averaged (or, for metric states,
merged) between log points, every step's scalars for writers that want them,
evaluations and the end-of-run summary, sent to the writers.

``MetricLogger`` is a hook: it receives loop records (host values) and
decides what to write and when; the writers (``records/writers.py``) own where.
"""

from __future__ import annotations

import logging

import numpy as np

from estimax import metrics as metrics_lib
from estimax.hooks import EvalRecord, Hook, LoopRecord, RunInfo, Summary
from estimax.records import flops as flops_lib
from estimax.records.writers import Writer

logger = logging.getLogger("estimax")


# Outputs measured on some steps only (``step.grad_checks``: a scan's last step and non-finite losses).
SAMPLED = ("grad_norm",)


class MetricLogger(Hook):
    """Averages per-step scalar outputs (loss, metrics, ``grad_norm``, ``learning_rate``)
    and merges per-step metric states over the steps since the last line, adds
    throughput and the input-wait fraction, and writes a ``train`` record when a
    multiple of ``log_every_steps`` is crossed (and at the end); writes every
    evaluation under its split and the summary under ``summary`` (``metrics.jsonl``, trackers; not
    TensorBoard).

    Writers with ``every_step = True`` (TensorBoard) get every step's scalar
    outputs at that step instead of their window means, and at each log point
    the window's merged metrics and throughput: an AUC point is the AUC over
    the window's examples, never a mean of per-step AUCs.

    Throughput is timed between loops: the first one (compilation) and the
    last one are not timed, so a line that covers only those has none. With
    it come the model's achieved ``tflops_per_device`` (the compiler's FLOPs
    of a step), ``mfu`` where the device's peak is known (``flops.py``), and
    ``tokens_per_sec`` where ``tokens_per_example`` is declared.
    """

    may_stop = False  # it only observes: training dispatches the next loop before it reads the last

    def __init__(
        self,
        writers: list[Writer],
        log_every_steps: int,
        global_batch_size: int,
        *,
        num_devices: int = 1,
        peak_tflops: float | None = None,
        tokens_per_example: int | None = None,
    ):
        self.writers = [w for w in writers if not getattr(w, "every_step", False)]
        self.step_writers = [w for w in writers if getattr(w, "every_step", False)]
        self.log_every_steps = log_every_steps
        self.global_batch_size = global_batch_size
        self.num_devices, self.peak_tflops, self.tokens_per_example = num_devices, peak_tflops, tokens_per_example
        self._last_step = 0  # of the last loop seen
        self._reset()

    def _reset(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._states: dict[str, metrics_lib.Metric] = {}
        self._steps = self._timed_steps = 0
        self._timed_seconds = self._wall = self._wait = 0.0
        self._flops_per_step = None

    def begin(self, run: RunInfo) -> None:
        self._reset()

    def after_loop(self, loop: LoopRecord) -> None:
        scalars = {}
        for name, values in loop.outputs.items():
            if isinstance(values, metrics_lib.Metric):  # per-step states: merged exactly, in int64/float64
                merged = metrics_lib.merge_steps(metrics_lib.to_host(values))
                self._states[name] = merged if name not in self._states else self._states[name].merge(merged)
            elif np.ndim(values) == 1:  # per-step scalars; per-parameter flags are not logged
                scalars[name] = values
                finite = np.isfinite(values)
                self._sums[name] = self._sums.get(name, 0.0) + float(np.sum(values[finite], dtype=np.float64))
                self._counts[name] = self._counts.get(name, 0) + int(finite.sum())
        for writer in self.step_writers:  # the loop's points in one call: encoded off the training thread
            writer.write_steps("train", loop.step_before + 1, scalars, SAMPLED)
        self._steps += loop.num_steps
        self._flops_per_step = loop.flops_per_step
        if loop.seconds is not None:
            self._timed_steps += loop.num_steps
            self._timed_seconds += loop.seconds
            self._wall += loop.seconds
            self._wait += loop.input_wait_seconds
        self._last_step = loop.step_after
        if (loop.crossed(self.log_every_steps) or loop.final) and self._steps:
            self._write_window(loop.step_after)

    def _write_window(self, step: int) -> None:
        """The ``train`` record of the steps since the last one, at ``step``."""
        means = {k: self._sums[k] / self._counts[k] for k in self._sums if self._counts[k]}
        window = {}
        for name, state in self._states.items():
            window.update(metrics_lib.results(name, state))
        if self._timed_steps:
            steps_per_sec = self._timed_steps / max(self._timed_seconds, 1e-9)
            window.update(steps_per_sec=steps_per_sec, examples_per_sec=steps_per_sec * self.global_batch_size)
            if self.tokens_per_example:
                window["tokens_per_sec"] = window["examples_per_sec"] * self.tokens_per_example
            if self._flops_per_step:
                window.update(
                    flops_lib.achieved(self._flops_per_step, steps_per_sec, self.num_devices, self.peak_tflops)
                )
            window["input_wait_fraction"] = min(self._wait / max(self._wall, 1e-9), 1.0)
        self._write(self.writers, "train", step, {**means, **window})
        if window:
            self._write(self.step_writers, "train", step, window)
        self._reset()

    def after_eval(self, evaluation: EvalRecord) -> None:
        self._write(self.writers + self.step_writers, evaluation.split, evaluation.step, dict(evaluation.metrics))

    def end(self, summary: Summary) -> None:
        values = {f"{name}_seconds": seconds for name, seconds in summary.seconds.items()}
        # Not in TensorBoard: a run of its own there would repeat the last evaluation as a curve of one point.
        self._write(self.writers, "summary", summary.step, {**values, **summary.metrics})
        self.close()

    def flush(self) -> None:
        """Makes every record handed to the hook so far durable (a checkpoint of the last step it saw is
        about to be saved): the steps since the last ``train`` record are written as one, so that a run
        resumed from that checkpoint leaves no gap in the history; then the run's files are written and
        flushed (on a store, uploaded), waiting for them."""
        if self._steps:
            self._write_window(self._last_step)
        for writer in self.writers + self.step_writers:
            getattr(writer, "flush", lambda: None)()

    def close(self, raise_errors: bool = True) -> None:
        """Closes every writer (once; ``end`` does): the file writers write what they hold. With
        ``raise_errors`` false (training failed: that error is the one to report) a writer's own
        failure is logged instead."""
        writers, self.writers, self.step_writers = self.writers + self.step_writers, [], []
        failures = []
        for writer in writers:
            try:
                writer.close()
            except Exception as error:  # every writer gets closed; the first failure is raised
                failures.append(error)
                if not raise_errors:
                    logger.warning("%s", error)
        if failures and raise_errors:
            raise failures[0]

    @staticmethod
    def _write(writers: list[Writer], split: str, step: int, values: dict) -> None:
        for writer in writers:
            writer.write(split, step, values)
