"""estimax: one model definition trained, evaluated and predicted on every device.

Names are imported on first use, so that ``estimax.serving`` and ``estimax
serve`` load an exported model with jax and numpy alone (never Flax).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module that defines it (a submodule when the name is the module itself)
_EXPORTS = {
    "EVAL": "estimax.spec",
    "PREDICT": "estimax.spec",
    "PREEMPTED_EXIT_CODE": "estimax.preemption",
    "TRAIN": "estimax.spec",
    "CheckpointError": "estimax.checkpoint",
    "CheckpointPolicy": "estimax.config",
    "EarlyStopping": "estimax.hooks",
    "Estimator": "estimax.estimator",
    "Hook": "estimax.hooks",
    "Mode": "estimax.spec",
    "NonFiniteError": "estimax.training",
    "Preempted": "estimax.preemption",
    "RunConfig": "estimax.config",
    "Spec": "estimax.spec",
    "TrainState": "estimax.state",
    "WarmStart": "estimax.warm_start",
    "data": "estimax.data",
    "distributed": "estimax.distributed",
    "models": "estimax.models",
    "serving": "estimax.serving",
}
__all__ = [
    "EVAL",
    "PREDICT",
    "PREEMPTED_EXIT_CODE",
    "TRAIN",
    "CheckpointError",
    "CheckpointPolicy",
    "EarlyStopping",
    "Estimator",
    "Hook",
    "Mode",
    "NonFiniteError",
    "Preempted",
    "RunConfig",
    "Spec",
    "TrainState",
    "WarmStart",
    "data",
    "distributed",
    "models",
    "serving",
]

if TYPE_CHECKING:
    from estimax import data, distributed, models, serving
    from estimax.checkpoint import CheckpointError
    from estimax.config import CheckpointPolicy, RunConfig
    from estimax.estimator import Estimator
    from estimax.hooks import EarlyStopping, Hook
    from estimax.preemption import PREEMPTED_EXIT_CODE, Preempted
    from estimax.spec import EVAL, PREDICT, TRAIN, Mode, Spec
    from estimax.state import TrainState
    from estimax.training import NonFiniteError
    from estimax.warm_start import WarmStart


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'estimax' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = module if module.__name__ == f"estimax.{name}" else getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
