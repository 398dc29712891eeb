"""Checkpoints of the LM's TrainState in a bucket against local disk, as ratios.

Starts fake-gcs-server (the GCS API emulator) and moto's S3 server on
127.0.0.1, builds the LM example's state (parameters and Adam's moments, as
``estimax train --example lm`` has them) and measures with the engine's own
``Checkpointer``, side by side in one process, for a local directory, ``gs://``
and ``s3://``:

- ``save_blocking``: how long ``save`` blocks the training loop (the rest of
  the write continues in the background: saves stay asynchronous on a bucket);
- ``save_complete``: until the checkpoint is committed;
- ``restore``: a verified restore into the run's shardings.

The servers store objects on this machine, so the ratio measures the protocol
(HTTP, tensorstore's GCS or S3 driver, the commit marker) and the server's own
speed (moto is written in Python), not a network.
Run: ``python benchmarks/storage.py [--repeats 5]``.

``--healthy-run OTHER_TREE`` measures instead what the store's safeguards (the
lease, its fence at every loop boundary, the deadlines) cost a healthy run: the
training steps/s of the tests' MLP on ``gs://`` (400 steps, 4 per loop, a
checkpoint every 100, a log line every 20), run by this source tree and by
another checkout (e.g. ``git worktree add /tmp/before <commit>``) alternately,
each run a process of its own, after its first loop has compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from stores import GCSEmulator, S3Server  # noqa: E402


def measure(estimator, directory: str, repeats: int) -> dict:
    from estimax.config import CheckpointPolicy
    from estimax.run.checkpoint import Checkpointer

    state = estimator.state()
    shapes = estimator.state_shapes()
    checkpointer = Checkpointer(directory, CheckpointPolicy(keep=2))
    blocking, complete, restore = [], [], []
    for step in range(repeats + 1):  # the first round compiles the checksums and warms the clients up
        start = time.perf_counter()
        checkpointer.save(step + 1, state)
        returned = time.perf_counter()
        checkpointer.wait()
        done = time.perf_counter()
        checkpointer.restore(shapes, step + 1)
        if step:
            blocking.append(returned - start)
            complete.append(done - start)
            restore.append(time.perf_counter() - done)
    checkpointer.close()
    return {"save_blocking": blocking, "save_complete": complete, "restore": restore}


HEALTHY_RUN = """
import sys, time
sys.path.insert(0, sys.argv[1] + "/tests")
from models import blobs, estimator
import estimax as ex
est = estimator(sys.argv[2], steps_per_loop=4, log_every_steps=20, checkpoint=ex.CheckpointPolicy(every_steps=100))
data = ex.data.from_arrays(*blobs(512))
est.train(data, max_steps=4)  # compiles
began = time.perf_counter()
est.train(data, max_steps=404)
print(400 / (time.perf_counter() - began))
"""


def healthy_runs(other: str, repeats: int) -> None:
    """Steps/s of a healthy gs:// run, this tree and ``other`` alternately."""
    trees = {"this": os.path.abspath(os.path.join(os.path.dirname(__file__), "..")), "other": os.path.abspath(other)}
    root = tempfile.mkdtemp(prefix="estimax-bench-healthy-")
    emulator = GCSEmulator(root, buckets=("bench",))
    rates: dict[str, list[float]] = {name: [] for name in trees}
    try:
        for run in range(repeats):
            for name, tree in trees.items():
                env = {**os.environ, **emulator.env, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu"}
                command = [sys.executable, "-c", HEALTHY_RUN, tree, f"gs://bench/{name}-{run}"]
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
                rates[name].append(float(out.split()[-1]))
    finally:
        emulator.stop()
    ranges = {name: [round(min(r)), round(max(r))] for name, r in rates.items()}
    ratio = round(median(rates["this"]) / median(rates["other"]), 3)
    print(json.dumps({"steps_per_s": ranges, "median_ratio": ratio, "runs": rates}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--healthy-run", metavar="OTHER_TREE", help="compare a healthy run's steps/s with OTHER_TREE")
    args = parser.parse_args()
    if args.healthy_run:
        return healthy_runs(args.healthy_run, args.repeats)
    root = tempfile.mkdtemp(prefix="estimax-bench-storage-")
    emulator, s3 = GCSEmulator(root, buckets=("bench",)), S3Server(root, buckets=("bench",))
    os.environ.update(emulator.env | s3.env)
    try:
        import jax

        import estimax as ex
        from estimax.examples import lm

        estimator = lm.estimator(ex.RunConfig(model_dir=None, train_batch_size=16, quiet=True))
        size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(estimator.state_shapes()))
        local = measure(estimator, os.path.join(root, "local"), args.repeats)
        buckets = {store: measure(estimator, f"{store}://bench/lm/checkpoints", args.repeats) for store in ("gs", "s3")}
        for name in local:
            record = {"what": name, "state_mib": round(size / 2**20, 1), "local_ms": milliseconds(local[name])}
            for store, bucket in buckets.items():
                record[f"{store}_ms"] = milliseconds(bucket[name])
                record[f"{store}_over_local_median"] = round(median(bucket[name]) / median(local[name]), 2)
            print(json.dumps(record))
    finally:
        emulator.stop()
        s3.stop()


def milliseconds(times: list[float]) -> list[float]:
    """The fastest and the slowest."""
    return [round(1e3 * min(times), 1), round(1e3 * max(times), 1)]


def median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
