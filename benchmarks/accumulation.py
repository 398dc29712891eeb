"""What gradient accumulation costs: memory, collectives and time of one compiled train step.

Two MLPs on 8 simulated CPU devices, SGD: one whose activations dominate
(256-1024-1024-10, 1.3M parameters, global batch 8192) and one whose
parameters dominate (512-2048-2048-512-10, 6.3M parameters, global batch
512). For ``grad_accum_steps`` 1, 2, 4 and 8, the engine's train step,
compiled as the engine compiles it (state replicated and donated, batch split
over the devices), is measured for its ``memory_analysis()`` per device
(temporaries: activations, gradients and, with A > 1, the float32 gradient
sum), its all-reduces (in the whole program and inside the micro-batch loop,
which runs once per micro-batch), and its steady-state time per step, side by
side in one process (best of 2 alternating rounds of 2 steps). One JSON line
per workload and A. Run: ``python benchmarks/accumulation.py``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import estimax as ex  # noqa: E402

WORKLOADS = {  # name: (layer widths, global batch)
    "activations dominate": ((256, 1024, 1024, 10), 8192),
    "parameters dominate": ((512, 2048, 2048, 512, 10), 512),
}
ACCUMULATIONS = (1, 2, 4, 8)
ROUNDS, STEPS = 2, 2


class MLP(nnx.Module):
    def __init__(self, widths, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths[:-1], widths[1:], strict=True)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def model_fn(model, features, labels, mode, params):
    return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(model(features["x"]), labels))


def compiled_step(widths, batch_size: int, accum: int):
    config = ex.RunConfig(train_batch_size=batch_size, grad_accum_steps=accum, quiet=True)
    est = ex.Estimator(lambda rngs, p: MLP(widths, rngs), model_fn, optax.sgd(1e-3), config)
    replicated, split = NamedSharding(est.mesh, P()), NamedSharding(est.mesh, P("data"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size, widths[0])).astype(np.float32)
    batch = ({"x": x}, rng.integers(0, widths[-1], batch_size, np.int32))
    batch = jax.device_put(batch, split)
    step = jax.jit(
        est.core.train_step, in_shardings=(replicated, split), out_shardings=(replicated, replicated), donate_argnums=0
    )
    state = est.state()
    return state, step.lower(state, batch).compile(), batch


def all_reduces(hlo: str) -> tuple[int, int]:
    """(all-reduces in the program, those inside while-loop bodies)."""
    count = lambda text: len(re.findall(r" all-reduce(?:-start)?\(", text))  # noqa: E731
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    computations = re.split(r"\n(?=\S)", hlo)
    inside = sum(count(c) for c in computations if c.split(" ", 1)[0].lstrip("%") in bodies)
    return count(hlo), inside


def main() -> None:
    for name, (widths, batch_size) in WORKLOADS.items():
        measure(name, widths, batch_size)


def measure(name: str, widths, batch_size: int) -> None:
    runs = {a: compiled_step(widths, batch_size, a) for a in ACCUMULATIONS}
    states = {a: run[0] for a, run in runs.items()}
    times = {a: [] for a in ACCUMULATIONS}
    for _ in range(ROUNDS):
        for a, (_, compiled, batch) in runs.items():
            state = jax.block_until_ready(states[a])
            start = time.perf_counter()
            for _ in range(STEPS):
                state, _ = compiled(state, batch)
            states[a] = jax.block_until_ready(state)
            times[a].append((time.perf_counter() - start) / STEPS)
    base = min(times[1])
    for a, (_, compiled, _) in runs.items():
        memory = compiled.memory_analysis()
        total, inside = all_reduces(compiled.as_text())
        record = {
            "workload": name,
            "grad_accum_steps": a,
            "temp_mib_per_device": round(memory.temp_size_in_bytes / 2**20, 1),
            "argument_mib_per_device": round(memory.argument_size_in_bytes / 2**20, 1),
            "all_reduces": total,
            "all_reduces_in_micro_batch_loop": inside,
            "ms_per_step": round(min(times[a]) * 1e3, 1),
            "time_vs_A1": round(min(times[a]) / base, 2),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
