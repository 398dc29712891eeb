"""What a model_dir costs, split into a cost per ``train`` call and a cost per step, and by part.

``benchmarks/loops.py`` gives a model_dir's cost as one ratio per window, which mixes what
each ``train`` call pays once (the checkpoint it ends with, and waiting for that checkpoint to be
committed) with what every step pays (periodic saves, the writers' threads). This benchmark
separates them. For each workload of ``loops.py``, five Estimators in one process train from
``from_arrays`` (or, with ``--input iterable``, a plain generator of host batches, ``loops.py``'s)
with ``loop="auto"`` and the workload's steps per loop:

- ``none``: ``model_dir=None``;
- ``model_dir``: a model_dir with ``RunConfig``'s defaults (metrics.jsonl, TensorBoard with
  every step's points, checkpoints every 1,000 steps within ``max_overhead=0.02``, and the
  checkpoint each call ends with);
- ``no_periodic_saves``: the same, with ``CheckpointPolicy(every_steps=None)`` (only the
  checkpoint each call ends with);
- ``no_tensorboard``: the defaults with ``RunConfig(tensorboard=False)``;
- ``no_save_at_end``: the default policy with ``at_end=False`` (no save, and no wait, at the end
  of a call).

Each round times every Estimator on a short and a long call (``--short-seconds`` and
``--long-seconds``, sized at ``none``'s rate), each round starting with the next Estimator.
A variant's extra seconds over ``none`` on a call of S steps, median over the rounds, is
read as ``per_call + per_step * S``: two call lengths give both. Printed per variant: those two
(``per_call_s``, ``per_step_us``), the per-step part as a fraction of a step without a model_dir
(``per_step_fraction``), the checkpoint seconds each call reported (``Summary.seconds``), the
ratio to ``none`` per round at each length, and ``within_3pct_from_s``: how long a call must be
for the variant to be within 3% of ``none`` (``null`` when the per-step part alone is 3% or more).

Run: ``python benchmarks/model_dir_cost.py --workloads mlp,lm`` (about 2.5 minutes a workload on
2 CPU cores with the defaults); on a GPU ``--workloads lm,cnn``. ``--quick`` is a smoke run whose
numbers are not meaningful.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np
from loops import WORKLOADS, Workload, estimax_runner, quick, shuffled_batches

import estimax as ex

VARIANTS = {  # name: (has a model_dir, RunConfig settings)
    "none": (False, {}),
    "model_dir": (True, {}),
    "no_periodic_saves": (True, dict(checkpoint=ex.CheckpointPolicy(every_steps=None))),
    "no_tensorboard": (True, dict(tensorboard=False)),
    "no_save_at_end": (True, dict(checkpoint=dataclasses.replace(ex.RunConfig().checkpoint, at_end=False))),
}


class CheckpointSeconds(ex.Hook):
    """The seconds a call spent on checkpoints, as its ``Summary`` reports them."""

    may_stop = False

    def end(self, summary):
        self.seconds = summary.seconds["checkpoint"]


def runner(w: Workload, x, y, input: str, model_dir: str | None, compilation_cache: str, settings: dict):
    _, est = estimax_runner(w, x, y, input, model_dir, compilation_cache, **settings)
    if input == "arrays":
        data = ex.data.from_arrays({"x": x}, y)
    else:
        data = (({"x": xb}, yb) for xb, yb in shuffled_batches(x, y, w.batch))
    hook = CheckpointSeconds()

    def run(steps: int) -> tuple[float, float]:
        """The call's wall seconds and its checkpoint seconds."""
        start = time.perf_counter()
        est.train(data, steps=steps, hooks=[hook])
        jax.block_until_ready(est.state())
        return time.perf_counter() - start, hook.seconds

    return run


def measure(w: Workload, input: str, rounds: int, short_seconds: float, long_seconds: float, root: str) -> dict:
    x, y = w.data()
    runs = {
        name: runner(w, x, y, input, os.path.join(root, f"{w.name}-{name}") if keeps else None, root + "/cc", s)
        for name, (keeps, s) in VARIANTS.items()
    }
    for name, run in runs.items():
        print(f"{w.name} {name} warm-up: {run(2 * w.k)[0]:.1f} s", file=sys.stderr, flush=True)
    seconds, _ = runs["none"](4 * w.k)
    rate = 4 * w.k / seconds
    short = w.k * max(1, round(short_seconds * rate / w.k))
    lengths = {"short": short, "long": max(w.k * round(long_seconds * rate / w.k), short + w.k)}
    wall = {(name, length): [] for name in runs for length in lengths}
    saving = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for length, steps in lengths.items():
            for name in names[r % len(names) :] + names[: r % len(names)]:
                seconds, checkpoint = runs[name](steps)
                wall[name, length].append(seconds)
                saving[name].append(checkpoint)
        rates = {f"{name}/{length}": round(lengths[length] / v[-1], 1) for (name, length), v in wall.items()}
        print(f"{w.name} round {r + 1} steps/s: {json.dumps(rates)}", file=sys.stderr, flush=True)
    step_seconds = float(np.median(wall["none", "long"])) / lengths["long"]
    result = {
        "workload": w.name,
        "input": input,
        "device": jax.devices()[0].device_kind,
        "steps_per_loop": w.k,
        "call_steps": lengths,
        "none_steps_per_sec": {
            length: round(lengths[length] / float(np.median(wall["none", length])), 1) for length in lengths
        },
    }
    for name in names[1:]:
        extra = {
            length: float(np.median([a - b for a, b in zip(wall[name, length], wall["none", length], strict=True)]))
            for length in lengths
        }
        per_step = (extra["long"] - extra["short"]) / (lengths["long"] - lengths["short"])
        per_call = extra["short"] - per_step * lengths["short"]
        fraction = per_step / step_seconds
        result[name] = {
            "per_call_s": round(per_call, 4),
            "per_step_us": round(per_step * 1e6, 2),
            "per_step_fraction": round(fraction, 4),
            "checkpoint_s_per_call": round(float(np.median(saving[name])), 4),
            **{
                f"vs_none_{length}_rounds": [
                    round(b / a, 3) for a, b in zip(wall[name, length], wall["none", length], strict=True)
                ]
                for length in lengths
            },
            "within_3pct_from_s": round(max(per_call, 0.0) / (0.03 - max(fraction, 0.0)), 1)
            if fraction < 0.03
            else None,
        }
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,lm", help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=3, help="calls of each length per Estimator")
    parser.add_argument("--short-seconds", type=float, default=1.0, help="a short call, at none's rate")
    parser.add_argument("--long-seconds", type=float, default=8.0, help="a long call, at none's rate")
    parser.add_argument("--input", choices=("arrays", "iterable"), default="arrays", help="from_arrays or a generator")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny calls, one round")
    args = parser.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - WORKLOADS.keys())
    if unknown:
        parser.error(f"unknown workloads {unknown}; expected some of {sorted(WORKLOADS)}")
    if not 0 < args.short_seconds < args.long_seconds:
        parser.error(
            f"--short-seconds {args.short_seconds} and --long-seconds {args.long_seconds}: expected 0 < short < long"
        )
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            w = quick(WORKLOADS[name]) if args.quick else WORKLOADS[name]
            rounds, short, long = (1, 0.05, 0.2) if args.quick else (args.rounds, args.short_seconds, args.long_seconds)
            print(json.dumps(measure(w, args.input, rounds, short, long, root)), flush=True)


if __name__ == "__main__":
    main()
