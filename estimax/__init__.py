"""estimax: one model definition trained, evaluated and predicted on every device.

The public names are imported on first use (PEP 562), so that ``import
estimax.cli`` (``estimax --help``, argument errors) does not import JAX, and
``estimax.serving`` / ``estimax serve`` load an exported model without Flax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from estimax import errors as _errors  # imports nothing heavy; its kinds are top-level names

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers read (``X as X``: re-exported); at run time, imported on first use
    from estimax import data as data
    from estimax import distributed as distributed
    from estimax import errors as errors
    from estimax import metrics as metrics
    from estimax import models as models
    from estimax import serving as serving
    from estimax import trackers as trackers
    from estimax.config import Best as Best
    from estimax.config import CheckpointPolicy as CheckpointPolicy
    from estimax.config import Epochs as Epochs
    from estimax.config import RunConfig as RunConfig
    from estimax.errors import *  # noqa: F403  # every error kind: the names of estimax.errors.__all__
    from estimax.estimator import Estimator as Estimator
    from estimax.estimator import UntrainedWarning as UntrainedWarning
    from estimax.fine_tuning import LoRA as LoRA
    from estimax.follow import FollowPolicy as FollowPolicy
    from estimax.group.peers import PEER_LOST_EXIT_CODE as PEER_LOST_EXIT_CODE
    from estimax.group.preemption import Interrupted as Interrupted
    from estimax.group.preemption import Preempted as Preempted
    from estimax.hooks import EarlyStopping as EarlyStopping
    from estimax.hooks import Hook as Hook
    from estimax.loop import Compiled as Compiled
    from estimax.run.warm_start import WarmStart as WarmStart
    from estimax.spec import EVAL as EVAL
    from estimax.spec import PREDICT as PREDICT
    from estimax.spec import TRAIN as TRAIN
    from estimax.spec import Mode as Mode
    from estimax.spec import Spec as Spec
    from estimax.state import TrainState as TrainState

_SUBMODULES = ("data", "distributed", "errors", "hooks", "metrics", "models", "serving", "trackers")
_MOVED = {"task": "estimax.cli.task"}  # old paths, kept for one release with a DeprecationWarning
_NAMES = {
    "Best": "estimax.config",
    "CheckpointPolicy": "estimax.config",
    "Epochs": "estimax.config",
    "Compiled": "estimax.loop",
    "LoRA": "estimax.fine_tuning",
    "RunConfig": "estimax.config",
    "Estimator": "estimax.estimator",
    "UntrainedWarning": "estimax.estimator",
    "FollowPolicy": "estimax.follow",
    "Interrupted": "estimax.group.preemption",
    "EarlyStopping": "estimax.hooks",
    "Hook": "estimax.hooks",
    "PEER_LOST_EXIT_CODE": "estimax.group.peers",
    "Preempted": "estimax.group.preemption",
    "EVAL": "estimax.spec",
    "PREDICT": "estimax.spec",
    "TRAIN": "estimax.spec",
    "Mode": "estimax.spec",
    "Spec": "estimax.spec",
    "TrainState": "estimax.state",
    "WarmStart": "estimax.run.warm_start",
    **dict.fromkeys(_errors.__all__, "estimax.errors"),  # every error kind, as ex.ConfigError
}

__all__ = sorted([*_NAMES, *_SUBMODULES])


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"estimax.{name}")
    if name in _MOVED:
        return importlib.import_module(f"estimax.{name}")  # the alias module warns and hands over
    if name not in _NAMES:
        raise _errors.unknown_name("estimax", name, __all__)
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
