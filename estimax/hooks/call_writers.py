"""Where a call's records go: the writers of an Estimator (console, model_dir's
files, trackers), the built-in hooks that feed them, and an evaluation's record.

Owns which writers a process gets (files and trackers on process 0 only, and
only when it may write into model_dir), the tracker runs an Estimator's calls
share, and which built-in hooks training gets. Does not own how each writer
writes (``records/writers.py``, ``trackers.py``) nor what a train record holds
(``metric_logger.py``).
"""

from __future__ import annotations

import logging

import jax

from estimax import counting, trackers
from estimax.hooks import Hook
from estimax.hooks.metric_logger import MetricLogger
from estimax.hooks.progress import ProgressBar
from estimax.records import flops
from estimax.records.writers import ConsoleWriter

logger = logging.getLogger("estimax")


class CallWriters:
    """The writers and built-in hooks of one Estimator's calls.

    Args:
      config: the ``RunConfig`` (``quiet``, ``tensorboard``, ``trackers``, logging settings).
      run_dir: the run's ``RunDir`` (or ``NoRunDir``), which holds the files.
      params: the model's hyper-parameters, logged to trackers.
      num_devices: the devices training runs on (FLOP/s and MFU are per device).
    """

    def __init__(self, config, run_dir, params: dict, num_devices: int):
        self.config, self.run_dir, self.params, self.num_devices = config, run_dir, params, num_devices
        self._tracker_runs: dict = {}  # tracker -> run id: one tracker run per Estimator (and model_dir)

    def writers(self, files: bool = True, continuing_from: int | None = None) -> list:
        """metrics.jsonl, TensorBoard, tracker and console writers; files and trackers on process 0 only,
        and only with ``files`` (what this process may write); ``continuing_from``: training's first step."""
        config = self.config
        found: list = [ConsoleWriter(train_lines=not config.quiet and not counting.interactive())]
        if jax.process_index() != 0 or not files:
            return found
        found += self.run_dir.file_writers(config.tensorboard, continuing_from)
        return found + trackers.writers(config, self.params, self._tracker_runs, self.run_dir)

    def hparams(self) -> dict:
        """The run's hyper-parameters for TensorBoard's HPARAMS tab: the model's ``params`` and the
        settings that change what is learned."""
        config = self.config
        chosen = {
            name: getattr(config, name) for name in ("train_batch_size", "seed", "compute_dtype", "grad_accum_steps")
        }
        return {**{name: value for name, value in chosen.items() if value is not None}, **self.params}

    def metric_logger(self, train_writers: list) -> MetricLogger:
        """The hook that writes training's records to ``train_writers`` (and closes them at its end),
        with FLOP/s and MFU over the devices."""
        config = self.config
        return MetricLogger(
            train_writers,
            config.log_every_steps,
            config.train_batch_size,
            num_devices=self.num_devices,
            peak_tflops=flops.device_peak(config.compute_dtype),
            tokens_per_example=config.tokens_per_example,
        )

    def progress_bar(self) -> list[Hook]:
        """A progress bar on a terminal (``counting.progress_bar_shows``), else nothing."""
        return [ProgressBar(self.config.train_batch_size)] if counting.progress_bar_shows(self.config.quiet) else []

    def record_evaluation(self, step: int, results: dict[str, float], split: str = "eval") -> None:
        """Writes an evaluation to the console, and to model_dir's files when this process may write
        there: not while another process holds its lock (a run in training keeps its files to
        itself), nor when it is not writable; either is said, and the results are still returned.
        ``split``: ``eval``, or ``eval_<name>`` for a named evaluation set (``eval_sets.split_of``)."""
        what = f"The evaluation of step {step}" + ("" if split == "eval" else f" ({split})")
        with self.run_dir.recording(what) as files:
            try:
                for writer in self.writers(files):
                    writer.write(split, step, results)
                    writer.close()
            except OSError as error:
                logger.warning("%s was not written to %s: %s", what, self.run_dir.url, error)
