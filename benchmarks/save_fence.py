"""What a periodic save costs the training thread, with its fence and its records, on a disk and a bucket.

The tests' MLP (``tests/models.py``) trains 400 steps, 2 steps a loop, saving every 4 steps
(100 asynchronous saves, ``max_overhead=None``) with metrics.jsonl and TensorBoard records
every 2 steps, once per store and per naming of the run:

- ``disk``: a local model_dir; ``gs``: the GCS emulator on 127.0.0.1 (started here);
- ``named``: ``ESTIMAX_RUN_ID`` set, so that a later attempt may take the lock over at any
  moment and every upload of the records first reads the lease.

Printed per case, one JSON line: the wall seconds of the call and the host milliseconds per save
(``Summary.seconds["checkpoint"]`` over the saves: the records made durable, the lock proven,
the state copied off the devices, Orbax's save started, and the waits for the save before).
Each case runs in a process of its own, alternating with the others, ``--runs`` times.

Run: ``python benchmarks/save_fence.py --runs 3`` (about 4 minutes on 2 CPU cores). The same
script runs against another checkout (``PYTHONPATH=OTHER/`` first) to compare two versions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
SAVES, STEPS = 100, 400


def one(store: str, named: bool) -> dict:
    sys.path.insert(0, TESTS)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    if named:
        os.environ["ESTIMAX_RUN_ID"] = f"bench-{os.getpid()}"
    emulator = None
    if store == "gs":
        from stores import GCSEmulator

        emulator = GCSEmulator(tempfile.mkdtemp())
        os.environ.update(emulator.env)
        url = f"gs://bkt/bench-{os.getpid()}"
    else:
        url = os.path.join(tempfile.mkdtemp(), "run")
    from models import blobs, estimator

    import estimax as ex

    class Summary(ex.Hook):
        def end(self, summary):
            self.summary = summary

    summary = Summary()
    est = estimator(
        url, steps_per_loop=2, log_every_steps=2, tensorboard=True, quiet=True,
        checkpoint=ex.CheckpointPolicy(every_steps=STEPS // SAVES, max_overhead=None, keep=3),
    )  # fmt: skip
    began = time.perf_counter()
    est.train(ex.data.from_arrays(*blobs(256)), max_steps=STEPS, hooks=[summary])
    wall = time.perf_counter() - began
    if emulator is not None:
        emulator.stop()
    per_save = summary.summary.seconds["checkpoint"] / SAVES * 1000
    return {"store": store, "named": named, "wall_s": round(wall, 2), "host_ms_per_save": round(per_save, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stores", default="disk,gs")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # STORE:NAMED, in a process of its own
    args = parser.parse_args()
    if args.one:
        store, named = args.one.split(":")
        print(json.dumps(one(store, named == "1")), flush=True)
        return
    cases = [(store, named) for store in args.stores.split(",") for named in ("0", "1")]
    for _ in range(args.runs):
        for store, named in cases:
            found = subprocess.run(
                [sys.executable, __file__, "--one", f"{store}:{named}"], capture_output=True, text=True, check=True
            )
            print(found.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
