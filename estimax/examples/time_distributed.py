"""The 2018 TimeDistributed program: a layer applied independently at every time step.

Inputs ``(1024, 10, 10, 10)``: 10 time steps, each a 10x10 slice; labels
``(1024, 10)``, one per time step. At each time step, a Dense(10) on the last
axis, then a global max pooling over the whole 10x10 slice (one value per
time step), MSE, SGD 0.001, global batch 1024, 2 steps per loop, 10 steps.
``TimeDistributed`` maps its layer over the time axis with ``nnx.vmap`` (the
layer's parameters shared by every step): no loop, nothing unrolled.

Run it: ``estimax train --example time_distributed`` or
``python -m estimax.examples.time_distributed``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import estimax as ex
from estimax.examples import regression

INPUT_SHAPE = (10, 10, 10)  # (time steps, rows, features)
# A task module (estimax/cli/task.py): what the two 2018 programs share comes from regression.py.
DEFAULTS = regression.DEFAULTS
params = regression.params
model_fn = regression.model_fn
optimizer = regression.optimizer
prediction_record = regression.prediction_record


class TimeDistributed(nnx.Module):
    """Applies ``layer`` independently at every time step (axis 1), like Keras' ``TimeDistributed``."""

    def __init__(self, layer: nnx.Module):
        self.layer = layer

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return nnx.vmap(lambda layer, step: layer(step), in_axes=(None, 1), out_axes=1)(self.layer, x)


class DenseMaxPool(nnx.Module):
    """One time step ``(batch, rows, features) -> (batch,)``: Dense on the last axis, then global max pooling."""

    def __init__(self, num_features: int = 10, units: int = 10, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(num_features, units, rngs=rngs)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return jnp.max(self.dense(x), axis=(1, 2))


def model(rngs: nnx.Rngs, params: dict) -> TimeDistributed:
    return TimeDistributed(DenseMaxPool(INPUT_SHAPE[2], regression.NUM_OUTPUTS, rngs=rngs))


build_model = model  # its name before task modules


def train_input(params: dict) -> ex.data.ArrayDataset:
    return regression.random_data(INPUT_SHAPE, params["num_examples"], seed=0)


def eval_input(params: dict) -> ex.data.ArrayDataset:
    return regression.random_data(INPUT_SHAPE, params["num_examples"], seed=1)


def load(num_examples: int = regression.NUM_EXAMPLES):
    return regression.load(INPUT_SHAPE, num_examples)


def estimator(config: ex.RunConfig) -> ex.Estimator:
    return regression.estimator(model, config)


if __name__ == "__main__":
    from estimax import cli

    raise SystemExit(cli.main(["train", "--example", "time_distributed"]))
