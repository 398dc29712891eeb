"""estimax: one model definition trained, evaluated and predicted on every device."""

from estimax import data, distributed, models
from estimax.checkpoint import CheckpointError
from estimax.config import CheckpointPolicy, RunConfig
from estimax.diagnose import ModelFnError
from estimax.estimator import Estimator, UntrainedWarning
from estimax.hooks import EarlyStopping, Hook
from estimax.lock import ModelDirLocked, ModelDirNotWritable
from estimax.preemption import PREEMPTED_EXIT_CODE, Interrupted, Preempted
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
    "Interrupted",
    "Mode",
    "ModelDirLocked",
    "ModelDirNotWritable",
    "ModelFnError",
    "NonFiniteError",
    "Preempted",
    "RunConfig",
    "Spec",
    "TrainState",
    "UntrainedWarning",
    "WarmStart",
    "data",
    "distributed",
    "models",
]
