"""Does input overlap the device? Wall time per step against max(X, Y), not X + Y.

An input costs X ms per batch (a Grain map that sleeps, as slow storage or a
slow decoder would, on one Grain read thread), and a training step costs Y ms
(a dense network on the CPU device). Each case measures:

- ``input_ms``: X, the pipeline alone (batches drawn as fast as it gives them);
- ``step_ms``: Y, training on in-memory arrays (no input cost);
- ``wall_ms_per_step``: training on the slow input, from the middle line of
  ``metrics.jsonl`` (steady state: compilation and pipeline start-up excluded);
- ``ratio_vs_max`` = wall / max(X, Y) (1.0 is perfect overlap) and
  ``ratio_vs_sum`` = wall / (X + Y) (1.0 is no overlap at all);
- ``input_wait_fraction`` of that line, as the train log reports it.

Cases: X > Y and X < Y on one read thread, and X > Y with Grain worker
processes (``from_grain(..., num_workers=2)``, ``mp_prefetch``), where the
input's share shrinks with the workers. One JSON line per case.

Run: ``python benchmarks/infeed.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time

import grain
import numpy as np
import optax
from flax import nnx

import estimax as ex
from estimax.data import feed

BATCH, DIM, NUM_EXAMPLES, STEPS_PER_LOOP = 64, 512, 4096, 10


class Net(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(DIM, DIM, rngs=rngs) for _ in range(depth)])
        self.head = nnx.Linear(DIM, 10, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.head(x)


def model_fn(model, features, labels, mode, params):
    logits = model(features["x"])
    return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels))


class SlowRead:
    """A per-example cost: sleeps (releasing the GIL, like I/O) ``seconds`` per example."""

    def __init__(self, seconds: float, x: np.ndarray, y: np.ndarray):
        self.seconds, self.x, self.y = seconds, x, y

    def __call__(self, i):
        time.sleep(self.seconds)
        return {"x": self.x[i]}, self.y[i]


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(NUM_EXAMPLES, DIM)).astype(np.float32), rng.integers(0, 10, NUM_EXAMPLES).astype(np.int32)


def sleep_overhead(seconds: float = 1e-4, repeats: int = 200) -> float:
    """How much longer than asked a short ``time.sleep`` takes on this machine."""
    start = time.perf_counter()
    for _ in range(repeats):
        time.sleep(seconds)
    return (time.perf_counter() - start) / repeats - seconds


def slow_input(input_ms: float, num_workers: int = 0, overhead: float = 0.0):
    x, y = data()
    per_example = max(input_ms / 1e3 / BATCH - overhead, 0.0)
    dataset = grain.MapDataset.range(NUM_EXAMPLES).map(SlowRead(per_example, x, y))
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=BATCH)
    return ex.data.from_grain(dataset, num_workers=num_workers, read_options=options)


def measure_input(source, num_stacks: int) -> float:
    """ms per batch of the pipeline alone, after its first stack (start-up) and before it
    closes (shutting down workers is not a per-batch cost)."""
    stacks = feed.train_stacks(source, BATCH, [STEPS_PER_LOOP] * (1 + num_stacks), seed=0, start_step=0)
    next(stacks)
    start = time.perf_counter()
    for _ in range(num_stacks):
        next(stacks)
    return (time.perf_counter() - start) / (num_stacks * STEPS_PER_LOOP) * 1e3


def train(source, depth: int, num_steps: int) -> dict:
    with tempfile.TemporaryDirectory() as model_dir:
        config = ex.RunConfig(
            model_dir=model_dir,
            train_batch_size=BATCH,
            steps_per_loop=STEPS_PER_LOOP,
            loop="scan",
            log_every_steps=num_steps // 3,
            save_every_steps=None,
            num_devices=1,
        )
        est = ex.Estimator(lambda rngs, p: Net(depth, rngs), model_fn, optax.sgd(0.01), config)
        est.train(source, max_steps=num_steps)
        with open(os.path.join(model_dir, "metrics.jsonl")) as f:
            # The middle line: steady state, after compilation and the pipeline's start-up.
            (record,) = [r for r in map(json.loads, f) if r["step"] == 2 * (num_steps // 3)]
    return {"wall_ms_per_step": 1e3 / record["steps_per_sec"], "input_wait_fraction": record["input_wait_fraction"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=12, help="dense layers: sets the step cost Y")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    logging.getLogger("estimax").addHandler(logging.NullHandler())  # quiet: only the JSON lines

    overhead = sleep_overhead()
    arrays = ex.data.from_arrays({"x": data()[0]}, data()[1])
    step_ms = train(arrays, args.depth, args.steps)["wall_ms_per_step"]
    cases = [
        ("input_bound", 2.0 * step_ms, 0),
        ("step_bound", 0.4 * step_ms, 0),
        ("input_bound_2_workers", 2.0 * step_ms, 2),
    ]
    for name, target_input_ms, workers in cases:
        step_ms = train(arrays, args.depth, args.steps)["wall_ms_per_step"]  # again: the machine is shared
        input_ms = measure_input(slow_input(target_input_ms, workers, overhead), 6)
        result = train(slow_input(target_input_ms, workers, overhead), args.depth, args.steps)
        wall = result["wall_ms_per_step"]
        line = {
            "case": name,
            "grain_workers": workers,
            "input_ms": round(input_ms, 2),
            "step_ms": round(step_ms, 2),
            "wall_ms_per_step": round(wall, 2),
            "ratio_vs_max": round(wall / max(input_ms, step_ms), 3),
            "ratio_vs_sum": round(wall / (input_ms + step_ms), 3),
            "input_wait_fraction": round(result["input_wait_fraction"], 3),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
