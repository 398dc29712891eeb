"""estimax: one model definition trained, evaluated and predicted on every device.

The public names are imported on first use (PEP 562), so that ``import
estimax.cli`` (``estimax --help``, argument errors) does not import JAX, and
``estimax.serving`` / ``estimax serve`` load an exported model without Flax.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("data", "distributed", "metrics", "models", "serving", "task", "trackers")
_NAMES = {
    "CheckpointError": "estimax.checkpoint",
    "CheckpointPolicy": "estimax.config",
    "RunConfig": "estimax.config",
    "Estimator": "estimax.estimator",
    "UntrainedWarning": "estimax.estimator",
    "ModelFnError": "estimax.diagnose",
    "ModelDirLocked": "estimax.lock",
    "ModelDirNotWritable": "estimax.lock",
    "Interrupted": "estimax.preemption",
    "EarlyStopping": "estimax.hooks",
    "Hook": "estimax.hooks",
    "PREEMPTED_EXIT_CODE": "estimax.preemption",
    "Preempted": "estimax.preemption",
    "EVAL": "estimax.spec",
    "PREDICT": "estimax.spec",
    "TRAIN": "estimax.spec",
    "Mode": "estimax.spec",
    "Spec": "estimax.spec",
    "TrainState": "estimax.state",
    "NonFiniteError": "estimax.training",
    "WarmStart": "estimax.warm_start",
}

__all__ = sorted([*_NAMES, *_SUBMODULES])


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"estimax.{name}")
    if name not in _NAMES:
        raise AttributeError(f"module 'estimax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
