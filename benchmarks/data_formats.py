"""Examples per second read from ArrayRecord files, TFRecord files and in-memory arrays, side by side.

The same MNIST-sized set (60,000 examples of a 28x28 uint8 image and an
int32 label; the files hold ``tf.train.Example``s with the image as raw
bytes, split over 4 files) is read the way training and evaluation read it,
through ``feed.train_stacks`` and ``feed.eval_batches`` with batches of 128:

- ``open_s``: building the source (TFRecord: indexing every record's
  offset; ArrayRecord: opening each file and counting its records);
- ``train``: one epoch in a new shuffled order, as stacks of 10 batches
  (random access: Grain's read threads fetch and parse each record);
- ``eval``: every example once, in order.

Each line is the median over ``--repeats`` passes (the formats' passes
interleaved) and its ratio to the arrays; ``--workers N`` adds the file
formats read in N Grain worker processes. Run: ``python benchmarks/data_formats.py [--repeats 3] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

NUM_EXAMPLES, NUM_FILES, BATCH, STACK = 60_000, 4, 128, 10


def mnist_sized(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (NUM_EXAMPLES, 28, 28), dtype=np.uint8), rng.integers(0, 10, NUM_EXAMPLES, np.int32)


def write_files(directory: str, images: np.ndarray, labels: np.ndarray) -> dict[str, str]:
    import estimax as ex

    patterns = {}
    for name, writer, suffix in (
        ("array_record", ex.data.array_record.write, "array_record"),
        ("tfrecord", ex.data.tfrecord.write, "tfrecord"),
    ):
        for k, rows in enumerate(np.array_split(np.arange(NUM_EXAMPLES), NUM_FILES)):
            examples = ({"image": images[i].tobytes(), "label": int(labels[i])} for i in rows)
            writer(os.path.join(directory, f"train-{k:02d}.{suffix}"), examples)
        patterns[name] = os.path.join(directory, f"train-*.{suffix}")
    return patterns


def make_source(kind: str, patterns: dict[str, str], images, labels, workers: int):
    import estimax as ex

    spec = {"image": ex.data.tfrecord.Feature(np.uint8, (28, 28)), "label": ex.data.tfrecord.Feature(np.int32)}
    if kind == "arrays":
        return ex.data.from_arrays({"image": images}, labels)
    if kind == "array_record":
        return ex.data.array_record(patterns[kind], spec, label="label", num_workers=workers)
    return ex.data.tfrecord.tfrecord(patterns[kind], spec, label="label", num_workers=workers)


def read_train(source, seed: int) -> int:
    from estimax.data import feed

    steps = source.steps_per_epoch(BATCH)
    chunks = [STACK] * (steps // STACK) + ([steps % STACK] if steps % STACK else [])
    return sum(s[1].size for s in feed.train_stacks(source, BATCH, chunks, seed=seed, start_step=0))


def read_eval(source) -> int:
    from estimax.data import feed

    return sum(len(b[1]) for b in feed.eval_batches(source, BATCH))


def measure(cases, patterns, images, labels, repeats: int) -> list[dict]:
    """Each case's source, then its passes interleaved with the other cases' (a busy machine slows all alike)."""
    sources, lines = [], []
    for kind, workers in cases:
        start = time.perf_counter()
        sources.append(make_source(kind, patterns, images, labels, workers))
        lines.append({"format": kind, "workers": workers, "open_s": round(time.perf_counter() - start, 3)})
    train: list[list[float]] = [[] for _ in cases]
    evaluation: list[list[float]] = [[] for _ in cases]
    for repeat in range(repeats):
        for i, source in enumerate(sources):
            start = time.perf_counter()
            count = read_train(source, seed=repeat)
            train[i].append(count / (time.perf_counter() - start))
            start = time.perf_counter()
            count = read_eval(source)
            assert count == NUM_EXAMPLES, count
            evaluation[i].append(count / (time.perf_counter() - start))
    for line, trained, evaluated in zip(lines, train, evaluation, strict=True):
        line["train_examples_per_s"] = round(statistics.median(trained))
        line["eval_examples_per_s"] = round(statistics.median(evaluated))
        line["train_runs"] = [round(x) for x in trained]
        line["eval_runs"] = [round(x) for x in evaluated]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0, help="also read the files in this many Grain workers")
    args = parser.parse_args()
    images, labels = mnist_sized()
    with tempfile.TemporaryDirectory(prefix="estimax-bench-formats-") as directory:
        patterns = write_files(directory, images, labels)
        sizes = {
            kind: sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(kind))
            for kind in ("array_record", "tfrecord")
        }
        cases = [("arrays", 0), ("array_record", 0), ("tfrecord", 0)]
        if args.workers:
            cases += [("array_record", args.workers), ("tfrecord", args.workers)]
        results = measure(cases, patterns, images, labels, args.repeats)
    arrays = results[0]
    for line in results:
        line["train_vs_arrays"] = round(line["train_examples_per_s"] / arrays["train_examples_per_s"], 4)
        line["eval_vs_arrays"] = round(line["eval_examples_per_s"] / arrays["eval_examples_per_s"], 4)
        line["file_mib"] = round(sizes[line["format"]] / 2**20, 1) if line["format"] in sizes else None
        print(json.dumps(line), flush=True)


if __name__ == "__main__":  # Grain worker processes import this module
    main()
