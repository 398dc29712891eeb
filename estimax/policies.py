"""CheckpointPolicy, Best and Epochs: when a run saves and which checkpoints it keeps, which
evaluation is the best, and a cadence in epochs (with the arguments of ``train_and_evaluate`` that
named the best and the cadence before).

Validated, immutable dataclasses that ``RunConfig`` (``config.py``) and the verbs take. They own
these settings and the check of each; the checks of one value are ``checks/values.py``'s. Nothing
here touches devices or files, and nothing imports JAX. When a save is due is
``run/save_schedule.py``'s, which checkpoints are deleted ``run/pruning.py``'s, the best
checkpoint's files ``run/run_dir.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import warnings
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from estimax import eval_sets
from estimax.checks import values
from estimax.errors import ConfigError, ConfigTypeError

DIRECTIONS = ("max", "min")
# Metric names whose better direction goes without saying (as in Keras' "auto" mode, stricter).
_LOWER_IS_BETTER = ("loss", "error", "mse", "mae", "perplexity")
_HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall", "f1", "r2")

P = ParamSpec("P")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """When training saves checkpoints and which ones are kept.

    Saves happen at loop boundaries: when a multiple of ``every_steps`` was
    crossed, when ``every_seconds`` have passed since the last save, at the end
    of training and on preemption (SIGTERM/SIGINT).

    Attributes:
      every_steps: save when a multiple is crossed; ``None``: not by steps.
      every_seconds: save when this long has passed since the last save.
      keep: how many of the most recent checkpoints are kept.
      keep_every_hours: also keep one checkpoint per this many hours, forever.
      async_save: write in the background; training waits only while the
        state is copied off the devices.
      at_end: save when a ``train`` call ends, and return once that save is
        committed. ``False``: a call ends without it (a preemption still
        saves), for many short calls in one process, each of which would
        pay the save (0.05-0.2 s for a small state): what it trained since
        the last save lives only in memory until the next save.
      max_overhead: the largest fraction of training time saves due by
        ``every_steps`` may take: such a save is put off (with one log line)
        while the last save, from its start to its commit, took more than this
        fraction of the time since it started (``save_schedule.py``). ``None``:
        every multiple is saved. ``RunConfig``'s default policy has ``0.02``.
    """

    every_steps: int | None = 1000
    every_seconds: float | None = None
    keep: int = 3
    keep_every_hours: float | None = None
    async_save: bool = True
    max_overhead: float | None = None
    at_end: bool = True

    def __post_init__(self):
        values.set_checked(self, "keep", values.positive("CheckpointPolicy", "keep", self.keep))
        if self.every_steps is not None:
            values.set_checked(
                self, "every_steps", values.positive("CheckpointPolicy", "every_steps", self.every_steps)
            )
        for name in ("every_seconds", "keep_every_hours"):
            if getattr(self, name) is not None:
                values.set_checked(self, name, values.number("CheckpointPolicy", name, getattr(self, name)))
        for name in ("async_save", "at_end"):
            values.set_checked(self, name, values.flag("CheckpointPolicy", name, getattr(self, name)))
        if self.max_overhead is not None and not (
            values.number("CheckpointPolicy", "max_overhead", self.max_overhead) < 1
        ):
            raise ConfigError(
                f"CheckpointPolicy(max_overhead={self.max_overhead!r}) is not a fraction of the training time; "
                "expected a number between 0 and 1, e.g. 0.02, or None. Fix: max_overhead=0.02 (saves take at most "
                "2% of the time), or None (every multiple of every_steps is saved)."
            )


DEFAULT_CHECKPOINT_POLICY = CheckpointPolicy(max_overhead=0.02)
"""``RunConfig``'s policy when none is given: a save every 1,000 steps, put off while saves would
take more than 2% of the time (a model that runs 1,000 steps in a fraction of a second)."""


@dataclasses.dataclass(frozen=True)
class Best:
    """Which evaluation of ``train_and_evaluate`` is the best, whether its checkpoint is
    kept, and when training gives up on improving.

    Attributes:
      metric: the evaluation metric that decides: ``"loss"`` or a name of
        ``Spec(metrics=...)``.
      direction: ``"max"`` or ``"min"``: whether a higher or a lower value is
        better. ``None``: ``"min"`` for names with loss, error, mse, mae or
        perplexity in them, ``"max"`` for acc(uracy), auc, precision, recall, f1
        or r2; any other name must say.
      keep_checkpoint: keep the best state in ``<model_dir>/best`` (one checkpoint).
      patience: stop training when the metric has not improved for this many
        evaluations; ``None``: never stop early.
      min_delta: a change smaller than this is not an improvement (for ``patience``).
      set: the evaluation set whose ``metric`` decides, where ``eval_input`` is a mapping of
        named sets (keyword only); ``None``: the only set (several sets must name one).

    ``mode=`` still works for one release (a ``DeprecationWarning``): it is ``direction=``.
    """

    metric: str = "loss"
    direction: str | None = None
    keep_checkpoint: bool = True
    patience: int | None = None
    min_delta: float = 0.0
    _: dataclasses.KW_ONLY
    set: str | None = None
    mode: dataclasses.InitVar[str | None] = None  # the name of ``direction`` in train_and_evaluate(mode=...)

    def __post_init__(self, mode: str | None):
        if mode is not None:
            if self.direction is not None:
                raise ConfigError(
                    f"Best(direction={self.direction!r}, mode={mode!r}); expected one of them. Fix: keep direction=."
                )
            warnings.warn(
                f"Best(mode={mode!r}) is deprecated; pass Best(direction={mode!r}).", DeprecationWarning, stacklevel=3
            )
            object.__setattr__(self, "direction", mode)
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"Best(metric={self.metric!r}); expected the name of an evaluation metric.")
        if self.direction is None:
            object.__setattr__(self, "direction", _direction_of(self.metric))
        if self.direction not in DIRECTIONS:
            raise ConfigError(f"Best(direction={self.direction!r}); expected 'max' or 'min'.")
        if self.patience is not None:
            values.positive("Best", "patience", self.patience)
        if self.set is not None:
            eval_sets.check_name(self.set, "Best(set=...)")


def _direction_of(metric: str) -> str:
    name = metric.lower()
    if any(word in name for word in _LOWER_IS_BETTER):
        return "min"
    if any(word in name for word in _HIGHER_IS_BETTER):
        return "max"
    raise ConfigError(
        f"Best(metric={metric!r}) does not say whether higher or lower is better; expected "
        f"direction='max' or 'min'. Fix: Best({metric!r}, direction='max') (or 'min')."
    )


@dataclasses.dataclass(frozen=True)
class Epochs:
    """A cadence in epochs of the training input where ``train_and_evaluate(eval_every=...)`` takes
    steps: ``eval_every=Epochs(1)`` evaluates after every epoch (the input must be of known size).

    Attributes:
      count: how many epochs between two evaluations.
    """

    count: int = 1

    def __post_init__(self):
        values.set_checked(self, "count", values.positive("Epochs", "count", self.count))


def checked_cadence(eval_every) -> int | Epochs:
    """``train_and_evaluate``'s ``eval_every``: a positive number of steps, or an ``Epochs``."""
    if isinstance(eval_every, Epochs):
        return eval_every
    if eval_every is None:
        raise ConfigError(
            "train_and_evaluate() needs eval_every: how often to evaluate, in steps or in epochs; received "
            "none. Fix: eval_every=500 (steps) or eval_every=ex.Epochs(1) (after every epoch)."
        )
    if isinstance(eval_every, bool) or not isinstance(eval_every, numbers.Integral):
        raise ConfigTypeError(
            f"train_and_evaluate(eval_every={eval_every!r}) is of type {type(eval_every).__name__}; expected "
            "a number of steps or ex.Epochs(n). Fix: eval_every=500 or eval_every=ex.Epochs(1)."
        )
    return values.positive("train_and_evaluate", "eval_every", eval_every)


_OLD_BEST = ("best_metric", "mode", "patience")
_OLD_CADENCE = ("eval_every_steps", "eval_every_epochs")


def takes_old_arguments(method: Callable[P, R]) -> Callable[P, R]:
    """``train_and_evaluate`` that also takes the keywords which named its best before ``best=``
    (``best_metric=``, ``mode=``, ``patience=``) and its cadence before ``eval_every=``
    (``eval_every_steps=``, ``eval_every_epochs=``): one release, a ``DeprecationWarning``; a keyword it
    has never taken is refused."""
    own = set(inspect.signature(method).parameters)

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        old = {name: kwargs.pop(name) for name in list(kwargs) if name not in own}
        unknown = sorted(set(old) - {*_OLD_BEST, *_OLD_CADENCE})
        if unknown:
            raise ConfigTypeError(f"train_and_evaluate() got unexpected keyword arguments {unknown}.")
        cadence = {name: old.pop(name) for name in _OLD_CADENCE if name in old}
        if cadence:
            kwargs["eval_every"] = _eval_every_from(kwargs.pop("eval_every", None), cadence)
        if old:
            kwargs["best"] = _best_from(kwargs.pop("best", None), old)  # type: ignore[arg-type]
        return method(*args, **kwargs)

    return call


def _eval_every_from(eval_every, deprecated: dict):
    """``eval_every``, or what ``eval_every_steps=``/``eval_every_epochs=`` meant."""
    given = {name: value for name, value in {"eval_every": eval_every, **deprecated}.items() if value is not None}
    if given.keys() <= {"eval_every"}:
        return eval_every
    if len(given) > 1:
        raise ConfigError(
            f"train_and_evaluate() received {given}; expected one cadence. "
            "Fix: eval_every=<steps> or eval_every=ex.Epochs(<epochs>)."
        )
    ((name, value),) = given.items()
    replacement = value if name == "eval_every_steps" else Epochs(value)
    _deprecated(f"{name}={value!r}", f"eval_every={replacement!r}")
    return replacement


def _best_from(best: Best | None, deprecated: dict) -> Best | None:
    """``best``, or the ``Best`` that ``best_metric=``/``mode=``/``patience=`` meant."""
    if best is not None:
        raise ConfigError(
            f"train_and_evaluate() received best= and {sorted(deprecated)}; expected one of them. "
            "Fix: put everything in best=ex.Best(...)."
        )
    metric, mode, patience = deprecated.get("best_metric"), deprecated.get("mode", "max"), deprecated.get("patience")
    replacement = (
        Best(metric, mode, patience=patience)
        if metric is not None
        else Best("loss", "min", keep_checkpoint=False, patience=patience)
    )
    _deprecated(", ".join(f"{k}={v!r}" for k, v in deprecated.items()), f"best={replacement!r}")
    return replacement if (metric is not None or patience is not None) else None


def _deprecated(old: str, new: str) -> None:
    # stacklevel: this function, the one converting, takes_old_arguments, the one-thread wrapper, the caller
    warnings.warn(f"train_and_evaluate({old}) is deprecated; pass {new}.", DeprecationWarning, stacklevel=5)
