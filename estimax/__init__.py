"""estimax: one model definition trained, evaluated and predicted on every device."""

from estimax import data, models
from estimax.config import RunConfig
from estimax.estimator import Estimator
from estimax.spec import EVAL, PREDICT, TRAIN, Mode, Spec
from estimax.state import TrainState

__all__ = ["EVAL", "PREDICT", "TRAIN", "Estimator", "Mode", "RunConfig", "Spec", "TrainState", "data", "models"]
