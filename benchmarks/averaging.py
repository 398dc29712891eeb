"""What the moving average of the parameters costs per step: with and without, side by side in one process.

For each workload two Estimators differ only in ``RunConfig(ema_decay=...)``:
``raw`` keeps no average, ``ema`` keeps one (``ema_decay=0.999``, the ``ramp``
warm-up). Each one's device loop (``Core.train_loop``: a ``lax.scan`` of
``steps_per_loop`` steps, jitted with the layout's shardings and the state
donated, as training runs it) runs the same stacked batches; timed windows
alternate between the two, and each round gives the ratio of their times.

- ``mlp``: the 784-64-10 MLP of ``loops.py`` (batch 32, SGD), 50 steps per loop, 40 loops per window;
- ``lm``: the byte transformer of ``estimax.examples.lm`` at its default size
  (2 layers, width 128, 128 bytes of context, batch 16, AdamW), 10 steps per loop, 2 loops per window.

Run: ``python benchmarks/averaging.py [--workloads mlp,lm] [--rounds 7]``. Prints one JSON
line per workload: steps/s of each (best window) and ``ema_time_ratio`` (min, median, max over
the rounds of the ``ema`` window's time over the ``raw`` one's: 1.05 is 5% slower), and the
ratios of XLA's own FLOP and bytes-accessed counts of one loop, which no other load disturbs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np
import optax
from loops import WORKLOADS

import estimax as ex
from estimax.examples import lm

DECAY = 0.999


def mlp_estimators(ema_decay):
    w = WORKLOADS["mlp"]

    def model_fn(model, features, labels, mode, params):
        return ex.Spec(loss=w.loss(model(features["x"]), labels))

    config = ex.RunConfig(train_batch_size=w.batch, quiet=True, ema_decay=ema_decay, num_devices=1)
    est = ex.Estimator(model=lambda rngs, p: w.build(rngs), model_fn=model_fn, optimizer=optax.sgd(w.lr), config=config)
    x, y = w.data()
    return est, ({"x": x}, y), 50, 40  # steps per loop, loops per window


def lm_estimators(ema_decay):
    est = lm.estimator(ex.RunConfig(train_batch_size=16, quiet=True, ema_decay=ema_decay, num_devices=1))
    rng = np.random.default_rng(0)
    windows = rng.integers(0, 256, (4096, lm.MODEL["seq_len"] + 1)).astype(np.int32)
    return est, ({"bytes": windows[:, :-1]}, windows[:, 1:]), 10, 2


WORKLOAD_BUILDERS = {"mlp": mlp_estimators, "lm": lm_estimators}


def _stack(features, labels, index: int, k: int, est):
    """The ``index``-th stack of ``k`` training batches of ``est``, on its devices."""
    batch = est.config.train_batch_size
    rows = np.arange(index * k * batch, (index + 1) * k * batch) % len(labels)
    stack = jax.tree.map(lambda a: a[rows].reshape(k, batch, *a.shape[1:]), (features, labels))
    return jax.device_put(stack, est.layout.stack)


def _cost(compiled) -> dict[str, float]:
    """XLA's ``flops`` and ``bytes accessed`` of a compiled loop (a list of one dict on older JAX)."""
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list | tuple) else analysis
    return {"flops": analysis["flops"], "bytes_accessed": analysis["bytes accessed"]}


def benchmark(name: str, rounds: int) -> dict:
    runs = {}
    for kind, decay in (("raw", None), ("ema", DECAY)):
        est, (features, labels), k, num_loops = WORKLOAD_BUILDERS[name](decay)
        stacks = [_stack(features, labels, i, k, est) for i in range(4)]  # reused in turn
        loop = jax.jit(est.core.train_loop, in_shardings=(est.layout.state, est.layout.stack), donate_argnums=0)
        state = jax.tree.map(lambda x: x.copy(), est.state())
        cost = _cost(loop.lower(state, stacks[0]).compile())
        runs[kind] = {"loop": loop, "state": state, "stacks": stacks, "num_loops": num_loops, "k": k, "cost": cost}

    def window(kind: str) -> float:
        run = runs[kind]
        start = time.perf_counter()
        state = run["state"]
        for i in range(run["num_loops"]):
            state, outputs = run["loop"](state, run["stacks"][i % 4])
        jax.block_until_ready((state, outputs))
        run["state"] = state
        return time.perf_counter() - start

    for kind in runs:
        window(kind)  # compiles
    times: dict[str, list[float]] = {kind: [] for kind in runs}
    for r in range(rounds):
        for kind in ("raw", "ema") if r % 2 == 0 else ("ema", "raw"):  # neither always runs first
            times[kind].append(window(kind))
    ratios = sorted(e / r for e, r in zip(times["ema"], times["raw"], strict=True))
    steps = runs["raw"]["num_loops"] * runs["raw"]["k"]
    return {
        "workload": name,
        "rounds": rounds,
        "raw_steps_per_sec": round(steps / min(times["raw"]), 1),
        "ema_steps_per_sec": round(steps / min(times["ema"]), 1),
        "ema_time_ratio": [round(ratios[0], 3), round(statistics.median(ratios), 3), round(ratios[-1], 3)],
        "best_window_ratio": round(min(times["ema"]) / min(times["raw"]), 3),
        # The compiler's own count for one loop (no timing noise): FLOPs and bytes read and written.
        **{
            f"{what}_ratio": round(runs["ema"]["cost"][what] / runs["raw"]["cost"][what], 4)
            for what in runs["raw"]["cost"]
        },
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,lm", help="comma-separated subset of mlp, lm")
    parser.add_argument("--rounds", type=int, default=7, help="timed windows of each, alternating")
    args = parser.parse_args(argv)
    for name in args.workloads.split(","):
        print(json.dumps(benchmark(name, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
