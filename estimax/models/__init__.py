"""How users bring their models: one adapter protocol, one wrapper per framework.

- Flax NNX: pass a factory ``(rngs, params) -> nnx.Module`` bare, or ``nnx(factory)``.
- Flax Linen: ``linen(module, example_input)``.
- Keras 3 (JAX backend): ``keras(model)``.
- Plain functions: ``functional(init, apply)``.
"""

from estimax.models.base import Adapter, WrappedModel
from estimax.models.function_model import functional_model as functional
from estimax.models.keras_model import keras_model as keras
from estimax.models.linen_model import linen_model as linen
from estimax.models.nnx_model import NNXAdapter
from estimax.models.nnx_model import nnx_model as nnx
from estimax.models.resolve import resolve

__all__ = ["Adapter", "NNXAdapter", "WrappedModel", "functional", "keras", "linen", "nnx", "resolve"]
