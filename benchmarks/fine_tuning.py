"""What freezing and LoRA cost and save: steps/s and optimizer-state bytes against full fine-tuning.

The byte-level transformer of ``estimax.examples.lm`` at its default size (2 layers, 128 wide,
128 bytes of context, global batch 16, AdamW), on one CPU device. Three runs of the same
model, side by side in one process: every parameter trains ("full"); the embeddings and the
first block frozen by ``RunConfig(freeze=...)`` ("frozen"); LoRA of rank 8 on every attention
and MLP projection, the rest frozen ("lora"). Each engine's device loop (``Core.train_loop``,
a scan of ``STEPS`` steps) is compiled as the engine compiles it, then timed in alternating
rounds (best of ``ROUNDS``). One JSON line per run, then the ratios to "full".
Run: ``python benchmarks/fine_tuning.py``.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np

import estimax as ex
from estimax.examples import lm

STEPS, ROUNDS = 10, 5
BATCH = 16
RUNS = {
    "full": {},
    "frozen": {"freeze": [r"embed/.*", r"positions/.*", r"blocks/0/.*"]},
    "lora": {"lora": ex.LoRA(layers=[r"blocks/\d+/(attn/(query|key|value|out)|mlp/(up|down))"], rank=8, alpha=16)},
}


def array_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if getattr(x, "ndim", 0))


def compiled(config_fields: dict, stack):
    config = ex.RunConfig(train_batch_size=BATCH, num_devices=1, quiet=True, **config_fields)
    est = lm.estimator(config, decay_steps=1000)
    layout = est.layout
    loop = jax.jit(
        est.core.train_loop,
        in_shardings=(layout.state, layout.stack),
        out_shardings=(layout.state, layout.replicated),
        donate_argnums=0,
    )
    state = est.state()
    stack = jax.device_put(stack, layout.stack)
    state, outputs = loop(state, stack)  # compiles
    jax.block_until_ready(outputs)
    plan = est.freeze_plan()
    trained = plan.phases[0].trained_bytes if plan else array_bytes(state.params)
    return loop, state, stack, {"params_bytes": array_bytes(state.params), "trained_params_bytes": trained}


def main() -> None:
    train, _ = lm.load(seq_len=lm.MODEL["seq_len"], train_bytes=200_000, held_out_bytes=1_024)
    features, labels = train.features["bytes"][: STEPS * BATCH], train.labels[: STEPS * BATCH]
    stack = ({"bytes": features.reshape(STEPS, BATCH, -1)}, labels.reshape(STEPS, BATCH, -1))
    runs = {name: compiled(fields, stack) for name, fields in RUNS.items()}
    best = dict.fromkeys(runs, float("inf"))
    states = {name: run[1] for name, run in runs.items()}
    for _ in range(ROUNDS):
        for name, (loop, _, batches, _) in runs.items():
            start = time.perf_counter()
            states[name], outputs = loop(states[name], batches)
            jax.block_until_ready(outputs)  # host sync: the round's time
            best[name] = min(best[name], time.perf_counter() - start)
    results = {}
    for name, (_, _, _, sizes) in runs.items():
        results[name] = {
            "run": name,
            "steps_per_sec": STEPS / best[name],
            "opt_state_bytes": array_bytes(states[name].opt_state),  # measured from the real state
            **sizes,
        }
        print(json.dumps(results[name]))
    full = results["full"]
    for name in ("frozen", "lora"):
        r = results[name]
        print(
            f"{name} / full: steps/s x{r['steps_per_sec'] / full['steps_per_sec']:.2f}, optimizer state "
            f"x{r['opt_state_bytes'] / full['opt_state_bytes']:.4f} ({r['opt_state_bytes']:,} vs "
            f"{full['opt_state_bytes']:,} bytes), trained parameters {r['trained_params_bytes']:,} of "
            f"{r['params_bytes']:,} bytes"
        )
    print(f"devices: {jax.devices()[0].device_kind}, {np.__name__} {np.__version__}, jax {jax.__version__}")


if __name__ == "__main__":
    main()
