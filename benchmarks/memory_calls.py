"""Resident memory over repeated ``train`` calls in one process, as a notebook makes them.

    python benchmarks/memory_calls.py [--calls 200] [--steps 20] [--model-dir]

Trains a small MLP ``--steps`` steps per call for ``--calls`` calls on one Estimator and prints
the resident set size (psutil) after the warm-up calls and at the end, and the growth per call
over the calls after the warm-up (a least-squares slope, MiB per call).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile

import numpy as np
import optax
import psutil
from flax import nnx

import estimax as ex


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def model_fn(model, features, labels, mode, params):
    logits = model(features["x"])
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"class": logits.argmax(-1)})
    return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--model-dir", action="store_true", help="checkpoints and records in a temporary model_dir")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    data = ex.data.from_arrays(
        {"x": rng.normal(size=(512, 16)).astype(np.float32)}, rng.integers(0, 4, 512).astype(np.int32)
    )
    model_dir = tempfile.mkdtemp() if args.model_dir else None
    est = ex.Estimator(
        model=lambda rngs, p: MLP(rngs),
        model_fn=model_fn,
        optimizer=optax.adam(1e-3),
        config=ex.RunConfig(model_dir=model_dir, train_batch_size=32, steps_per_loop=10, quiet=True),
    )
    process, rss = psutil.Process(), []
    for _ in range(args.calls):
        est.train(data, steps=args.steps)
        gc.collect()
        rss.append(process.memory_info().rss / 2**20)
    after = np.asarray(rss[args.warmup :])
    slope = np.polyfit(np.arange(len(after)), after, 1)[0]
    print(json.dumps({
        "calls": args.calls, "steps_per_call": args.steps, "model_dir": bool(model_dir),
        "rss_mib_after_warmup": round(rss[args.warmup - 1], 1), "rss_mib_at_end": round(rss[-1], 1),
        "growth_mib_per_call_after_warmup": round(float(slope), 4),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
