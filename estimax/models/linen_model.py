"""The Flax Linen adapter: ``module.init`` / ``module.apply`` with mutable collections.

The ``params`` collection is trained; every other collection found at init
(``batch_stats``, ...) is model state: mutable in TRAIN, where its updates are
carried to the next step, and read-only in EVAL and PREDICT. The model_fn
receives a ``LinenModel``, called like the module itself.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen

from estimax.errors import ConfigError, ConfigTypeError
from estimax.models.base import WrappedModel
from estimax.spec import TRAIN, Mode


def linen_model(module: linen.Module, *example_args, rng_streams=("dropout",), **example_kwargs) -> WrappedModel:
    """A Flax Linen module, initialised by ``module.init(rngs, *example_args, **example_kwargs)``.

    Args:
        module: the Linen module.
        *example_args: example inputs, arrays or ``jax.ShapeDtypeStruct`` (zeros are
            used); only their shapes and dtypes matter.
        rng_streams: the RNG streams the module draws from besides ``params``; each is
            derived from the step's key.
        **example_kwargs: example keyword inputs, like ``example_args``.
    """
    if not isinstance(module, linen.Module):
        raise ConfigTypeError(
            f"ex.models.linen(module=...) received {type(module).__name__}; expected a flax.linen.Module "
            "instance, e.g. `ex.models.linen(MLP(features=32), jnp.zeros((1, 6)))`."
        )
    if not example_args and not example_kwargs:
        raise ConfigError(
            f"ex.models.linen({type(module).__name__}(...)) received no example input; Linen modules need "
            "one to initialise. Fix: `ex.models.linen(module, jnp.zeros((1, *input_shape)))`."
        )
    return WrappedModel(
        "linen", lambda hparams, seed: LinenAdapter(module, example_args, example_kwargs, tuple(rng_streams), seed)
    )


class LinenAdapter:
    """Adapter of a Linen module (see the module docstring)."""

    def __init__(self, module: linen.Module, example_args: tuple, example_kwargs: dict, rng_streams, seed: int):
        self._module = module
        self._example = (example_args, example_kwargs)
        self._rng_streams = rng_streams
        self._seed = seed
        shapes = jax.eval_shape(self._variables)
        if "params" not in shapes:
            raise ConfigError(
                f"ex.models.linen({type(module).__name__}(...)) has no 'params' collection after init "
                f"(collections: {sorted(shapes)}); expected trainable parameters to optimise."
            )
        self._state_collections = tuple(sorted(k for k in shapes if k != "params"))

    def _variables(self) -> dict:
        key = jax.random.key(self._seed)
        args, kwargs = jax.tree.map(_concrete, self._example, is_leaf=_is_shape)
        return dict(self._module.init({"params": key, **_stream_keys(key, self._rng_streams)}, *args, **kwargs))

    def init(self) -> tuple[Any, Any]:
        variables = self._variables()
        params = variables.pop("params")
        return params, variables

    def bind(self, params, model_state, mode: Mode, key) -> LinenModel:
        mutable = self._state_collections if mode == TRAIN else False
        return LinenModel(self._module, params, model_state, mutable, key, self._rng_streams)

    def model_state(self, model: LinenModel):
        return model.state

    def live(self, params, model_state) -> linen.Module:
        """The module bound to its variables (``module.bind``): call it directly."""
        return self._module.bind({"params": params, **model_state})


class LinenModel:
    """A Linen module over given variables, called like the module: ``model(x, train=...)``.

    ``method=`` selects another method, as in ``module.apply``. Each call
    draws fresh keys from the step's key; in TRAIN, updates of the mutable
    collections are kept for the next call and the next step.
    """

    def __init__(self, module, params, state, mutable, key, rng_streams):
        self.module, self.params, self.state = module, params, state
        self._mutable, self._key, self._rng_streams, self._calls = mutable, key, rng_streams, 0

    def __call__(self, *args, method=None, **kwargs):
        rngs = {} if self._key is None else _stream_keys(jax.random.fold_in(self._key, self._calls), self._rng_streams)
        self._calls += 1
        variables = {"params": self.params, **self.state}
        if not self._mutable:
            return self.module.apply(variables, *args, rngs=rngs, method=method, **kwargs)
        outputs, updates = self.module.apply(
            variables, *args, rngs=rngs, method=method, mutable=list(self._mutable), **kwargs
        )
        self.state = {**self.state, **updates}
        return outputs


def _stream_keys(key, streams) -> dict:
    return {s: jax.random.fold_in(key, zlib.crc32(s.encode())) for s in streams}


def _is_shape(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _concrete(x):
    return jnp.zeros(x.shape, x.dtype) if _is_shape(x) else x
