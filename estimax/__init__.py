"""estimax: one model definition trained, evaluated and predicted on every device."""

from estimax import data, distributed, metrics, models
from estimax.checkpoint import CheckpointError
from estimax.config import CheckpointPolicy, RunConfig
from estimax.estimator import Estimator
from estimax.hooks import EarlyStopping, Hook
from estimax.preemption import PREEMPTED_EXIT_CODE, Preempted
from estimax.spec import EVAL, PREDICT, TRAIN, Mode, Spec
from estimax.state import TrainState
from estimax.training import NonFiniteError
from estimax.warm_start import WarmStart

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
    "metrics",
    "models",
]
