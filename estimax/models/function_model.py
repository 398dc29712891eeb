"""The plain-function adapter: ``init(rng) -> params`` and ``apply(params, features, rng) -> outputs``.

For models written as functions over a parameter pytree (hand-written JAX,
Haiku/Equinox-style transforms). There is no model state. ``rng`` is the
step's key in TRAIN and ``None`` in EVAL and PREDICT, which is how a function
knows to turn dropout off.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax

from estimax.errors import ConfigTypeError
from estimax.models.base import WrappedModel
from estimax.spec import TRAIN, Mode

_EXAMPLE = (
    "e.g. `ex.models.functional(init=lambda rng: {'w': jax.random.normal(rng, (6, 3))}, "
    "apply=lambda params, x, rng: x @ params['w'])`"
)


def functional_model(init: Callable | None = None, apply: Callable | None = None) -> WrappedModel:
    """A model given as ``init(rng) -> params`` and ``apply(params, features, rng) -> outputs``."""
    for name, fn, signature, args in (
        ("init", init, "init(rng) -> params", 1),
        ("apply", apply, "apply(params, features, rng) -> outputs", 3),
    ):
        if fn is None or not callable(fn):
            raise ConfigTypeError(
                f"ex.models.functional({name}={fn!r}) is not a function; expected `{signature}`, {_EXAMPLE}."
            )
        try:
            inspect.signature(fn).bind(*([None] * args))
        except TypeError:
            raise ConfigTypeError(
                f"ex.models.functional({name}=...) has signature {inspect.signature(fn)}; expected "
                f"`{signature}`: {args} positional argument{'s' if args > 1 else ''}."
            ) from None
        except ValueError:  # builtins without a signature: accept
            pass
    return WrappedModel("functional", lambda hparams, seed: FunctionAdapter(init, apply, seed))


class FunctionAdapter:
    """Adapter of an ``(init, apply)`` pair (see the module docstring)."""

    def __init__(self, init: Callable, apply: Callable, seed: int):
        self._init, self._apply, self._seed = init, apply, seed

    def init(self) -> tuple[Any, Any]:
        return self._init(jax.random.key(self._seed)), {}

    def bind(self, params, model_state, mode: Mode, key) -> FunctionModel:
        return FunctionModel(self._apply, params, key if mode == TRAIN else None)

    def model_state(self, model: FunctionModel):
        return {}

    def live(self, params, model_state) -> FunctionModel:
        return FunctionModel(self._apply, params, None)


class FunctionModel:
    """``apply`` with its parameters and key bound: ``model(features, *args, **kwargs)``.

    Each call in TRAIN gets its own key, folded from the step's key.
    """

    def __init__(self, apply: Callable, params, key):
        self.apply, self.params, self._key, self._calls = apply, params, key, 0

    def __call__(self, features, *args, **kwargs):
        key = None if self._key is None else jax.random.fold_in(self._key, self._calls)
        self._calls += 1
        return self.apply(self.params, features, key, *args, **kwargs)
