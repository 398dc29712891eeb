"""Where a call's records go: the writers of an Estimator (console, model_dir's
files, trackers), the built-in hooks that feed them, and an evaluation's record.

Owns which writers a process gets (files and trackers on process 0 only, and
only when it may write into model_dir). Does not own how each writer writes
(``writers.py``, ``trackers.py``) nor what a train record holds (``metric_logger.py``).
"""

from __future__ import annotations

import logging
import sys

import jax

from estimax import counting, flops, trackers
from estimax.hooks import Hook
from estimax.metric_logger import MetricLogger
from estimax.progress import ProgressBar
from estimax.writers import ConsoleWriter

logger = logging.getLogger("estimax")


def writers(
    config, run_dir, params: dict, tracker_runs: dict, files: bool = True, continuing_from: int | None = None
) -> list:
    """metrics.jsonl, TensorBoard, tracker and console writers; files and trackers on process 0 only,
    and only with ``files`` (what this process may write); ``continuing_from``: training's first step."""
    found: list = [ConsoleWriter(train_lines=not config.quiet and not sys.stderr.isatty())]
    if jax.process_index() != 0 or not files:
        return found
    found += run_dir.file_writers(config.tensorboard, continuing_from)
    return found + trackers.writers(config, params, tracker_runs, run_dir)


def builtin_hooks(config, train_writers: list, num_devices: int) -> list[Hook]:
    """Metric logging (with FLOP/s and MFU over ``num_devices``), and a progress bar on a terminal."""
    logger_hook = MetricLogger(
        train_writers,
        config.log_every_steps,
        config.train_batch_size,
        num_devices=num_devices,
        peak_tflops=flops.device_peak(config.compute_dtype),
        tokens_per_example=config.tokens_per_example,
    )
    hooks: list[Hook] = [logger_hook]
    if counting.progress_bar_shows(config.quiet):
        hooks.append(ProgressBar(config.train_batch_size))
    return hooks


def record_evaluation(run_dir, make_writers, step: int, results: dict[str, float]) -> None:
    """Writes an evaluation to the console, and to model_dir's files when this process may write
    there: not while another process holds its lock (a run in training keeps its files to
    itself), nor when it is not writable; either is said, and the results are still returned."""
    with run_dir.recording(f"The evaluation of step {step}") as files:
        try:
            for writer in make_writers(files):
                writer.write("eval", step, results)
                writer.close()
        except OSError as error:
            logger.warning("The evaluation of step %d was not written to %s: %s", step, run_dir.url, error)
