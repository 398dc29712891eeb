"""What the two 2018 device-loop programs share: random data, MSE, SGD 0.001.

In 2018 a Keras LSTM and a Keras ``TimeDistributed`` layer both failed inside
TPUEstimator's device loop ("Cannot create a gradient accumulator ... inside
XLA while_loop because maximum_iterations was not passed"). Both programs
train on random inputs against random labels of shape ``(examples, 10)``
with a mean squared error, SGD with learning rate 0.001, a global batch of
1024 and 2 steps per loop, for 10 steps. ``lstm.py`` and
``time_distributed.py`` hold the two models, as task modules built on this one.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax

import estimax as ex

NUM_EXAMPLES = 1024
NUM_OUTPUTS = 10
LEARNING_RATE = 1e-3
# What the CLI uses unless told otherwise: the 2018 programs, in the device loop.
DEFAULTS = {"batch_size": 1024, "max_steps": 10, "steps_per_loop": 2, "loop": "scan"}
params = {"learning_rate": LEARNING_RATE, "num_examples": NUM_EXAMPLES}


def random_data(input_shape: tuple[int, ...], num_examples: int = NUM_EXAMPLES, seed: int = 0):
    """Uniform random inputs ``(num_examples, *input_shape)`` and labels ``(num_examples, 10)``."""
    rng = np.random.default_rng(seed)
    inputs = rng.random((num_examples, *input_shape), dtype=np.float32)
    labels = rng.random((num_examples, NUM_OUTPUTS), dtype=np.float32)
    return ex.data.from_arrays({"x": inputs}, labels)


def model_fn(model, features, labels, mode, params) -> ex.Spec:
    outputs = model(features["x"])
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"output": outputs})
    return ex.Spec(loss=jnp.mean(jnp.square(outputs - labels), axis=-1))  # MSE, per example


def optimizer(params: dict = params) -> optax.GradientTransformation:
    return optax.sgd(params["learning_rate"])


def estimator(build_model: Callable, config: ex.RunConfig) -> ex.Estimator:
    return ex.Estimator(model=build_model, model_fn=model_fn, optimizer=optimizer(), config=config)


def prediction_record(row) -> dict:
    return {"output": [round(float(v), 6) for v in row["output"]]}


def load(input_shape: tuple[int, ...], num_examples: int = NUM_EXAMPLES):
    """(train, held-out): random data of a 2018 program, two seeds."""
    return random_data(input_shape, num_examples, seed=0), random_data(input_shape, num_examples, seed=1)
