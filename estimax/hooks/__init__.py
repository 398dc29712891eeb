"""Hooks: host-side callbacks at the boundaries of training and evaluation.

A hook receives immutable records of what just happened, as host values; it
never waits on the device. "Every N steps" means a multiple of N was
*crossed* (``LoopRecord.crossed(N)``): a loop advances the step by
``steps_per_loop``, so multiples are rarely hit exactly. ``after_loop`` and
``after_eval`` may return ``True`` to stop training (early stopping does).
The built-in logging (``metric_logger.py``), progress bar (``progress.py``) and
early stopping are hooks too; ``call_writers.py`` gives a call its writers and
built-in hooks.

A stop takes effect at the loop boundary where it was asked: the state at
that step is the one saved. So that this holds, while any hook may stop from
``after_loop``, each loop's outputs are read before the next loop is
dispatched (the device waits for the host between loops); a hook whose
``after_loop`` never stops sets ``may_stop = False`` and keeps the overlap, as
the built-in logging and progress bar do. ``may_stop`` below is the one place
that reads it (``host_loop.py`` asks it of every hook of a call).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from estimax import counting
from estimax.errors import ConfigError, ModelUnavailableError
from estimax.records.summaries import Summaries

logger = logging.getLogger("estimax")


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a ``train`` call is about to do."""

    start_step: int
    target_step: int
    global_batch_size: int
    steps_per_epoch: int | None
    model_dir: str | None
    summaries: Summaries = dataclasses.field(default_factory=Summaries, repr=False, compare=False)


def no_model(step: int) -> Callable[[], Any]:
    """A record's ``model`` when the state of its step is no longer on the devices."""

    def model():
        raise ModelUnavailableError(
            f"The model of step {step} is no longer on the devices: training gave its state to the next loop. "
            "Expected model() within after_loop of a hook that may stop (the device then waits for the host), "
            "or within after_eval. Fix: leave the hook's may_stop at True, or read the model in after_eval."
        )

    return model


@dataclasses.dataclass(frozen=True)
class LoopRecord:
    """One device loop that finished: steps ``step_before`` -> ``step_after``.

    ``outputs`` holds per-step values (``loss``, metrics, ``grad_norm``, ...)
    of shape ``(num_steps,)``, and the states of mergeable metrics
    (``estimax.metrics``) whose leaves have that leading axis. ``seconds`` is the wall time since the previous
    loop finished (``None`` for the first loop, which includes compilation),
    ``input_wait_seconds`` how much of it the host waited for input,
    ``flops_per_step`` the model FLOPs of one step of the global batch.

    ``model()``: the model at ``step_after`` in its framework's form (as ``Estimator.model``: gathered
    copies, whole on every device also for a sharded state), while the hook runs; it raises
    ``ModelUnavailableError`` for a hook with ``may_stop = False``, which reads a loop after the next
    one took over its state. ``summaries``: images, histograms, text at ``step_after`` (``Summaries``).
    """

    step_before: int
    step_after: int
    outputs: Mapping[str, np.ndarray]
    seconds: float | None
    input_wait_seconds: float
    final: bool = False
    flops_per_step: float | None = None  # the compiler's count of one step (``flops.py``), if known
    model: Callable[[], Any] = dataclasses.field(default=None, repr=False, compare=False)
    summaries: Summaries = dataclasses.field(default_factory=Summaries, repr=False, compare=False)

    def __post_init__(self):
        if self.model is None:
            object.__setattr__(self, "model", no_model(self.step_after))

    @property
    def num_steps(self) -> int:
        return self.step_after - self.step_before

    def crossed(self, every: int | None) -> bool:
        """Whether this loop crossed a multiple of ``every`` steps."""
        return counting.crossed(every, self.step_before, self.step_after)


@dataclasses.dataclass(frozen=True)
class EvalRecord:
    """An evaluation of the state at ``step`` on ``split``.

    ``model()``: that state's model in its framework's form (as ``LoopRecord.model``);
    ``summaries``: images, histograms, text at ``step`` (``Summaries``), by default under ``split``'s tags.
    """

    step: int
    split: str
    metrics: Mapping[str, float]
    seconds: float
    model: Callable[[], Any] = dataclasses.field(default=None, repr=False, compare=False)
    summaries: Summaries = dataclasses.field(default_factory=Summaries, repr=False, compare=False)

    def __post_init__(self):
        if self.model is None:
            object.__setattr__(self, "model", no_model(self.step))


@dataclasses.dataclass(frozen=True)
class Summary:
    """The end of a ``train`` or ``train_and_evaluate`` call.

    ``seconds`` splits the wall time into ``compile``, ``device``,
    ``input_wait``, ``checkpoint`` and ``evaluation``.
    """

    step: int
    seconds: Mapping[str, float]
    metrics: Mapping[str, float]


class Hook:
    """Override the methods you need; each receives an immutable record.

    ``may_stop``: set ``False`` when ``after_loop`` never returns ``True``, so that training
    dispatches the next loop before this hook reads the last one (the device does not wait
    for the host). Such a hook's ``True`` still stops training, one loop later.
    """

    may_stop: bool = True

    def begin(self, run: RunInfo) -> None:
        pass

    def after_loop(self, loop: LoopRecord) -> bool | None:
        pass

    def after_eval(self, evaluation: EvalRecord) -> bool | None:
        pass

    def end(self, summary: Summary) -> None:
        pass


def may_stop(hook: Hook) -> bool:
    """Whether ``hook.after_loop`` may ask to stop: it is overridden, and ``may_stop`` is not ``False``."""
    return type(hook).after_loop is not Hook.after_loop and bool(getattr(hook, "may_stop", True))


class EarlyStopping(Hook):
    """Stops training when ``metric`` of split ``split`` has not improved for ``patience`` evaluations.

    Args:
        metric: the evaluation metric to watch.
        direction: ``"min"`` (lower is better) or ``"max"``.
        patience: how many evaluations without improvement stop training.
        min_delta: a change smaller than this is not an improvement.
        split: the evaluation split whose ``metric`` is watched (``eval_<name>`` for a named set).
        mode: ``direction``'s old name, kept for one release (a ``DeprecationWarning``).
    """

    def __init__(
        self,
        metric: str,
        direction: str = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        split: str = "eval",
        *,
        mode: str | None = None,
    ):
        if mode is not None:
            warnings.warn(
                f"EarlyStopping(mode={mode!r}) is deprecated; pass direction={mode!r}.",
                DeprecationWarning,
                stacklevel=2,
            )
            direction = mode
        if direction not in ("min", "max"):
            raise ConfigError(f"EarlyStopping(direction={direction!r}); expected 'min' or 'max'.")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"EarlyStopping(patience={patience!r}) must be an integer of at least 1.")
        self.metric, self.direction, self.patience, self.min_delta = metric, direction, patience, min_delta
        self.split = split
        self.best = math.inf if direction == "min" else -math.inf
        self.bad_evaluations = 0

    def after_eval(self, evaluation: EvalRecord) -> bool:
        if evaluation.split != self.split:
            return False
        if self.metric not in evaluation.metrics:
            raise ConfigError(
                f"EarlyStopping(metric={self.metric!r}) is not among the evaluation's metrics "
                f"{sorted(evaluation.metrics)}; expected one of them. Fix: pass one of those names."
            )
        value = evaluation.metrics[self.metric]
        if self.direction == "min":
            improved = value < self.best - self.min_delta
        else:
            improved = value > self.best + self.min_delta
        if improved:
            self.best, self.bad_evaluations = value, 0
            return False
        self.bad_evaluations += 1
        if self.bad_evaluations >= self.patience:
            logger.info(
                "Early stopping at step %d: %s has not improved on %.4g for %d evaluations.",
                evaluation.step,
                self.metric,
                self.best,
                self.patience,
            )
            return True
        return False
