"""Which adapter a model gets: the one ``Estimator(model=...)`` passes through ``resolve``.

Owns recognising what the user passed (a wrapped model, an adapter, an NNX
factory) and refusing, with the wrapper to use, a model of another framework
passed bare. Imports the adapters; none of them imports it.
"""

from __future__ import annotations

import inspect
from typing import Any

from estimax.errors import ConfigTypeError
from estimax.models.base import Adapter, WrappedModel
from estimax.models.nnx_model import NNXAdapter


def resolve(model: Any, hparams: dict, seed: int) -> Adapter:
    """The adapter for what was passed as ``Estimator(model=...)``.

    A model wrapped by ``ex.models.*`` is built; an object with the four
    methods of ``Adapter`` is used as is; any other callable is an NNX
    factory ``(rngs, params) -> nnx.Module``. Models of other frameworks
    passed bare raise a ``ConfigTypeError`` that names the wrapper to use; a
    module class passed instead of its factory, one that shows the factory.
    """
    if isinstance(model, WrappedModel):
        return model.build(hparams, seed)
    if all(callable(getattr(model, name, None)) for name in ("init", "bind", "model_state", "live")):
        return model
    _reject_bare(model)
    return NNXAdapter(model, hparams, seed)


def _reject_bare(model: Any) -> None:
    if isinstance(model, type):
        _reject_class(model)
    kind = _framework_of(model)
    fixes = {
        "Flax Linen module": "model=ex.models.linen(module, example_input)",
        "Keras model": "model=ex.models.keras(keras_model)",
        "Flax NNX module instance": "model=lambda rngs, params: MyModule(rngs=rngs)  # a factory, not an instance",
    }
    if kind in fixes:
        raise ConfigTypeError(
            f"Estimator(model=...) received a {kind} ({type(model).__name__}); expected an NNX factory "
            f"`(rngs, params) -> nnx.Module` or a model wrapped by estimax.models. Fix: {fixes[kind]}."
        )


def _reject_class(cls: type) -> None:
    """A module class passed where its factory (for Linen, its wrapped instance) is expected. An NNX
    class whose ``__init__`` is ``(rngs, params)`` is a factory itself, and accepted."""
    from flax import linen, nnx

    if issubclass(cls, nnx.Module) and list(inspect.signature(cls.__init__).parameters)[2:3] == ["params"]:
        return
    fixes = {
        nnx.Module: f"model=lambda rngs, params: {cls.__name__}(rngs=rngs)",
        linen.Module: f"model=ex.models.linen({cls.__name__}(), example_input)",
    }
    for base, fix in fixes.items():
        if issubclass(cls, base):
            raise ConfigTypeError(
                f"Estimator(model={cls.__name__}) received the class {cls.__name__}; expected an NNX factory "
                f"`(rngs, params) -> nnx.Module` or a model wrapped by estimax.models. Fix: {fix}."
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
