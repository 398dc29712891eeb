"""What a run's fingerprint costs: one abstract trace of the training step, per call that trains or picks a run.

``estimax.fingerprint.trace`` runs ``jax.make_jaxpr`` of ``Core.train_step`` (and of the eval-mode
model_fn) on the state's and the global train batch's shapes (nothing compiled, allocated or run),
then hashes the programs' text. It also times the other trace ``estimax train`` now makes before
step 1, the eval mode's (``Estimator.check(ex.EVAL, input)`` on an input of 256 examples), which the
command line's ``train`` used to make only after training. For three models (the 2-16-3 MLP of the
command-line tests, the MNIST task's CNN at batch 128, the byte transformer of the ``lm`` task at its
default sizes) it prints one JSON line: the first trace in the process, the median of 5 more, the
program's size in characters, and beside them the time XLA takes to compile the same step
(``jax.jit(train_step).lower(...).compile()``), the cost a trace is small against.
Run: ``python benchmarks/fingerprint_cost.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import estimax as ex  # noqa: E402
from estimax import fingerprint  # noqa: E402
from estimax.examples import lm, mnist  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden, self.out = nnx.Linear(2, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def mlp_fn(model, features, labels, mode, params):
    logits = model(features["x"])
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"class": logits.argmax(-1)})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return ex.Spec(loss=loss, metrics={"accuracy": logits.argmax(-1) == labels})


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype))


def workloads():
    config = ex.RunConfig(train_batch_size=32)
    yield (
        "mlp 2-16-3, batch 32",
        ex.Estimator(lambda rngs, params: MLP(rngs), mlp_fn, optax.sgd(0.05, momentum=0.9), config),
        ({"x": _struct((32, 2), "float32")}, _struct((32,), "int32")),
    )
    yield (
        "mnist cnn, batch 128",
        mnist.estimator(ex.RunConfig(train_batch_size=128)),
        ({"image": _struct((128, 28, 28), "float32")}, _struct((128,), "int32")),
    )
    estimator = lm.estimator(ex.RunConfig(train_batch_size=16))
    seq_len = lm.params["seq_len"]
    yield (
        f"lm transformer, batch 16 x {seq_len}",
        estimator,
        ({"bytes": _struct((16, seq_len), "int32")}, _struct((16, seq_len), "int32")),
    )


def main():
    for name, estimator, batch in workloads():
        shapes = estimator.state_shapes()
        start = time.perf_counter()
        first = fingerprint.trace(estimator.core, shapes, estimator.mesh, batch)
        first_ms = (time.perf_counter() - start) * 1e3
        again = []
        for _ in range(5):
            start = time.perf_counter()
            assert fingerprint.trace(estimator.core, shapes, estimator.mesh, batch) == first
            again.append((time.perf_counter() - start) * 1e3)
        with jax.set_mesh(estimator.mesh):
            text = str(jax.make_jaxpr(estimator.core.train_step)(shapes, batch))
            start = time.perf_counter()
            jax.jit(estimator.core.train_step).lower(shapes, batch).compile()
            compile_s = time.perf_counter() - start
        features, labels = batch
        rows = jax.tree.map(lambda x: np.zeros((256, *x.shape[1:]), x.dtype), (features, labels))
        start = time.perf_counter()
        estimator.check(ex.EVAL, ex.data.from_arrays(*rows))
        eval_check_ms = (time.perf_counter() - start) * 1e3
        row = {
            "workload": name,
            "first_trace_ms": round(first_ms, 1),
            "trace_ms_median": round(statistics.median(again), 1),
            "program_chars": len(text),
            "eval_check_ms": round(eval_check_ms, 1),
            "compile_s": round(compile_s, 2),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
