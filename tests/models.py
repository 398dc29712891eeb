"""Tiny models and data shared by the tests."""

import numpy as np
import optax
from flax import nnx

import estimax as ex


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, din: int = 6, hidden: int = 32, classes: int = 3, dropout: float = 0.3):
        self.l1 = nnx.Linear(din, hidden, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.l2 = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def mlp(rngs, params):
    return MLP(rngs, classes=params.get("classes", 3), dropout=params.get("dropout", 0.3))


def model_fn(model, features, labels, mode, params):
    logits = model(features["x"])
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"logits": logits, "class": logits.argmax(-1)})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return ex.Spec(loss=loss, metrics={"accuracy": logits.argmax(-1) == labels})


def blobs(n: int = 512, seed: int = 0):
    """Three separable clusters in 6 dimensions: (features dict, int labels)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n).astype(np.int32)
    centers = rng.normal(size=(3, 6)).astype(np.float32) * 3
    x = centers[labels] + rng.normal(size=(n, 6)).astype(np.float32)
    return {"x": x}, labels


def estimator(model_dir=None, *, lr=0.1, dropout=0.3, classes=3, optimizer=None, warm_start=None, **config):
    config.setdefault("train_batch_size", 32)
    config.setdefault("steps_per_loop", 4)
    config.setdefault("log_every_steps", 10)
    return ex.Estimator(
        model=mlp,
        model_fn=model_fn,
        optimizer=optimizer or optax.sgd(lr),
        config=ex.RunConfig(model_dir=model_dir, **config),
        params={"dropout": dropout, "classes": classes},
        warm_start=warm_start,
    )
