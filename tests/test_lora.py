"""LoRA adapters: only they train, they save and load on their own, export merges them into the
base, and a killed run resumes with the bits of an uninterrupted one (also under fsdp=8)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import saved_checkpoints, wait_for

import estimax as ex
from estimax.examples import lm
from estimax.state import leaf_names

TINY = {"seq_len": 32, "dim": 32, "num_heads": 2, "num_layers": 1, "mlp_ratio": 2}
LORA = ex.LoRA(layers=[r"blocks/\d+/attn/(query|value)", r"blocks/\d+/mlp/up"], rank=4, alpha=8)
JOB = os.path.join(os.path.dirname(__file__), "lora_job.py")


def model_fn(model, features, labels, mode, params):
    """The example's model_fn, predicting the last position's logits (floats to compare)."""
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"logits": model(features["bytes"], fused=False)[:, -1].astype(jnp.float32)})
    return lm.model_fn(model, features, labels, mode, params)


def _estimator(lora=LORA, warm_start=None, **config):
    hparams = {**lm.params, **TINY, "decay_steps": 10}
    config = ex.RunConfig(train_batch_size=16, steps_per_loop=5, loop="scan", quiet=True, lora=lora, **config)
    return ex.Estimator(lm.model, model_fn, lm.optimizer(hparams), config, hparams, warm_start=warm_start)


def _named(tree) -> dict[str, np.ndarray]:
    tree = jax.device_get(tree)
    return dict(zip(leaf_names(tree), map(np.asarray, jax.tree.leaves(tree)), strict=True))


@pytest.fixture(scope="module")
def corpus():
    return lm.load(seq_len=TINY["seq_len"], train_bytes=20_000, held_out_bytes=2_048)


def test_only_adapters_train_and_the_merged_export_predicts_like_the_adapted_model(corpus, tmp_path):
    train, held_out = corpus
    base_file = str(tmp_path / "base.npz")  # a base "checkpoint": the plain model's parameters
    plain = _estimator(lora=None)
    np.savez(base_file, **_named(plain.state().params))
    est = _estimator(warm_start=ex.WarmStart(base_file))
    before = _named(est.state().params)
    adapters = sorted(n for n in before if "/lora/" in n)
    assert adapters == [f"blocks/0/{m}/lora/lora_{ab}" for m in ("attn/query", "attn/value", "mlp/up") for ab in "ab"]
    for name, value in _named(plain.state().params).items():  # the base is the warm start's, path for path
        np.testing.assert_array_equal(before[name], value)
    est.train(train, max_steps=10)
    after = _named(est.state().params)
    for name in before:
        if name in adapters:
            assert not np.array_equal(after[name], before[name]) or name.endswith("lora_a"), name
        else:
            np.testing.assert_array_equal(after[name], before[name])  # the base: bit for bit
    adapter_bytes = sum(after[n].nbytes for n in adapters)
    moments = sum(np.asarray(x).nbytes for x in jax.tree.leaves(jax.device_get(est.state().opt_state)) if np.ndim(x))
    assert moments == 2 * adapter_bytes  # AdamW's mu and nu of the adapters only, measured
    plan = est.freeze_plan().phases[0]
    assert (plan.trained, plan.trained_bytes) == (len(adapters), adapter_bytes)
    assert "by LoRA (the base)" in str(est.freeze_plan())

    # The adapter file: the adapters alone, a small fraction of the base.
    path = est.save_adapters(str(tmp_path / "adapters.npz"))
    with np.load(path) as saved:
        assert sorted(saved.files) == adapters
        for name in adapters:
            np.testing.assert_array_equal(saved[name], after[name])
    base_bytes = sum(v.nbytes for n, v in after.items() if n not in adapters)
    assert os.path.getsize(path) < adapter_bytes + 4096 and adapter_bytes < base_bytes / 10

    # Export: one artifact of the base model, each kernel + a @ b * alpha / rank.
    features = {"bytes": held_out.features["bytes"][:8]}
    exported = ex.serving.load(est.export(str(tmp_path / "export"), example_features=features))
    predicted = np.stack([row["logits"] for row in est.predict(ex.data.from_arrays(features))])
    # Within 1e-6 of the logits' scale: a merged kernel rounds float32 sums in another order.
    scale = np.abs(predicted).max()
    np.testing.assert_allclose(exported(features)["logits"], predicted, atol=1e-6 * scale, rtol=0)
    reference = lm.model(nnx.Rngs(0), TINY)  # the plain model with merged kernels, by hand
    merged = dict(after)
    for layer in ("attn/query", "attn/value", "mlp/up"):
        a, b = merged.pop(f"blocks/0/{layer}/lora/lora_a"), merged.pop(f"blocks/0/{layer}/lora/lora_b")
        merged[f"blocks/0/{layer}/kernel"] = after[f"blocks/0/{layer}/kernel"] + a @ b * (LORA.alpha / LORA.rank)
    graph, state = nnx.split(reference, nnx.Param)
    state = jax.tree.unflatten(jax.tree.structure(state), [merged[n] for n in leaf_names(state)])
    by_hand = nnx.merge(graph, state)(jnp.asarray(features["bytes"]), fused=False)[:, -1]
    np.testing.assert_allclose(exported(features)["logits"], by_hand, atol=1e-6 * scale, rtol=0)

    # A new run on the same base starts from the saved adapters: the same predictions.
    again = _estimator(lora=ex.LoRA(**{**vars(LORA), "adapters": path}), warm_start=ex.WarmStart(base_file))
    np.testing.assert_array_equal(
        np.stack([r["logits"] for r in again.predict(ex.data.from_arrays(features))]), predicted
    )


def test_bad_lora_settings_are_one_line():
    no_layer = r"LoRA\(layers=\['blocks/0/attn/qkv', ...\]\)\) matches no nnx.Linear"
    with pytest.raises(ex.ConfigError, match=no_layer) as e:
        _estimator(lora=ex.LoRA(layers=["blocks/0/attn/qkv"]))
    assert "\n" not in str(e.value) and "blocks/0/attn/query" in str(e.value)
    with pytest.raises(ex.ConfigTypeError, match="LoRA"):
        ex.LoRA(layers="blocks/0/attn/query")
    with pytest.raises(ex.ConfigError, match="rank"):
        ex.LoRA(layers=["x"], rank=0)
    with pytest.raises(ex.ConfigTypeError, match="lora"):
        ex.RunConfig(lora={"layers": ["x"]})


def _start(model_dir, max_steps, *extra):
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, JOB, model_dir, str(max_steps), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def _final(model_dir) -> dict[str, np.ndarray]:
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(os.path.join(model_dir, "checkpoints"))
    restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    leaves = jax.tree_util.tree_leaves_with_path(restored.state)
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves} | {"step": manager.latest_step()}


@pytest.mark.parametrize("layout", [[], ["fsdp"]], ids=["replicated", "fsdp8"])
def test_sigkill_then_resume_is_bitwise_identical(tmp_path, layout):
    """The tests' MLP with adapters (``lora_job.py``): killed after a few checkpoints, run again to the end."""
    steps = 12
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    process = _start(parts, steps, *layout)
    wait_for(process, lambda: max(saved_checkpoints(parts)[0] or [0]) >= 4, timeout=180)
    process.kill()
    process.wait()
    assert max(saved_checkpoints(parts)[0]) < steps
    for model_dir in (parts, whole):
        out, _ = _start(model_dir, steps, *layout).communicate(timeout=300)
        assert f"Done at step {steps}" in out, out
    expected, got = _final(whole), _final(parts)
    assert got.keys() == expected.keys() and got["step"] == steps
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    if layout:  # the adapters and their moments were sharded, not replicated
        from lora_job import LORA
        from models import estimator

        est = estimator(None, optimizer=optax.adam(1e-2), lora=LORA, mesh={"fsdp": 8}, fsdp_min_bytes=0)
        assert {r.path: tuple(r.spec) for r in est.sharding_plan()}["l1/lora/lora_b"] == (None, "fsdp")
        moments = [x for x in jax.tree.leaves(est.state().opt_state) if x.ndim]  # Adam's, of the 4 adapters
        assert len(moments) == 8 and all("fsdp" in tuple(x.sharding.spec) for x in moments)
