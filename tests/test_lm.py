"""The byte-level transformer example: it learns, it is causal, its corpus and its rules are sound."""

import dataclasses
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import Outputs, run_estimax

import estimax as ex
from estimax.examples import lm
from estimax.state import leaf_names

TINY = {"seq_len": 32, "dim": 32, "num_heads": 2, "num_layers": 1, "mlp_ratio": 2}


@pytest.fixture(scope="module")
def corpus():
    return lm.load(seq_len=TINY["seq_len"], train_bytes=40_000, held_out_bytes=8_192)


@pytest.mark.parametrize("compute_dtype, accum", [(None, 1), ("bfloat16", 2)])
def test_a_tiny_model_learns_bytes(corpus, compute_dtype, accum):
    train, held_out = corpus
    config = ex.RunConfig(
        train_batch_size=32,
        steps_per_loop=20,
        loop="scan",
        quiet=True,
        compute_dtype=compute_dtype,
        grad_accum_steps=accum,
    )
    est = lm.estimator(config, decay_steps=60, **TINY)
    before = est.evaluate(held_out)
    assert before["loss"] > math.log(256)  # no better than uniform over bytes at initialisation
    after = est.train(train, max_steps=60).evaluate(held_out)
    assert est.step == 60 and after["loss"] < before["loss"] - 1.5
    assert after["bits_per_byte"] == pytest.approx(after["loss"] / math.log(2), rel=1e-6)
    assert after["num_examples"] == len(held_out)


def test_tensor_and_fsdp_parallel_with_accumulation_trains_like_one_device(corpus):
    train, _ = corpus
    features, labels = train.features["bytes"][:320], train.labels[:320]
    data = ex.data.from_arrays({"bytes": features}, labels)
    losses = {}
    for name, layout in {
        "replicated": {},
        "data2_fsdp2_model2": {"mesh": {"data": 2, "fsdp": 2, "model": 2}, "fsdp_min_bytes": 0},
    }.items():
        accum = 2 if layout else 1
        config = ex.RunConfig(train_batch_size=32, steps_per_loop=10, loop="scan", quiet=True, grad_accum_steps=accum)
        outputs = Outputs()
        est = lm.estimator(dataclasses.replace(config, **layout), decay_steps=10, **TINY)
        est.train(data, max_steps=10, hooks=[outputs])
        losses[name] = outputs["loss"]
    plan = {row.path: row.spec for row in est.sharding_plan()}
    assert tuple(plan["blocks/0/attn/query/kernel"]) == ("fsdp", "model")  # the rule, plus FSDP on the free dimension
    assert tuple(plan["blocks/0/mlp/down/kernel"]) == ("model", "fsdp")
    assert losses["replicated"][-1] < losses["replicated"][0]
    np.testing.assert_allclose(losses["data2_fsdp2_model2"], losses["replicated"], rtol=1e-5)


def test_attention_is_causal():
    model = lm.model(nnx.Rngs(0), TINY)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, TINY["seq_len"])), jnp.int32)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    graph, state = nnx.split(model)
    logits = jax.jit(lambda state, tokens: nnx.merge(graph, state)(tokens))
    before, after = logits(state, tokens), logits(state, changed)
    np.testing.assert_array_equal(before[:, :10], after[:, :10])  # earlier positions cannot see byte 10
    assert not np.allclose(before[:, 10:], after[:, 10:])


def test_the_default_corpus_is_the_standard_library_split_by_file(corpus):
    files = lm.stdlib_files()
    assert files == lm.stdlib_files() and len(files) >= 100  # deterministic
    assert not any(f"{os.sep}site-packages{os.sep}" in f or f"{os.sep}test{os.sep}" in f for f in files)
    train, held_out = corpus
    assert len(train) == (40_000 - 1) // TINY["seq_len"] and len(held_out) == (8_192 - 1) // TINY["seq_len"]
    inputs, targets = train.features["bytes"], train.labels
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # targets are the next bytes
    np.testing.assert_array_equal(targets[:-1, -1], inputs[1:, 0])  # windows tile the text
    first_train, first_held_out = files[0], files[lm.HELD_OUT_EVERY - 1]
    with open(first_train, "rb") as f:
        assert bytes(inputs[0, :16].astype(np.uint8)) == f.read(16)
    with open(first_held_out, "rb") as f:
        assert bytes(held_out.features["bytes"][0, :16].astype(np.uint8)) == f.read(16)


def test_tensor_parallel_rules_each_place_parameters_of_their_rank():
    shapes = jax.eval_shape(lambda: nnx.state(lm.model(nnx.Rngs(0), lm.MODEL), nnx.Param))
    leaves = dict(zip(leaf_names(shapes), jax.tree.leaves(shapes), strict=True))
    assert "blocks/0/attn/query/kernel" in leaves and "blocks/1/mlp/down/kernel" in leaves
    for pattern, spec in lm.SHARDING_RULES:
        matched = [name for name in leaves if re.fullmatch(pattern, name)]
        assert matched, pattern
        for name in matched:
            assert len(spec) == len(leaves[name].shape), name
            split = [size for size, axis in zip(leaves[name].shape, spec, strict=True) if axis == "model"]
            assert split and all(size % 8 == 0 for size in split), name


def test_estimax_train_example_lm_on_a_directory_of_text(tmp_path):
    data_dir = tmp_path / "text"
    data_dir.mkdir()
    for i in range(20):
        (data_dir / f"{i:02d}.txt").write_text(f"line {i}: the quick brown fox jumps over the lazy dog.\n" * 40)
    out = run_estimax(
        "train", "--example", "lm", "--data-dir", str(data_dir), "--model-dir", str(tmp_path / "run"),
        "--max-steps", "4", "--steps-per-loop", "2", "--batch-size", "8", "--grad-accum", "2",
    )  # fmt: skip
    bits, examples = re.search(r"held-out bits_per_byte (\S+) on (\d+) examples after 4 steps", out).groups()
    held_out_bytes = sum(os.path.getsize(data_dir / f"{i:02d}.txt") for i in (9, 19))  # one file in ten
    assert 0 < float(bits) < 8 and int(examples) == (held_out_bytes - 1) // lm.MODEL["seq_len"]


def test_the_task_applies_its_rules_on_a_mesh_that_has_their_axes():
    from estimax.cli import task

    lm_task = task.load("estimax.examples.lm", {"dim": "32", "num_heads": "2", "num_layers": "1"})
    on_model_axis = lm_task.estimator(ex.RunConfig(mesh={"data": 4, "model": 2}, quiet=True)).sharding_plan()
    placed = {row.path: row.placed_by for row in on_model_axis}
    assert placed["blocks/0/attn/query/kernel"].startswith("rule")
    assert str(on_model_axis.rows[0].spec) and any("model" in str(row.spec) for row in on_model_axis)
    # Without a model axis the same task runs data-parallel: its rules do not apply (nor fail).
    data_only = lm_task.estimator(ex.RunConfig(mesh={"data": 8}, quiet=True)).sharding_plan()
    assert all(row.placed_by == "replicated" for row in data_only)


def test_the_model_computes_in_bfloat16_under_its_compute_dtype(monkeypatch):
    """nnx.Embed returns float32 whatever its table holds: the example casts its embeddings, so that
    every matrix product, and the attention (cuDNN's needs 16-bit heads), run in bfloat16."""
    from estimax import precision

    heads = []
    fits = lm.cudnn_attention_fits
    monkeypatch.setattr(lm, "cudnn_attention_fits", lambda query: heads.append(query.dtype) or fits(query))
    graph, params = nnx.split(lm.Transformer(**TINY, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((2, TINY["seq_len"]), jnp.int32)
    forward = lambda params: nnx.merge(graph, params)(tokens).astype(jnp.float32).mean()  # noqa: E731
    low = precision.cast_floating(params, jnp.bfloat16)
    share, wide, total = precision.float32_matmuls(jax.make_jaxpr(forward)(low))
    assert (share, wide) == (0.0, 0) and total > 0
    # Backward: XLA's attention scores its heads in float32 (preferred_element_type): their gradients only.
    assert precision.float32_matmuls(jax.make_jaxpr(jax.grad(forward))(low))[0] < 0.05
    assert heads and set(heads) == {jnp.dtype(jnp.bfloat16)}
