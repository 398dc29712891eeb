"""A user's program written against the public API, for the type checker (test_typing.py).

Typed as a careful user types their code: what a type checker finds wrong
here, it finds wrong in every project that uses estimax (``py.typed``). The
``assert_type`` lines pin what the main calls return. Not collected by pytest.
"""

from collections.abc import Iterator
from typing import Any, assert_type

import grain
import jax
import numpy as np
import optax
from flax import nnx

import estimax as ex


class Classifier(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, classes: int) -> None:
        self.hidden = nnx.Linear(6, 32, rngs=rngs)
        self.out = nnx.Linear(32, classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


def model(rngs: nnx.Rngs, params: dict[str, Any]) -> Classifier:
    return Classifier(rngs, params["classes"])


def model_fn(
    model: Classifier, features: dict[str, jax.Array], labels: jax.Array, mode: ex.Mode, params: dict[str, Any]
) -> ex.Spec:
    logits = model(features["x"])
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"logits": logits})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return ex.Spec(loss=loss, metrics={"accuracy": ex.metrics.Accuracy(logits, labels)})


def examples(n: int) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield {"x": np.full(6, i, np.float32), "y": i % 3}


def main(model_dir: str) -> None:
    config = ex.RunConfig(
        model_dir=model_dir,
        train_batch_size=32,
        steps_per_loop=4,
        checkpoint=ex.CheckpointPolicy(every_steps=100, keep=3),
    )
    estimator = ex.Estimator(
        model=model, model_fn=model_fn, optimizer=optax.adam(1e-3), config=config, params={"classes": 3}
    )
    x, y = np.zeros((64, 6), np.float32), np.zeros(64, np.int32)
    arrays = ex.data.from_arrays({"x": x}, y)
    assert_type(arrays, ex.data.ArrayDataset)
    assert_type(estimator.train(arrays, max_steps=8, hooks=[ex.EarlyStopping("loss", patience=2)]), ex.Estimator)
    assert_type(estimator.step, int)
    assert_type(estimator.evaluate(arrays), dict[str, float])
    best = estimator.train_and_evaluate(arrays, arrays, max_steps=16, eval_every=8, best=ex.Best("accuracy"))
    assert_type(best, dict[str, float])
    for row in estimator.predict(arrays):
        print(row["logits"])

    feature = ex.data.tfrecord.Feature
    spec = {"x": feature(np.float32, (6,)), "y": feature(np.int32)}
    ex.data.array_record.write(f"{model_dir}/train.array_record", examples(64))
    estimator.train(ex.data.array_record(f"{model_dir}/*.array_record", spec, label="y", num_workers=2), epochs=1)
    ex.data.tfrecord.write(f"{model_dir}/train.tfrecord", examples(64))
    estimator.train(ex.data.tfrecord.tfrecord(f"{model_dir}/*.tfrecord", spec, label="y"), steps=4)
    pipeline = grain.MapDataset.range(64).map(lambda i: ({"x": x[i]}, y[i]))
    estimator.train(ex.data.from_grain(pipeline, read_options=grain.ReadOptions(num_threads=4)), steps=4)

    path = estimator.export(f"{model_dir}/export")
    assert_type(path, str)
    served = ex.serving.load(path)
    print(served({"x": x})["logits"])
    fine_tuned = ex.Estimator(
        model=model,
        model_fn=model_fn,
        optimizer=optax.sgd(0.01),
        config=ex.RunConfig(model_dir=f"{model_dir}-tuned"),
        params={"classes": 3},
        warm_start=ex.WarmStart(model_dir, exclude=("out/.*",)),
    )
    fine_tuned.train(arrays, steps=8)
