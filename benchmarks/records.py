"""Records on local disk and on ``gs://``: what a SIGKILL costs each kind, and TensorBoard's flushes.

Kills: trains the tests' MLP in a child process at 100 steps/s (10 steps per loop,
a record every 100 steps, a checkpoint every 1000: the default; TensorBoard
gets every step; every loop says the step it reached and when), kills it
with SIGKILL after a given time, then reads back what each kind holds: the
last train record of ``metrics.jsonl``, the last TensorBoard event, the last
checkpoint a resume restores. Each loss is in steps and in seconds of
training (from the step the child had reached to the last step kept).

TensorBoard on a bucket: how long one flush (a new event object of 300 steps
of 5 scalars, 10 s at 30 steps/s) takes the writer's thread, and how long
TensorBoard's reader takes to read ``--flushes`` of them back (360: an hour),
against the same points in one object.

``gs://`` is fake-gcs-server on 127.0.0.1 (the objects on the same local disk).
Run: ``python benchmarks/records.py [--after 13 28] [--repeats 2] [--flushes 360]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

TESTS = os.path.join(os.path.dirname(__file__), "..", "tests")
sys.path.insert(0, TESTS)

from stores import GCSEmulator  # noqa: E402

CHILD = """
import sys, time
from models import blobs, estimator
import estimax as ex

class Say(ex.Hook):
    def after_loop(self, loop):
        time.sleep(0.1)  # 100 steps/s: a model's pace, not the tiny MLP's
        print("at", loop.step_after, time.time(), flush=True)

est = estimator(sys.argv[1], steps_per_loop=10, log_every_steps=100, tensorboard=True, quiet=True)
est.train(ex.data.from_arrays(*blobs(1024)), max_steps=10**8, hooks=[Say()])
"""


def last_record(model_dir: str) -> int:
    import fsspec

    from estimax import storage

    path = storage.join(model_dir, "metrics.jsonl")
    if not storage.exists(path):
        return 0
    with fsspec.open(path) as f:
        return max([json.loads(line)["step"] for line in f if line.strip()] or [0])


def last_event(model_dir: str) -> int:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from estimax import storage

    logdir = storage.join(model_dir, "tensorboard", "train")
    steps = [e.step for name in storage.listdir(logdir) for e in EventFileLoader(storage.join(logdir, name)).Load()]
    return max(steps or [0])


def last_checkpoint(model_dir: str) -> int:
    from models import estimator

    return estimator(model_dir).step  # what a resume restores


def kill_after(model_dir: str, seconds: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, model_dir], stdout=subprocess.PIPE, text=True, env=env)
    reached = {}
    for line in child.stdout:
        _, step, at = line.split()
        reached[int(step)] = float(at)
        if float(at) - min(reached.values()) >= seconds:
            child.send_signal(signal.SIGKILL)
            break
    for line in child.stdout.read().splitlines():  # what it printed before it died
        _, step, at = line.split()
        reached[int(step)] = float(at)
    child.wait()
    last, at = max(reached.items())
    costs = {"reached": last}
    for kind, kept in (("metrics.jsonl", last_record), ("tensorboard", last_event), ("checkpoint", last_checkpoint)):
        step = kept(model_dir)
        costs[kind] = (last - step, round(at - reached.get(step, min(reached.values())), 1))
    return costs


def tensorboard_on_a_bucket(url: str, flushes: int, steps: int = 300) -> dict:
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from estimax.records.writers import TensorBoardWriter

    columns = {tag: np.random.rand(steps) for tag in ("loss", "grad_norm", "learning_rate", "accuracy", "norm")}
    result = {}
    for objects in (flushes, 1):
        writer, seconds = TensorBoardWriter(f"{url}/{objects}"), []
        writer.STORE_FLUSH_SECONDS = float("inf")  # flushed here, one object each
        for i in range(flushes):
            writer.write_steps("train", 1 + i * steps, columns)
            if objects > 1 or i == flushes - 1:
                start = time.perf_counter()
                writer.flush()
                seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        reader = EventAccumulator(f"{url}/{objects}/train", size_guidance={"scalars": 0})
        reader.Reload()
        assert len(reader.Scalars("loss")) == flushes * steps
        result[f"read_{objects}_objects_s"] = round(time.perf_counter() - start, 1)
        if objects > 1:
            result["flush_ms_median_p90"] = [round(1e3 * float(np.percentile(seconds, q)), 1) for q in (50, 90)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--after", type=float, nargs="+", default=[13.0, 28.0], help="seconds of training")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--flushes", type=int, default=360, help="TensorBoard objects to read back")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="estimax-sigkill-")
    emulator = GCSEmulator(os.path.join(root, "gcs"))
    os.environ.update(emulator.env)
    try:
        for repeat in range(args.repeats):
            print(json.dumps(tensorboard_on_a_bucket(f"gs://bkt/tensorboard-{repeat}", args.flushes)), flush=True)
        for repeat in range(args.repeats):
            for seconds in args.after:
                for store, model_dir in (
                    ("disk", os.path.join(root, f"run-{repeat}-{seconds}")),
                    ("gs", f"gs://bkt/run-{repeat}-{seconds}"),
                ):
                    costs = kill_after(model_dir, seconds)
                    print(json.dumps({"store": store, "killed_after_s": seconds, **costs}), flush=True)
    finally:
        emulator.stop()


if __name__ == "__main__":
    main()
