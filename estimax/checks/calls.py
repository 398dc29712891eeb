"""What an Estimator call checks on entry: one thread at a time, and a checkpoint
asked for by step that exists.

Owns those checks and their messages. Does not own what the calls do (the
Estimator, ``train_call.py``, ``evaluator.py``), batch sizes (``data/plan.py``)
nor the checks of a model's outputs before the first step (``validation.py``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from estimax.errors import CheckpointError, ConfigError

P = ParamSpec("P")
R = TypeVar("R")


def one_thread_at_a_time(method: Callable[P, R]) -> Callable[P, R]:
    """An Estimator method that refuses to run while another thread is inside one: the
    Estimator's state moves (its arrays are donated to each training step) and its
    model_dir has one writer. A call inside a call of the same thread is allowed."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        guard = args[0].__dict__.setdefault("_call_guard", _CallGuard())  # dict.setdefault: atomic
        with guard.entered(method.__name__):
            return method(*args, **kwargs)

    return call


class _CallGuard:
    def __init__(self):
        self.lock, self.inside = threading.RLock(), None  # the outermost method running

    @contextlib.contextmanager
    def entered(self, name: str):
        if not self.lock.acquire(blocking=False):
            raise ConfigError(
                f"Estimator.{name}() was called from thread {threading.current_thread().name!r} while "
                f"Estimator.{self.inside or 'another method'}() runs in another thread; expected one call at a "
                "time (training moves the Estimator's state). Fix: give each thread its own Estimator, or hold "
                "a threading.Lock around the calls."
            )
        outer = self.inside
        self.inside = outer or name
        try:
            yield
        finally:
            self.inside = outer
            self.lock.release()


def check_step(checkpointer, step, what: str) -> None:
    """A checkpoint asked for by its step exists; otherwise the error lists those that do."""
    if not isinstance(step, int) or isinstance(step, bool):
        return
    steps = checkpointer.steps()
    if step not in steps:
        raise CheckpointError(
            f"Estimator.{what}(checkpoint={step}): model_dir has no checkpoint of step {step}; "
            f"it has steps {steps or 'none'}. Fix: pass one of those steps, a checkpoint path, or "
            "checkpoint=None for the current state."
        )
