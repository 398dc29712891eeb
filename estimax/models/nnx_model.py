"""The Flax NNX adapter: a factory ``(rngs, params) -> nnx.Module``.

Owns the boundary between a live NNX module and pytrees: the factory is
traced once for its structure, parameters and other state travel as pytrees,
and a module is rebuilt (``nnx.merge``) inside each pure function. Never a
live module inside ``jit``.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from estimax.errors import ConfigTypeError
from estimax.models.base import WrappedModel
from estimax.spec import Mode

ModelFactory = Callable[[nnx.Rngs, dict], nnx.Module]


class NNXAdapter:
    """A Flax NNX model built by ``factory(rngs, params)``.

    The module's variables are split three ways: ``nnx.Param`` (trained),
    RNG state (replaced every step from the step's key, so randomness depends
    on the step only) and everything else (``model_state``: batch statistics
    and other non-trained variables, carried from step to step).
    """

    def __init__(self, factory: ModelFactory, params: dict, seed: int):
        if not callable(factory):
            raise ConfigTypeError(
                f"Estimator(model={factory!r}) is not callable; expected a factory "
                "`(rngs, params) -> nnx.Module`, e.g. `model=lambda rngs, params: CNN(rngs=rngs)`."
            )
        _check_factory_signature(factory)
        self._factory = factory
        self._params = params
        self._seed = seed
        abstract = nnx.eval_shape(self._build)
        if not isinstance(abstract, nnx.Module):
            kind = "an array or number" if isinstance(abstract, jax.ShapeDtypeStruct) else type(abstract).__name__
            raise ConfigTypeError(
                f"Estimator(model=...) returned {kind}; expected a Flax nnx.Module from `model(rngs, params)`."
            )
        abstract.train()
        self._train_graph = nnx.split(abstract, nnx.Param, nnx.RngState, ...)[0]
        abstract.eval()
        self._eval_graph, _, abstract_rngs, _ = nnx.split(abstract, nnx.Param, nnx.RngState, ...)
        # Shapes only: bind() replaces every key, so no concrete RNG state is kept.
        self._abstract_rngs = abstract_rngs
        self._rng_tags = sorted({v.tag for _, v in nnx.to_flat_state(abstract_rngs)})

    def _build(self) -> nnx.Module:
        return self._factory(nnx.Rngs(self._seed), self._params)

    def init(self) -> tuple[Any, Any]:
        """``(params, model_state)`` of a freshly built model (traceable)."""
        _, params, _, model_state = nnx.split(self._build(), nnx.Param, nnx.RngState, ...)
        return params, model_state

    def bind(self, params, model_state, mode: Mode, key) -> nnx.Module:
        """A module over the given state, in train or eval behaviour (traceable).

        Every RNG stream is reseeded from ``key``, so random draws (dropout)
        depend only on it: the engine passes ``fold_in(base_key, step)``.
        """
        graph = self._train_graph if mode == Mode.TRAIN else self._eval_graph
        # Placeholders made inside the trace (reseed mutates them); values are replaced below.
        rngs = jax.tree.map(_placeholder, self._abstract_rngs)
        # copy=True: fresh Variables at this trace level, so batch statistics can be updated
        # inside the gradient trace (the state came from the enclosing loop).
        module = nnx.merge(graph, params, rngs, model_state, copy=True)
        if self._rng_tags and key is not None:  # None (PREDICT): streams keep placeholder keys
            nnx.reseed(module, **{t: jax.random.fold_in(key, zlib.crc32(t.encode())) for t in self._rng_tags})
        return module

    def live(self, params, model_state) -> nnx.Module:
        """A concrete module in eval behaviour holding ``params`` (for interactive use)."""
        module = self._build()
        nnx.update(module, params, model_state)
        module.eval()
        return module

    @staticmethod
    def model_state(module: nnx.Module):
        """The non-trained state of ``module`` after a call (e.g. updated batch statistics)."""
        return nnx.split(module, nnx.Param, nnx.RngState, ...)[3]


def nnx_model(factory: ModelFactory) -> WrappedModel:
    """An NNX model built by ``factory(rngs, params)``; the same as passing the factory bare."""
    return WrappedModel("nnx", lambda hparams, seed: NNXAdapter(factory, hparams, seed))


def _check_factory_signature(factory) -> None:
    try:
        inspect.signature(factory).bind(None, None)
    except TypeError:
        raise ConfigTypeError(
            f"Estimator(model=...) has signature {inspect.signature(factory)}; expected an NNX factory "
            "`(rngs, params) -> nnx.Module`. Fix: `model=lambda rngs, params: MyModule(rngs=rngs)`; for "
            "a plain function `(params, features, rng) -> outputs` use "
            "`model=ex.models.functional(init, apply)`."
        ) from None
    except ValueError:  # builtins without a signature: accept
        pass


def _placeholder(leaf: jax.ShapeDtypeStruct) -> jax.Array:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jnp.broadcast_to(jax.random.key(0), leaf.shape)
    return jnp.zeros(leaf.shape, leaf.dtype)
