"""What the plan of a published weights file costs, against reading the file whole.

Writes a safetensors file of ``--arrays`` float32 arrays of ``--mb`` MB each (safetensors'
own writer), then times ``WarmStart(path).plan(params)`` (the file's header only: names,
shapes, dtypes) and the reading of every array the plan loads (as ``apply`` reads them: ``safe_open``, ``get_tensor``),
against ``safetensors.numpy.load_file`` of the whole file. Prints one JSON line per repeat.
Run: ``python benchmarks/published_weights.py [--arrays 8] [--mb 50] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import numpy as np
import safetensors.numpy

import estimax as ex
from estimax.fine_tuning import weight_files


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arrays", type=int, default=8)
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = args.mb * 2**20 // (4 * 1024)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.safetensors")
        arrays = {f"layer.{i}.weight": np.ones((rows, 1024), np.float32) for i in range(args.arrays)}
        safetensors.numpy.save_file(arrays, path)
        params = {f"layer{i}": {"kernel": jax.ShapeDtypeStruct((1024, rows), np.float32)} for i in range(args.arrays)}
        warm = ex.WarmStart(path, rename={r"^layer(\d+)/kernel$": r"layer.\1.weight"}, transpose=[".*/kernel"])
        del arrays
        for repeat in range(args.repeats):
            start = time.perf_counter()
            plan = warm.plan(params)
            planned = time.perf_counter() - start
            start = time.perf_counter()
            read = weight_files.open_weights(path).read([s for _, s in plan.loaded])
            read_seconds = time.perf_counter() - start
            start = time.perf_counter()
            whole = safetensors.numpy.load_file(path)
            whole_seconds = time.perf_counter() - start
            assert len(read) == len(whole) == args.arrays and len(plan.loaded) == args.arrays
            del read, whole
            size = os.path.getsize(path) / 2**20
            print(
                json.dumps(
                    {
                        "repeat": repeat,
                        "file_mb": round(size),
                        "plan_ms": round(planned * 1e3, 1),
                        "read_selected_s": round(read_seconds, 3),
                        "load_file_s": round(whole_seconds, 3),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
