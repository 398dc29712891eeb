"""What sharding the state saves and costs: replicated vs FSDP vs tensor parallel, on 8 simulated devices.

For a decoder-only transformer over bytes, trained with Adam, measures per layout:
the state bytes per device (from the arrays' own shards, and as ``sharding_plan()``
states them), the compiled train step's ``memory_analysis()`` per device
(arguments, outputs, temporaries), and training steps/s, timed side by side in
one process in interleaved rounds (best of the rounds), with ratios to the
replicated layout. One JSON line per layout, then a Markdown table.

The model is the LM example (``estimax.examples.lm``: its model, model_fn,
``SHARDING_RULES`` and a slice of its corpus), or with ``--model transformer``
the slightly wider transformer below (random windows of a source file). On
CPU the collectives are memory copies: the speed figures are a record, not a
target.

Run: ``python benchmarks/sharding.py [--model lm|transformer] [--steps 10] [--rounds 3]``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import estimax as ex  # noqa: E402
from estimax.data import feed  # noqa: E402
from estimax.layout import format_bytes  # noqa: E402

PARAMS = {"vocab": 256, "seq_len": 64, "width": 256, "heads": 4, "hidden": 1024, "layers": 2}

SHARDING_RULES = [
    (r".*attn/(query|key|value)/kernel", (None, "model")),  # column parallel: heads over "model"
    (r".*attn/(query|key|value)/bias", ("model",)),
    (r".*attn/out/kernel", ("model", None)),  # row parallel
    (r".*mlp/up/kernel", (None, "model")),
    (r".*mlp/up/bias", ("model",)),
    (r".*mlp/down/kernel", ("model", None)),
]


class Block(nnx.Module):
    def __init__(self, p: dict, rngs: nnx.Rngs):
        d, self.heads = p["width"], p["heads"]
        self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.Dict(query=nnx.Linear(d, d, rngs=rngs), key=nnx.Linear(d, d, rngs=rngs))
        self.attn["value"], self.attn["out"] = nnx.Linear(d, d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
        self.mlp = nnx.Dict(up=nnx.Linear(d, p["hidden"], rngs=rngs), down=nnx.Linear(p["hidden"], d, rngs=rngs))

    def __call__(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads)  # noqa: E731
        q, k, v = (split(self.attn[n](h)) for n in ("query", "key", "value"))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // self.heads)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)  # causal
        attended = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
        x = x + self.attn["out"](attended)
        return x + self.mlp["down"](nnx.gelu(self.mlp["up"](self.norm2(x))))


class Transformer(nnx.Module):
    def __init__(self, p: dict, rngs: nnx.Rngs):
        self.embed = nnx.Embed(p["vocab"], p["width"], rngs=rngs)
        self.blocks = nnx.List([Block(p, rngs) for _ in range(p["layers"])])
        self.norm, self.head = nnx.LayerNorm(p["width"], rngs=rngs), nnx.Linear(p["width"], p["vocab"], rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(rngs, params):
    return Transformer({**PARAMS, **params}, rngs)


def model_fn(model, features, labels, mode, params):
    logits = model(features["tokens"])
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"next": logits.argmax(-1)})
    return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(axis=-1))


def synthetic_data(num_examples: int, params: dict):
    seq_len = {**PARAMS, **params}["seq_len"]
    text = np.frombuffer(open(optax.__file__, "rb").read(), np.uint8)  # real bytes, no download
    starts = np.random.default_rng(0).integers(0, len(text) - seq_len - 1, num_examples)
    windows = np.stack([text[s : s + seq_len + 1] for s in starts]).astype(np.int32)
    return ex.data.from_arrays({"tokens": windows[:, :-1]}, windows[:, 1:])


def task(choice: str):
    """``(name, model factory, model_fn, sharding rules, input)``: the LM example, or this file's transformer."""
    if choice == "lm":
        lm = importlib.import_module("estimax.examples.lm")
        hparams = {**lm.params, "train_bytes": 1 << 18}  # a slice of the corpus: windows for a few steps
        return (
            "estimax.examples.lm",
            lambda rngs, params: lm.model(rngs, hparams),
            lm.model_fn,
            list(lm.SHARDING_RULES),
            lm.train_input(hparams),
        )
    return "benchmarks/sharding.py transformer", build_model, model_fn, SHARDING_RULES, synthetic_data(256, {})


def layouts(rules) -> dict[str, dict]:
    return {
        "replicated (data=8)": {},
        "fsdp=8": {"mesh": {"fsdp": 8}},
        "data=4, model=2": {"mesh": {"data": 4, "model": 2}, "sharding_rules": rules},
    }


def per_device_bytes(tree) -> int:
    held: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round and layout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--model", choices=("lm", "transformer"), default="lm", help="lm: estimax.examples.lm")
    args = parser.parse_args()
    logging.getLogger("estimax").setLevel(logging.WARNING)
    name, build, fn, rules, data = task(args.model)
    estimators = {}
    for label, config in layouts(rules).items():
        estimators[label] = ex.Estimator(
            model=build,
            model_fn=fn,
            optimizer=optax.adam(1e-3),
            config=ex.RunConfig(
                train_batch_size=args.batch, steps_per_loop=args.steps, loop="scan", quiet=True, **config
            ),
        )
        estimators[label].train(data, steps=args.steps)  # compiles and warms up
    times = {label: [] for label in estimators}
    for _ in range(args.rounds):
        for label, est in estimators.items():
            jax.block_until_ready(est.state())
            start = time.perf_counter()
            est.train(data, steps=args.steps)
            jax.block_until_ready(est.state())
            times[label].append(time.perf_counter() - start)
    rows = []
    for label, est in estimators.items():
        state = est.state()
        host = next(iter(feed.eval_batches(data, args.batch)))  # (features, labels) of one global batch
        sharding = est.layout.batch
        batch = jax.tree.map(lambda x, s=sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), host)
        layout = est.layout  # the step as training compiles it: the state's and the batch's shardings
        step = jax.jit(
            est.core.train_step, in_shardings=(layout.state, layout.batch), out_shardings=(layout.state, None)
        )
        memory = step.lower(est.state_shapes(), batch).compile().memory_analysis()
        rows.append(
            {
                "layout": label,
                "state_bytes_per_device": per_device_bytes(state),
                "plan_bytes_per_device": est.sharding_plan().totals["total"],
                "replicated_state_bytes": est.sharding_plan().replicated_total,
                "step_argument_bytes": memory.argument_size_in_bytes,
                "step_output_bytes": memory.output_size_in_bytes,
                "step_temp_bytes": memory.temp_size_in_bytes,
                "steps_per_s": round(args.steps / min(times[label]), 2),
            }
        )
    base = rows[0]
    for row in rows:
        row["state_vs_replicated"] = round(row["state_bytes_per_device"] / base["state_bytes_per_device"], 4)
        row["state_vs_replicated_over_8"] = round(8 * row["state_bytes_per_device"] / base["state_bytes_per_device"], 4)
        row["temp_vs_replicated"] = round(row["step_temp_bytes"] / base["step_temp_bytes"], 3)
        row["speed_vs_replicated"] = round(row["steps_per_s"] / base["steps_per_s"], 3)
        print(json.dumps({"model": name, **row}))
    num_params = sum(x.size for x in jax.tree.leaves(estimators[base["layout"]].state_shapes().params))
    print(f"\nmodel: {name}, {num_params:,} parameters, Adam, global batch {args.batch}; under load: ratios only")
    print("| layout | state / device | ÷ (replicated / 8) | step arguments | step temporaries | steps/s ratio |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['layout']} | {format_bytes(row['state_bytes_per_device'])} | {row['state_vs_replicated_over_8']} "
            f"| {format_bytes(row['step_argument_bytes'])} | {format_bytes(row['step_temp_bytes'])} "
            f"| {row['speed_vs_replicated']} |"
        )


if __name__ == "__main__":
    main()
