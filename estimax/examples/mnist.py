"""The model of the TensorFlow official MNIST example, on MNIST's idx files: a task module.

``estimax train --data mnist --data-dir DIR`` runs it (``--data-dir`` sets
``params["data_dir"]``; held out: the t10k files).

conv 5x5x32, max-pool, conv 5x5x64, max-pool, dense 1024, dropout 0.4,
dense 10 (the digits CNN at ``image_size=28``), trained with SGD and an
exponentially decaying learning rate: 0.05, times 0.96 every 100,000 steps
(staircase), as an optax schedule. One definition for CPU, GPU and TPU: the
engine picks the device loop (``loop="auto"``). Features are
``{"image": (batch, 28, 28) float32 in [0, 1]}``, labels int32 classes.
"""

from __future__ import annotations

import optax
from flax import nnx

import estimax as ex
from estimax.examples import digits

IMAGE_SIZE = 28
NUM_CLASSES = 10
params = {"data_dir": ""}  # the directory (or fsspec URL) of the idx files
DEFAULTS = {"batch_size": 128, "max_steps": 2000, "steps_per_loop": 50, "loop": "auto"}
model_fn = digits.model_fn
prediction_record = digits.prediction_record


def model(rngs: nnx.Rngs, params: dict) -> digits.CNN:
    return digits.CNN(IMAGE_SIZE, NUM_CLASSES, rngs=rngs)


build_model = model  # its name before task modules


def learning_rate() -> optax.Schedule:
    return optax.exponential_decay(0.05, transition_steps=100_000, decay_rate=0.96, staircase=True)


def optimizer(params: dict = params) -> optax.GradientTransformation:
    # inject_hyperparams exposes the learning rate, so the engine logs it every step.
    return optax.inject_hyperparams(optax.sgd)(learning_rate=learning_rate())


def estimator(config: ex.RunConfig) -> ex.Estimator:
    """This task's Estimator under ``config``, for use from Python."""
    from estimax.cli import task

    return task.load(__name__).estimator(config)


def train_input(params: dict) -> ex.data.ArrayDataset:
    return ex.data.idx.mnist(_data_dir(params), "train", image_shape=(IMAGE_SIZE, IMAGE_SIZE))


def eval_input(params: dict) -> ex.data.ArrayDataset:
    return ex.data.idx.mnist(_data_dir(params), "t10k", image_shape=(IMAGE_SIZE, IMAGE_SIZE))


def _data_dir(params: dict) -> str:
    if not params.get("data_dir"):
        raise ex.ConfigError(
            "The mnist task received no data_dir; expected the directory of MNIST's idx files "
            "(train-images-idx3-ubyte[.gz] and the other three). Fix: --data-dir DIR."
        )
    return params["data_dir"]


def load(data_dir: str) -> tuple:
    """(train, held-out) from MNIST's idx files in ``data_dir`` (held out: the t10k files)."""
    return train_input({"data_dir": data_dir}), eval_input({"data_dir": data_dir})
