"""Elastic training on Ray: a run outlives the loss of a node and grows again when one comes back.

A real Ray cluster on 127.0.0.1 (a head and one more node, one CPU and one
raylet each), Ray Train's ``JaxTrainer`` with ``num_workers=(1, 2)``, every
worker one process of one JAX group (``estimax.ray.initialize``) running
tests/ray_job.py's training. The reference is the same training changing
shape at the same steps on purpose, without Ray, in this process (4, 2, then
4 devices). Skipped where Ray is not installed (``pip install 'estimax[ray]'``).
"""

import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grain
import jax
import numpy as np
import pytest
from helpers import user_env
from models import blobs, estimator

import estimax as ex
from estimax import storage
from estimax.distributed import free_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray[train]")

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
JOB = os.path.join(TESTS, "ray_job.py")
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
DEVICES = 2  # per worker process


def examples() -> grain.MapDataset:
    """The input of tests/ray_job.py (and tests/resize_job.py)."""
    features, labels = blobs(203)
    return grain.MapDataset.range(len(labels)).map(lambda i: ({"x": features["x"][i]}, labels[i]))


def _env():
    env = {k: v for k, v in user_env().items() if not k.startswith(("ESTIMAX_", "RAY_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, TESTS, env.get("PYTHONPATH")]))
    return {
        **env,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": str(DEVICES),
        "RAY_USAGE_STATS_ENABLED": "0",
        # A lost node is declared dead within about a second, not Ray's default 15 s.
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_timeout_ms": "500",
        "RAY_health_check_failure_threshold": "2",
        # Ray's view of the cluster lags up to 20 s: the first group after a loss may ask for the lost
        # node's workers; give up on them after 10 s, not Ray Train's default 60 s.
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10",
    }


class Lines:
    """A child process whose output lines are read as they come (and kept, for the assertion messages)."""

    def __init__(self, command, env):
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.seen: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, pattern: str, deadline_seconds: float = 180) -> re.Match:
        """The first line from now on that matches ``pattern``; fails if the process ends first."""
        while True:
            try:
                line = self._lines.get(timeout=deadline_seconds)
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {deadline_seconds} s:\n{self.text()}") from None
            if line is None:
                raise AssertionError(f"the process ended before a line matching {pattern!r}:\n{self.text()}")
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match

    def text(self) -> str:
        return "".join(self.seen[-200:])

    def rest(self) -> list[str]:
        """The lines not yet read, once the process has ended."""
        self.process.wait()
        lines = list(iter(self._lines.get, None))
        self.seen.extend(lines)
        return lines

    def kill(self):
        """SIGKILL of the process and everything it started (a node: its raylet and its workers)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def _node(*args, env) -> Lines:
    node = Lines([RAY, "start", "--block", "--disable-usage-stats", *args], env)
    node.wait_for("Ray runtime started")
    return node


def _train_without_ray(model_dir: str, phases) -> dict:
    """The same training in this process, on the first ``devices`` devices up to each ``step``."""
    for devices, step in phases:
        est = estimator(model_dir, loop="scan", train_batch_size=24, steps_per_loop=4, save_every_steps=4,
                        num_devices=devices)  # fmt: skip
        est.train(ex.data.from_grain(examples()), max_steps=step)
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(est.state().params)}


def test_a_ray_run_shrinks_when_a_node_dies_and_grows_when_one_returns(tmp_path, gcs):
    run, out = f"gs://bkt/{tmp_path.name}", str(tmp_path / "out")  # a model_dir every node sees: a bucket
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = _env()
    # The head (the driver's node) and one more node, one worker each.
    nodes = [_node("--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false", env=env)]
    try:
        nodes.append(_node(f"--address={address}", "--num-cpus=1", env=env))
        # A global batch that 2 workers of 2 devices cannot split: refused before the first step, said through Ray.
        refused = Lines([sys.executable, JOB, address, str(tmp_path / "no"), str(tmp_path / "no-out"), "--max-steps",
                         "4", "--workers", "2:2", "--batch", "22", "--max-failures", "0"], env)  # fmt: skip
        nodes.append(refused)
        refused.wait_for(r"^estimax.errors.ConfigError: RunConfig\(train_batch_size=22\) does not divide .*Fix: use 20")
        assert refused.process.wait(timeout=300) != 0
        # 2 workers hold after step 12 (checkpoint 8 committed), 1 worker after step 20 (checkpoint 16).
        job = Lines([sys.executable, JOB, address, run, out, "--max-steps", "28", "--workers", "1:2",
                     "--hold", "2:12", "--hold", "1:20"], env)  # fmt: skip
        nodes.append(job)
        job.wait_for(r"holding at step 12 on 2 workers")
        killed = time.time()
        nodes[1].kill()  # a node is lost: its raylet and the worker on it (in its process group)
        again = float(job.wait_for(r"step \d+ on 1 workers at ([\d.]+)")[1])
        job.wait_for(r"holding at step 20 on 1 workers")
        returned = time.time()
        nodes.append(_node(f"--address={address}", "--num-cpus=1", env=env))  # a node comes back
        grown = float(job.wait_for(r"step (?:2\d) on 2 workers at ([\d.]+)")[1])
        assert job.process.wait(timeout=300) == 0, job.text()
        seconds = f"node lost -> training on 1 worker: {again - killed:.1f} s; back -> on 2: {grown - returned:.1f} s"
        job.rest()
    finally:
        for node in reversed(nodes):
            node.kill()

    # Each new group's process 0 took the model_dir's lease over at once from the group before, a 60 s lease
    # renewed moments before: a later attempt of one run, which estimax.ray.initialize named after Ray Train's.
    ray_run = rf"ESTIMAX_RUN_ID=ray:{re.escape(out)}/ray/[^)]+"
    took = rf"Took over the lock of model_dir {re.escape(run)}: it is held by an earlier attempt of this run "
    holders = {m[1] for line in job.seen if (m := re.search(rf"{took}\({ray_run}\) \(host [^,]+, pid (\d+),", line))}
    assert len(holders) >= 2, job.text()

    lines = storage.read_bytes(f"{run}/metrics.jsonl").splitlines()
    records = [r for r in map(json.loads, lines) if r["split"] == "resize"]
    resizes = [(r["step"], r["processes_before"], r["processes"]) for r in records]
    assert resizes == [(8, 2, 1), (16, 1, 2)]  # the last committed checkpoints: steps 9-12 and 17-20 redone
    print(f"{seconds}; steps redone as recorded: {[r.get('steps_redone') for r in records]}")

    # The same training changing shape at the same steps on purpose, without Ray: 4, 2, then 4 devices.
    reference = _train_without_ray(str(tmp_path / "ref"), [(2 * DEVICES, 8), (DEVICES, 16), (2 * DEVICES, 28)])
    with open(os.path.join(out, "result.json")) as f:
        resumed = json.load(f)
    assert resumed["step"] == 28
    for name, value in reference.items():
        np.testing.assert_allclose(resumed["params"][name], value, rtol=1e-5, atol=1e-6)


def test_initialize_outside_a_ray_train_worker_says_where_to_call_it():
    import estimax.ray

    with pytest.raises(ex.errors.ConfigError, match=r"outside a Ray Train worker .*Fix: call it at the top"):
        estimax.ray.initialize()
