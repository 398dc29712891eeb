"""The Keras 3 adapter: a built model on the JAX backend, run through ``stateless_call``.

Trainable variables are the params, every other variable (batch norm moving
statistics, the seed generators' state) is model state, in the order of
``model.trainable_variables`` / ``model.non_trainable_variables``. The model_fn
receives a ``KerasModel``, called like the Keras model: ``training`` is set
from the mode unless given. Keras is imported only when this adapter is used
(``pip install estimax[keras]``).
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import jax

from estimax.errors import ConfigError, ConfigTypeError
from estimax.models.base import WrappedModel
from estimax.spec import TRAIN, Mode

SEED_STATE = "seed_generator_state"


def keras_model(model) -> WrappedModel:
    """A built Keras 3 model (it has its variables: give it an ``Input`` or call it once).

    Initial weights are the model's own (seed them with
    ``keras.utils.set_random_seed``); dropout draws from the step's key.
    """
    os.environ.setdefault("KERAS_BACKEND", "jax")  # only matters if Keras is not imported yet
    import keras

    if not isinstance(model, keras.Model):
        raise ConfigTypeError(
            f"ex.models.keras(model=...) received {type(model).__name__}; expected a keras.Model, "
            "e.g. `keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])`."
        )
    backend = keras.backend.backend()
    if backend != "jax":
        raise ConfigError(
            f"ex.models.keras received a Keras model on the {backend!r} backend; expected the 'jax' backend, "
            "since estimax compiles the model with JAX. Fix: set the environment variable KERAS_BACKEND=jax "
            "before keras is first imported (e.g. `os.environ['KERAS_BACKEND'] = 'jax'` at the top of the script)."
        )
    if not model.built or not model.trainable_variables:
        raise ConfigError(
            f"ex.models.keras received an unbuilt Keras model ({model.name}: no trainable variables yet); "
            "expected a built model. Fix: start it with `keras.Input(shape)` or call it once on an example batch."
        )
    return WrappedModel("keras", lambda hparams, seed: KerasAdapter(model))


class KerasAdapter:
    """Adapter of a Keras 3 model (see the module docstring)."""

    def __init__(self, model):
        self._model = model
        self._seed_slots = [i for i, v in enumerate(model.non_trainable_variables) if v.path.endswith(SEED_STATE)]

    def init(self) -> tuple[Any, Any]:
        return (
            [v.value for v in self._model.trainable_variables],
            [v.value for v in self._model.non_trainable_variables],
        )

    def bind(self, params, model_state, mode: Mode, key) -> KerasModel:
        state = list(model_state)
        # Dropout draws from the step's key, like every other adapter; PREDICT has none.
        for i in self._seed_slots if key is not None else ():
            seed = jax.random.key_data(jax.random.fold_in(key, zlib.crc32(str(i).encode())))
            if seed.shape == state[i].shape:
                state[i] = seed.astype(state[i].dtype)
        return KerasModel(self._model, params, state, mode == TRAIN, list(model_state), self._seed_slots)

    def model_state(self, model: KerasModel):
        return model.carried_state()

    def live(self, params, model_state):
        """The user's Keras model with these weights assigned."""
        for variable, value in zip(self._model.trainable_variables, params, strict=True):
            variable.assign(value)
        for variable, value in zip(self._model.non_trainable_variables, model_state, strict=True):
            variable.assign(value)
        return self._model


class KerasModel:
    """A Keras model over given variables: ``model(x)`` is ``stateless_call`` with ``training`` from the mode."""

    def __init__(self, model, params, state, training: bool, initial_state, seed_slots):
        self.model, self.params, self.state, self.training = model, params, state, training
        self._initial_state, self._seed_slots = initial_state, seed_slots

    def __call__(self, *args, **kwargs):
        kwargs.setdefault("training", self.training)
        outputs, state = self.model.stateless_call(self.params, self.state, *args, **kwargs)
        if self.training:  # outside TRAIN, moving statistics stay as they are
            self.state = list(state)
        return outputs

    def carried_state(self) -> list:
        """The state for the next step; seed slots keep their stored value (reseeded each step anyway)."""
        return [self._initial_state[i] if i in self._seed_slots else v for i, v in enumerate(self.state)]
