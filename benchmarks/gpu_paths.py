"""The paths only a GPU exercises, each once, with its result checked.

On an NVIDIA GPU (a dry run elsewhere, where the cuDNN check is skipped):

- ``attention``: cuDNN's flash attention (``jax.nn.dot_product_attention(...,
  implementation="cudnn")``, what the LM example uses for 16-bit heads on a
  GPU) against the written-out softmax attention in float32, outputs and
  gradients, at GPT-2 small's shape in bfloat16; the time of a forward and
  backward pass of each;
- ``step_flops``: XLA's FLOP count of one GPT-2 small training step with each
  attention, as estimax makes it for its logs (it does not see inside cuDNN's
  kernel): a count at all is the check;
- ``bf16_training``: the LM example trained in bfloat16: its held-out loss falls;
- ``exact_resume``: the same run uninterrupted, and stopped halfway then
  resumed by a new Estimator from its checkpoint (Orbax saving device arrays):
  the final states are compared, beside two uninterrupted runs (whether the
  device's kernels are deterministic);
- ``export``: ``Estimator.export`` (one artifact for CPU, CUDA and TPU) loaded
  with ``estimax.serving.load`` on this device equals ``Estimator.predict``.

One JSON line per check; exit 1 if any check failed. Run: ``python
benchmarks/gpu_paths.py`` (``--quick``: tiny sizes, for a CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import estimax as ex
from estimax.examples import lm
from estimax.records import flops

GPT2 = lm.PRESETS["gpt2-small"]


def written_out_attention(q, k, v):
    """Causal softmax attention in float32, every score kept: the reference."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def seconds_per_call(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def attention(batch: int, length: int) -> dict:
    heads, width = GPT2["num_heads"], GPT2["dim"] // GPT2["num_heads"]
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (batch, length, heads, width), jnp.bfloat16) for key in keys[:3])
    cotangent = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    result = {"shape": [batch, length, heads, width], "cudnn_fits": lm.cudnn_attention_fits(q)}
    kinds = {"xla": None, **({"cudnn": "cudnn"} if result["cudnn_fits"] else {})}

    def attend(implementation):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    reference = jax.jit(written_out_attention)(q, k, v)
    reference_grads = jax.jit(jax.vjp(written_out_attention, q, k, v)[1])(cotangent.astype(jnp.float32))
    for name, implementation in kinds.items():
        fn = attend(implementation)
        out = jax.jit(fn)(q, k, v).astype(jnp.float32)
        grads = jax.jit(lambda q, k, v, c, fn=fn: jax.vjp(fn, q, k, v)[1](c))(q, k, v, cotangent)
        result[f"{name}_max_abs_error"] = float(jnp.max(jnp.abs(out - reference)))
        result[f"{name}_grad_max_abs_error"] = max(
            float(jnp.max(jnp.abs(g.astype(jnp.float32) - r))) for g, r in zip(grads, reference_grads, strict=True)
        )
        forward_backward = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).sum(), argnums=(0, 1, 2)))
        result[f"{name}_forward_backward_ms"] = round(1e3 * seconds_per_call(forward_backward, q, k, v), 3)
    # bf16 inputs, float32 accumulation: errors of a few bf16 ulps of values of size ~1
    result["ok"] = all(result[f"{n}_max_abs_error"] < 0.05 for n in kinds) and all(
        result[f"{n}_grad_max_abs_error"] < 0.25 for n in kinds
    )
    return result


def step_flops(batch: int, sizes: dict) -> dict:
    """XLA's FLOP count of one bf16 training step of the LM at ``sizes``, with each attention."""
    model = lm.Transformer(**sizes, rngs=nnx.Rngs(0))
    graph, params = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((batch, sizes["seq_len"]), jnp.int32)
    counts = {}
    for name, fused in (("xla", False), ("fused_where_fits", True)):

        def loss(params, tokens, fused=fused):
            low = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, params)
            logits = nnx.merge(graph, low)(tokens, fused).astype(jnp.float32)
            return jax.nn.logsumexp(logits, -1).mean()

        counts[name] = flops.step_flops(jax.jit(jax.grad(loss)), params, tokens)
    # cuDNN's attention is one call XLA does not look into: counted as nothing
    return {"flops_per_step": counts, "ok": None not in counts.values()}


def lm_estimator(model_dir, sizes: dict, batch: int, steps_per_loop: int) -> ex.Estimator:
    config = ex.RunConfig(
        model_dir=model_dir,
        train_batch_size=batch,
        steps_per_loop=steps_per_loop,
        compute_dtype="bfloat16",
        quiet=True,
    )
    return lm.estimator(config, decay_steps=1000, **sizes)


def bf16_training(train, held_out, sizes: dict, batch: int, steps: int) -> dict:
    est = lm_estimator(None, sizes, batch, steps_per_loop=min(steps, 50))
    before = est.evaluate(held_out)["loss"]
    start = time.perf_counter()
    after = est.train(train, max_steps=steps).evaluate(held_out)["loss"]
    return {
        "loss_before": round(before, 4),
        "loss_after": round(after, 4),
        "steps": steps,
        "seconds": round(time.perf_counter() - start, 1),
        "loop": est.compiled().loop,
        "ok": after < before - 1.0,
    }


def exact_resume(train, sizes: dict, batch: int, steps: int) -> dict:
    half = steps // 2

    def final_state(model_dir, stops):
        for stop in stops:  # a new Estimator each time: what a restarted process does
            est = lm_estimator(model_dir, sizes, batch, steps_per_loop=half)
            est.train(train, max_steps=stop)
        return jax.tree.map(np.asarray, est.state())

    with tempfile.TemporaryDirectory() as root:
        whole = final_state(f"{root}/whole", [steps])
        again = final_state(f"{root}/again", [steps])
        resumed = final_state(f"{root}/resumed", [half, steps])

    def max_difference(a, b):
        return max(
            float(np.max(np.abs(x.astype(np.float64) - y)))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )

    deterministic = max_difference(whole, again) == 0.0
    difference = max_difference(whole, resumed)
    return {
        "steps": steps,
        "resumed_at": half,
        "two_uninterrupted_runs_max_difference": max_difference(whole, again),
        "resumed_max_difference": difference,
        "bitwise": difference == 0.0,
        # Bitwise where the kernels are deterministic; else no further apart than two whole runs are.
        "ok": difference == 0.0 if deterministic else difference <= 10 * max_difference(whole, again),
    }


def export(train, sizes: dict, batch: int) -> dict:
    est = lm_estimator(None, sizes, batch, steps_per_loop=10)
    est.train(train, max_steps=10)
    rows = ex.data.from_arrays({"bytes": train.features["bytes"][:37]})
    predicted = np.array([row["next_byte"] for row in est.predict(rows)])
    with tempfile.TemporaryDirectory() as root:
        path = est.export(f"{root}/lm")
        signature = json.load(open(f"{path}/signature.json"))
        served = np.asarray(ex.serving.load(path)({"bytes": train.features["bytes"][:37]})["next_byte"])
    agree = float(np.mean(served == predicted))
    return {"platforms": signature["platforms"], "examples": len(predicted), "agree": agree, "ok": agree == 1.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a dry run on a CPU")
    parser.add_argument("--only", help="comma-separated checks to run (default: all)")
    args = parser.parse_args(argv)
    small = {"seq_len": 64, "dim": 64, "num_heads": 2, "num_layers": 1, "mlp_ratio": 2}
    sizes = small if args.quick else lm.MODEL
    train, held_out = lm.load(seq_len=sizes["seq_len"], train_bytes=200_000 if args.quick else 4_000_000)
    checks = {
        "attention": lambda: attention(1, 128) if args.quick else attention(8, GPT2["seq_len"]),
        "step_flops": lambda: (
            step_flops(2, {**GPT2, "seq_len": 128, "num_layers": 1}) if args.quick else step_flops(32, GPT2)
        ),
        "bf16_training": lambda: bf16_training(train, held_out, sizes, 32, 40 if args.quick else 300),
        "exact_resume": lambda: exact_resume(train, sizes, 32, 10 if args.quick else 40),
        "export": lambda: export(train, sizes, 32),
    }
    if args.only:
        checks = {name: check for name, check in checks.items() if name in args.only.split(",")}
    failed = []
    print(
        json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "backend": jax.default_backend()})
    )
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            result = check()
        except Exception as error:  # every check is run and reported, whatever one raised
            result = {
                "ok": False,
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc()[-3000:],
            }
        result = {"check": name, "seconds": round(time.perf_counter() - start, 1), **result}
        print(json.dumps(result), flush=True)
        if result.get("ok") is False:
            failed.append(name)
    print(f"failed: {failed}" if failed else "all checks passed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
