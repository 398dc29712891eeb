"""Swapping versions under load: ``estimax serve BASE`` while new versions of the digits CNN arrive.

The digits CNN is trained in rounds of a few steps, each round exported to a
staging folder. ``estimax serve BASE`` starts on the first; CLIENTS client
threads then send one image per request (TF Serving's row format) on keep-alive
connections, without pause, while each later version is placed into BASE the
way export's ``publish`` does (copied under a dot-name, then renamed). For each
swap: the seconds from the rename to the first answer from the new version
(which holds up to one poll interval, the load and the compilation of every
batch size), the load and compile seconds the server reports, and the requests
that failed (any answer but HTTP 200 from the version that answered, or a
dropped connection) during the whole run.

One JSON line per swap, then a summary. Run: ``python benchmarks/serve_base.py
[--poll-seconds 1] [--clients 8] [--swaps 3]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import estimax as ex
from estimax.examples import digits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = "Estimax-Model-Version"
STEPS_PER_VERSION = 5


def staged_versions(directory: str, count: int) -> dict[int, str]:
    """``count`` exports of the digits CNN, STEPS_PER_VERSION training steps apart, by step."""
    est = digits.estimator(ex.RunConfig(model_dir=f"{directory}/run", train_batch_size=32, quiet=True))
    train, _ = digits.load()
    versions = {}
    for round_ in range(1, count + 1):
        est.train(train, max_steps=round_ * STEPS_PER_VERSION)
        step = round_ * STEPS_PER_VERSION
        versions[step] = est.export(f"{directory}/staged/{step}")
    return versions


def place(artifact: str, base: str, step: int) -> float:
    """Copies ``artifact`` to ``base/step`` as ``publish`` does; returns when it became complete."""
    staging = os.path.join(base, f".incoming-{step}")
    shutil.copytree(artifact, staging)
    os.rename(staging, os.path.join(base, str(step)))
    return time.monotonic()


class Clients:
    """CLIENTS threads sending requests without pause; each answer's version and time kept."""

    def __init__(self, port: int, body: bytes, count: int):
        self.port, self.body = port, body
        self.first_answer: dict[int, float] = {}  # version -> when its first answer arrived
        self.requests, self.failures = 0, []
        self.done, self.lock = threading.Event(), threading.Lock()
        self.threads = [threading.Thread(target=self._run) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self.done.is_set():
            try:
                conn.request("POST", "/v1/models/digits:predict", body=self.body)
                response = conn.getresponse()
                response.read()
                version, status = response.getheader(HEADER), response.status
            except (OSError, http.client.HTTPException) as error:
                version, status = None, repr(error)
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            now = time.monotonic()
            with self.lock:
                self.requests += 1
                if status != 200:
                    self.failures.append(status)
                elif int(version) not in self.first_answer:
                    self.first_answer[int(version)] = now
        conn.close()

    def stop(self) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--poll-seconds", type=float, default=1.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--swaps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        versions = staged_versions(directory, args.swaps + 1)
        steps = sorted(versions)
        base = os.path.join(directory, "base", "digits")
        os.makedirs(base)
        place(versions[steps[0]], base, steps[0])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
        log = os.path.join(directory, "serve.log")
        command = [sys.executable, "-m", "estimax.cli", "serve", base, "--port", str(port)]
        with open(log, "w") as err:
            process = subprocess.Popen(
                [*command, "--poll-seconds", str(args.poll_seconds)], env=env, stdout=subprocess.DEVNULL, stderr=err
            )
        try:
            while "Serving digits" not in open(log).read():
                assert process.poll() is None, open(log).read()
                time.sleep(0.1)
            images = digits.load()[1].features["image"]
            clients = Clients(port, json.dumps({"instances": [images[0].tolist()]}).encode(), args.clients)
            time.sleep(2.0)  # steady state before the first swap
            swaps = []
            for step in steps[1:]:
                complete = place(versions[step], base, step)
                while step not in clients.first_answer:
                    assert process.poll() is None, open(log).read()
                    time.sleep(0.01)
                time.sleep(1.0)  # the previous version unloads; load settles
                match = re.search(
                    rf"Version {step} AVAILABLE \(loaded in ([\d.]+) s, compiled in ([\d.]+) s", open(log).read()
                )
                swap = {
                    "measure": "swap",
                    "version": step,
                    "seconds_to_first_answer": round(clients.first_answer[step] - complete, 3),
                    "load_seconds": float(match[1]),
                    "compile_seconds": float(match[2]),
                }
                swaps.append(swap)
                print(json.dumps(swap), flush=True)
            clients.stop()
            summary = {
                "measure": "run",
                "poll_seconds": args.poll_seconds,
                "clients": args.clients,
                "swaps": len(swaps),
                "requests": clients.requests,
                "failed_requests": len(clients.failures),
                "failures": sorted(set(map(str, clients.failures)))[:5],
                "calibrated": re.search(r"Calibrated .*", open(log).read())[0],
            }
            print(json.dumps(summary), flush=True)
            for line in open(log).read().splitlines():  # the server's own lines, for the record
                if line.startswith(("Calibrated", "Serving", "Version")):
                    print("  server:", line, file=sys.stderr)
        finally:
            process.terminate()
            process.wait(timeout=60)


if __name__ == "__main__":
    main()
