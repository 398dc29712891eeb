"""The adapter protocol, and how the model a user passes becomes an adapter.

An adapter turns one user model (a Flax NNX factory, a Linen module, a Keras
3 model, a pair of plain functions) into the pieces the pure compiled core
needs. Owns the protocol and ``resolve``; each kind of model lives in its own
module. Does not own training: that is ``step.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from estimax.spec import Mode

Params = Any  # a pytree of trained arrays
ModelState = Any  # a pytree of non-trained arrays carried from step to step (batch statistics, ...)


class Adapter(Protocol):
    """What the core asks of a model.

    ``params`` are differentiated and updated by the optimizer; ``model_state``
    is carried from one step to the next unchanged by the optimizer. Both are
    pytrees of arrays; nothing else crosses into compiled code.
    """

    def init(self) -> tuple[Params, ModelState]:
        """``(params, model_state)`` of a fresh model (traceable: runs inside ``jit``)."""

    def bind(self, params: Params, model_state: ModelState, mode: Mode, key) -> Any:
        """The callable handed to ``model_fn`` as ``model``, over these arrays (traceable).

        ``mode`` selects train or eval behaviour (dropout, batch statistics);
        ``key`` is the step's key, the only source of randomness; ``None`` in
        PREDICT, where nothing may be random (an exported program has no key).
        """

    def model_state(self, model: Any) -> ModelState:
        """The model state after ``model_fn`` called ``model`` (updated batch statistics)."""

    def live(self, params: Params, model_state: ModelState) -> Any:
        """The model in its own framework's form, in eval behaviour, for interactive use."""


@dataclasses.dataclass(frozen=True)
class WrappedModel:
    """A user model wrapped by ``ex.models.*``; ``build(hparams, seed)`` makes its adapter.

    Building is deferred to the Estimator, which knows the hyper-parameters
    and the seed.
    """

    kind: str
    build: Callable[[dict, int], Adapter]


def resolve(model: Any, hparams: dict, seed: int) -> Adapter:
    """The adapter for what was passed as ``Estimator(model=...)``.

    A model wrapped by ``ex.models.*`` is built; an object with the four
    methods of ``Adapter`` is used as is; any other callable is an NNX
    factory ``(rngs, params) -> nnx.Module``. Models of other frameworks
    passed bare raise a TypeError that names the wrapper to use.
    """
    if isinstance(model, WrappedModel):
        return model.build(hparams, seed)
    if all(callable(getattr(model, name, None)) for name in ("init", "bind", "model_state", "live")):
        return model
    _reject_bare(model)
    from estimax.models.nnx_model import NNXAdapter

    return NNXAdapter(model, hparams, seed)


def _reject_bare(model: Any) -> None:
    kind = _framework_of(model)
    fixes = {
        "Flax Linen module": "model=ex.models.linen(module, example_input)",
        "Keras model": "model=ex.models.keras(keras_model)",
        "Flax NNX module instance": "model=lambda rngs, params: MyModule(rngs=rngs)  # a factory, not an instance",
    }
    if kind in fixes:
        raise TypeError(
            f"Estimator(model=...) received a {kind} ({type(model).__name__}); expected an NNX factory "
            f"`(rngs, params) -> nnx.Module` or a model wrapped by estimax.models. Fix: {fixes[kind]}."
        )


def _framework_of(model: Any) -> str | None:
    # By the classes' modules, so that Keras is never imported here (and subclasses are caught).
    if any((cls.__module__ or "").startswith(("keras", "tf_keras")) for cls in type(model).__mro__):
        return "Keras model"
    from flax import linen, nnx

    if isinstance(model, linen.Module):
        return "Flax Linen module"
    if isinstance(model, nnx.Module):
        return "Flax NNX module instance"
    return None
