"""The 2018 LSTM program: an LSTM of 10 units trained inside the device loop.

Inputs ``(1024, 10, 10)`` (10 time steps of 10 features), labels
``(1024, 10)``: the LSTM's last hidden state (as Keras ``LSTM(10)`` returns
it) against the labels, MSE, SGD 0.001, global batch 1024, 2 steps per loop,
10 steps. The recurrence is ``nnx.RNN``, a ``lax.scan`` of static length over
time: it differentiates inside the device loop's own scan without unrolling,
and the compiled program does not grow with the sequence length.

Run it: ``estimax train --example lstm`` or ``python -m estimax.examples.lstm``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import estimax as ex
from estimax.examples import regression

INPUT_SHAPE = (10, 10)  # (time steps, features)
# A task module (estimax/cli/task.py): what the two 2018 programs share comes from regression.py.
DEFAULTS = regression.DEFAULTS
params = regression.params
model_fn = regression.model_fn
optimizer = regression.optimizer
prediction_record = regression.prediction_record


class LSTM(nnx.Module):
    """``(batch, time, features) -> (batch, units)``: the last hidden state."""

    def __init__(self, num_features: int = 10, units: int = 10, *, rngs: nnx.Rngs):
        self.units = units
        self.rnn = nnx.RNN(nnx.OptimizedLSTMCell(num_features, units, rngs=rngs), return_carry=True)

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        # An explicit initial carry: nnx.RNN would otherwise draw it from its RNG
        # state, which cannot be mutated from inside the training step's trace.
        zeros = jnp.zeros((x.shape[0], self.units), x.dtype)
        (_, hidden), _ = self.rnn(x, initial_carry=(zeros, zeros))
        return hidden


def model(rngs: nnx.Rngs, params: dict) -> LSTM:
    return LSTM(INPUT_SHAPE[1], regression.NUM_OUTPUTS, rngs=rngs)


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

    raise SystemExit(cli.main(["train", "--example", "lstm"]))
