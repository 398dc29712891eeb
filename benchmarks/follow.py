"""A follower beside a trainer on one machine: the lag from a commit to its evaluation, and what it costs training.

The tests' MLP (``tests/follow_job.py``) trains ``--steps`` steps on 8 simulated devices, 2 steps a
loop, a checkpoint every 2 steps keeping 2, once alone and once with a follower (another process,
4 devices, polling every ``--poll`` seconds) that evaluates 96 examples at every checkpoint;
on a local disk and on the GCS emulator (127.0.0.1, started here).

Printed per case, one JSON line: the trainer's median steps/s (its ``metrics.jsonl`` train records,
compilation excluded), and with a follower the p50/p95 seconds from each checkpoint's commit (Orbax's
commit time) to its evaluation record, and how many steps it evaluated.

Run: ``python benchmarks/follow.py --runs 2`` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
JOB = os.path.join(TESTS, "follow_job.py")


def _lines(url: str, name: str) -> list[dict]:
    from estimax import storage

    return [json.loads(line) for line in storage.read_bytes(f"{url}/{name}").splitlines()]


def one(store: str, follower: bool, steps: int, poll: float, env: dict) -> dict:
    url = f"gs://bkt/bench-{os.urandom(4).hex()}" if store == "gs" else os.path.join(tempfile.mkdtemp(), "run")
    env = {**env, "POLL_SECONDS": str(poll), "HOLD_SECONDS": str(max(30.0, 3 * poll))}
    following = None
    if follower:
        log = tempfile.TemporaryFile("w+")
        following = subprocess.Popen(
            [sys.executable, JOB, "follow", url], stdout=subprocess.PIPE, stderr=log, text=True, env=env
        )
        for line in following.stdout:
            if line.strip() == "following":
                break
    trainer = subprocess.run(
        [sys.executable, JOB, "train", url, str(steps), "2"], capture_output=True, text=True, env=env
    )
    assert trainer.returncode == 0, trainer.stderr[-2000:]
    rates = [r["steps_per_sec"] for r in _lines(url, "metrics.jsonl") if r["split"] == "train" and "steps_per_sec" in r]
    result = {"store": store, "follower": follower, "steps": steps, "trainer_steps_per_sec": statistics.median(rates)}
    if following is not None:
        following.communicate()
        log.seek(0)
        assert following.returncode == 0, log.read()[-2000:]
        lags = sorted(r["lag_seconds"] for r in _lines(url, "evaluations/eval.jsonl"))
        result.update(
            evaluated=len(lags),
            poll_seconds=poll,
            lag_p50=round(lags[len(lags) // 2], 3),
            lag_p95=round(lags[min(len(lags) - 1, int(0.95 * len(lags)))], 3),
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--poll", type=float, default=0.5)
    parser.add_argument("--stores", default="disk,gs")
    args = parser.parse_args()
    sys.path.insert(0, TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    emulator = None
    if "gs" in args.stores:
        from stores import GCSEmulator

        emulator = GCSEmulator(tempfile.mkdtemp())
        env.update(emulator.env)
        os.environ.update(emulator.env)
    try:
        for _ in range(args.runs):
            for store in args.stores.split(","):
                for follower in (False, True):
                    print(json.dumps(one(store, follower, args.steps, args.poll, env)), flush=True)
    finally:
        if emulator is not None:
            emulator.stop()


if __name__ == "__main__":
    main()
