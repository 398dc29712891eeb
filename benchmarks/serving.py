"""Serving the digits CNN: requests per second and latency of ``estimax serve``, and the loader's speed.

1. The loaded artifact (``estimax.serving.load``) against ``est.predict()`` on
   the same 1,440 images in batches of 128, side by side in this process.
2. ``estimax serve`` in a subprocess on 127.0.0.1, with dynamic batching on
   and off; clients in threads, each sending one image
   per request (TF Serving's row format) on a keep-alive connection, at
   concurrency 1, 8 and 64. Batching "calibrated" is the default (at most
   the batch size with the best rows/s, timed at startup; no waiting), "64
   rows, 2 ms" a fixed TF-Serving-like setting. Bounded: at most REQUESTS requests or SECONDS
   seconds per point. The clients run on the same machine as the server, so
   at high concurrency they compete with it for the CPU.

One JSON line per measurement. Run: ``python benchmarks/serving.py``.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

import estimax as ex
from estimax import serving
from estimax.examples import digits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONCURRENCY = (1, 8, 64)
REQUESTS, SECONDS = 2000, 10.0
BATCH = 128


def loader_vs_predict(directory: str) -> str:
    est = digits.estimator(ex.RunConfig(model_dir=f"{directory}/run", train_batch_size=BATCH, quiet=True))
    train, held_out = digits.load()
    est.train(train, max_steps=10)
    path = est.export(f"{directory}/digits")
    images = np.concatenate([held_out.features["image"]] * 4)
    model = serving.load(path)

    def run_predict():
        return np.stack([r["class"] for r in est.predict(ex.data.from_arrays({"image": images}))])

    def run_loader():
        return np.concatenate([model({"image": images[i : i + BATCH]})["class"] for i in range(0, len(images), BATCH)])

    assert (run_predict() == run_loader()).all()  # warm up both, and they agree
    times = {"predict": [], "loader": []}
    for _ in range(5):
        for name, fn in (("predict", run_predict), ("loader", run_loader)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    best = {k: min(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "measure": "loader_vs_predict",
                "images": len(images),
                "batch": BATCH,
                "predict_images_per_s": round(len(images) / best["predict"]),
                "loader_images_per_s": round(len(images) / best["loader"]),
                "loader_over_predict": round(best["predict"] / best["loader"], 2),
            }
        ),
        flush=True,
    )
    return path


BATCHING = {
    "calibrated": [],
    "64 rows, 2 ms": ["--batch-timeout-ms", "2", "--no-calibration"],
    "off": ["--no-batching"],
}


def start_server(path: str, batching: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "estimax.cli", "serve", path, "--port", str(port), "--name", "digits"]
    command += BATCHING[batching]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models/digits")
            if conn.getresponse().status == 200:
                return process, port
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("estimax serve did not start")


def load_test(port: int, bodies: list[bytes], concurrency: int) -> dict:
    deadline = time.monotonic() + SECONDS
    per_client = REQUESTS // concurrency

    def client(index: int) -> list[float]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        latencies = []
        for i in range(per_client):
            if time.monotonic() > deadline:
                break
            start = time.perf_counter()
            conn.request("POST", "/v1/models/digits:predict", body=bodies[(index + i) % len(bodies)])
            response = conn.getresponse()
            response.read()
            assert response.status == 200
            latencies.append(time.perf_counter() - start)
        conn.close()
        return latencies

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        latencies = np.concatenate([np.asarray(x) for x in pool.map(client, range(concurrency))])
    elapsed = time.perf_counter() - start
    return {
        "requests": len(latencies),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(float(np.percentile(latencies, 50)) * 1e3, 2),
        "p99_ms": round(float(np.percentile(latencies, 99)) * 1e3, 2),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = loader_vs_predict(directory)
        images = digits.load()[1].features["image"]
        bodies = [json.dumps({"instances": [images[i].tolist()]}).encode() for i in range(64)]
        for batching in ("calibrated", "64 rows, 2 ms", "off"):
            process, port = start_server(path, batching)
            try:
                for concurrency in CONCURRENCY:
                    load_test(port, bodies, concurrency)  # warm-up: compiles the batch sizes this load makes
                    result = load_test(port, bodies, concurrency)
                    print(
                        json.dumps({"measure": "serve", "batching": batching, "concurrency": concurrency, **result}),
                        flush=True,
                    )
            finally:
                process.terminate()
                process.wait(timeout=60)


if __name__ == "__main__":
    main()
