"""RunConfig: where a run writes, how big its batches are and how it loops.

A validated, immutable dataclass. It owns settings only; nothing here touches
devices or files.
"""

from __future__ import annotations

import dataclasses
import os

from estimax.precision import check_compute_dtype

LOOP_MODES = ("auto", "scan", "step")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Settings of a run.

    Attributes:
      model_dir: directory for checkpoints and ``metrics.jsonl``; ``None`` keeps
        everything in memory (nothing is saved or restored).
      train_batch_size: global batch of one training step, over all devices.
      eval_batch_size: global batch of evaluation; defaults to the train batch.
      predict_batch_size: global batch of prediction; defaults to the eval batch.
      steps_per_loop: training steps run per host round trip (the device loop).
      loop: how the steps of one loop are run on the device: ``"scan"`` (one
        compiled ``lax.scan`` of ``steps_per_loop`` steps), ``"step"`` (one
        compiled call per step, dispatched without waiting) or ``"auto"``
        (``scan`` on accelerators; on CPU, both are timed on the first steps
        and the faster one is kept).
      seed: seeds parameter initialisation, dropout and shuffling.
      log_every_steps: a train log line is written when a multiple is crossed.
      save_every_steps: a checkpoint is written when a multiple is crossed (at
        loop boundaries) and at the end of training; ``None``: only at the end.
      keep_checkpoints: how many recent checkpoints are kept.
      num_devices: use the first N devices (default: all devices of all processes).
      compute_dtype: ``"bfloat16"`` (or ``"float16"``) runs the model in that dtype
        while parameters and optimizer state stay float32 (see ``precision.py``);
        ``None``: compute in the parameters' dtype.
    """

    model_dir: str | os.PathLike | None = None
    train_batch_size: int = 32
    eval_batch_size: int | None = None
    predict_batch_size: int | None = None
    steps_per_loop: int = 50
    loop: str = "auto"
    seed: int = 0
    log_every_steps: int = 100
    save_every_steps: int | None = 1000
    keep_checkpoints: int = 3
    num_devices: int | None = None
    compute_dtype: str | None = None

    def __post_init__(self):
        for name in ("train_batch_size", "steps_per_loop", "log_every_steps", "keep_checkpoints"):
            _check_positive(name, getattr(self, name))
        for name in ("eval_batch_size", "predict_batch_size", "save_every_steps", "num_devices"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.loop not in LOOP_MODES:
            raise ValueError(f"RunConfig(loop={self.loop!r}) is not a loop mode; expected one of {LOOP_MODES}.")
        check_compute_dtype(self.compute_dtype)
        if self.model_dir is not None:
            object.__setattr__(self, "model_dir", os.fspath(self.model_dir))

    @property
    def global_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.train_batch_size

    @property
    def global_predict_batch_size(self) -> int:
        return self.predict_batch_size or self.global_eval_batch_size


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"RunConfig({name}={value!r}) must be a positive integer.")
