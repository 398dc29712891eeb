"""What mergeable metrics cost: training steps with metric states in their per-step
outputs, and evaluation batches, against the same model with plain means only.

One process, side by side: the same MLP (8 simulated CPU devices unless
XLA_FLAGS says otherwise), trained ``STEPS`` steps per variant, each timed
after a warm-up run that compiles it, best of ``REPEATS``; the host merge of
the states (``MetricLogger``) is included, since it runs at every loop boundary.
Prints one JSON line per variant with its time relative to plain means, and
one with the host CPU that writing every step's scalars to TensorBoard costs a step.
Run: ``python benchmarks/metrics.py``.
"""

from __future__ import annotations

import json
import logging
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import estimax as ex  # noqa: E402
from estimax import metrics as M  # noqa: E402

STEPS, STEPS_PER_LOOP, BATCH, CLASSES, REPEATS = 400, 100, 256, 10, 3


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(32, 256, rngs=rngs), nnx.Linear(256, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def model_fn_with(extra):
    def model_fn(model, features, labels, mode, params):
        logits = model(features["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        metrics = {"accuracy": logits.argmax(-1) == labels}
        metrics.update(extra(logits, labels))
        return ex.Spec(loss=loss, metrics=metrics)

    return model_fn


VARIANTS = {
    "plain means": lambda logits, labels: {},
    "+ AUC (200 bins)": lambda logits, labels: {
        "auc": M.AUC(jnp.asarray(logits[:, 1] - logits[:, 0]), labels == 1, from_logits=True)
    },
    "+ AUC + ConfusionMatrix(10) + TopK(5)": lambda logits, labels: {
        "auc": M.AUC(logits[:, 1] - logits[:, 0], labels == 1, from_logits=True),
        "prf": M.ConfusionMatrix(logits, labels, num_classes=CLASSES),
        "top5": M.TopK(logits, labels, k=5),
    },
}


def main():
    logging.getLogger("estimax").setLevel(logging.WARNING)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * 40, 32)).astype(np.float32)
    y = rng.integers(0, CLASSES, len(x)).astype(np.int32)
    data = ex.data.from_arrays({"x": x}, y)
    baseline = {}
    for name, extra in VARIANTS.items():
        est = ex.Estimator(
            model=lambda rngs, params: MLP(rngs),
            model_fn=model_fn_with(extra),
            optimizer=optax.sgd(0.01),
            config=ex.RunConfig(
                train_batch_size=BATCH,
                eval_batch_size=BATCH,
                steps_per_loop=STEPS_PER_LOOP,
                log_every_steps=STEPS_PER_LOOP,
                loop="scan",
                quiet=True,
            ),
        )
        est.train(data, steps=STEPS_PER_LOOP)  # compiles
        est.evaluate(data)
        train, evaluate = [], []
        for _ in range(REPEATS):
            start = time.perf_counter()
            est.train(data, steps=STEPS)
            train.append(time.perf_counter() - start)
            start = time.perf_counter()
            est.evaluate(data)
            evaluate.append(time.perf_counter() - start)
        times = {"train_seconds": min(train), "eval_seconds": min(evaluate)}
        baseline = baseline or times
        print(
            json.dumps(
                {
                    "variant": name,
                    **{k: round(v, 4) for k, v in times.items()},
                    "train_ratio": round(times["train_seconds"] / baseline["train_seconds"], 3),
                    "eval_ratio": round(times["eval_seconds"] / baseline["eval_seconds"], 3),
                }
            ),
            flush=True,
        )


def tensorboard_per_step(num_steps: int = 50_000, log_every_steps: int = 100) -> None:
    """Host CPU microseconds per step of the engine's TensorBoard writer, fed as training feeds it: each
    loop's per-step columns in one ``write_steps`` call (the loss, and ``grad_norm`` measured on the
    loop's last step), a log line's points every ``log_every_steps``, on its writer thread's cadence
    (a flush every ``FLUSH_SECONDS`` at 7,000 steps/s, an MLP's rate on 2 CPU cores); and, for
    comparison, one ``write`` call per step with 5 scalars."""
    import tempfile

    from estimax.records.writers import TensorBoardWriter

    rng = np.random.default_rng(0)
    flush_steps = int(TensorBoardWriter.FLUSH_SECONDS * 7_000)
    result = {}
    for k in (10, 50, 500):
        loss = rng.standard_normal(k).astype(np.float32)
        norms = np.full(k, np.nan, np.float32)
        norms[-1] = 1.0
        with tempfile.TemporaryDirectory() as logdir:
            writer = TensorBoardWriter(logdir)
            writer.FLUSH_SECONDS = float("inf")  # flushed below, at the steps a 2-second cadence gives
            start = time.thread_time()
            for first in range(1, num_steps + 1, k):
                writer.write_steps("train", first, {"loss": loss, "grad_norm": norms}, ("grad_norm",))
                last = first + k - 1
                if last // log_every_steps > (first - 1) // log_every_steps:
                    writer.write("train", last, {"steps_per_sec": 7000.0, "examples_per_sec": 224000.0})
                if last // flush_steps > (first - 1) // flush_steps:
                    writer.flush()
            writer.close()
            result[f"tensorboard_cpu_us_per_step_loops_of_{k}"] = round(
                (time.thread_time() - start) / num_steps * 1e6, 2
            )
    with tempfile.TemporaryDirectory() as logdir:
        writer = TensorBoardWriter(logdir)
        start = time.thread_time()
        for step in range(1, num_steps + 1):
            values = {"loss": 0.5, "grad_norm": 1.0, "learning_rate": 0.1, "accuracy": 0.9, "other": 0.1}
            writer.write("train", step, values)
        writer.close()
        result["tensorboard_cpu_us_per_step_5_scalars_one_write_a_step"] = round(
            (time.thread_time() - start) / num_steps * 1e6, 2
        )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    tensorboard_per_step()
    main()
