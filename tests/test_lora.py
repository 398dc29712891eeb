"""LoRA adapters: only they train, they save and load on their own, export merges them into the
base or writes them alone on a base artifact (found, checked and merged when loaded), and a killed
run resumes with the bits of an uninterrupted one (also under fsdp=8)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import warm
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

    return warm.Popen(
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


# -- the adapters alone, exported on a base artifact -------------------------------------------
def _bytes_under(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _stored(artifact_dir) -> dict[str, np.ndarray]:
    """The arrays an artifact's ``params/`` holds, read with Orbax (the export format's reader)."""
    import orbax.checkpoint as ocp

    return {k: np.asarray(v) for k, v in ocp.PyTreeCheckpointer().restore(os.path.join(artifact_dir, "params")).items()}


def test_adapters_exported_alone_on_a_base_artifact_predict_as_the_merged_export(corpus, tmp_path):
    train, held_out = corpus
    exports = tmp_path / "exports"
    features = {"bytes": held_out.features["bytes"][:8]}
    plain = _estimator(lora=None)  # the base: the plain model's parameters, exported once
    np.savez(tmp_path / "base.npz", **_named(plain.state().params))
    with pytest.warns(ex.UntrainedWarning):  # the initial parameters: the base
        base = plain.export(str(exports / "base"), example_features=features)
    est = _estimator(warm_start=ex.WarmStart(str(tmp_path / "base.npz")))
    est.train(train, max_steps=10)
    merged = est.export(str(tmp_path / "merged"), example_features=features)
    path = est.export(str(exports / "adapters"), example_features=features, base_artifact=base)

    # Only the adapters are in it: the base's arrays stay in the base artifact.
    adapters = {n: x for n, x in _named(est.state().params).items() if "/lora/" in n}
    stored = _stored(path)
    assert sorted(stored) == sorted(adapters)
    for name, value in adapters.items():
        np.testing.assert_array_equal(stored[name], value)
    base_params = _bytes_under(os.path.join(base, "params"))
    assert _bytes_under(path) < _bytes_under(merged) - base_params / 2
    assert _bytes_under(os.path.join(path, "params")) < base_params / 3

    # Loaded on its base: the merged export's logits bit for bit (the same merge, the same program), and
    # the run's predict within 1e-6 of the logits' scale (a merged kernel rounds its sums in another order).
    alone = ex.serving.load(path)(features)["logits"]
    np.testing.assert_array_equal(alone, ex.serving.load(merged)(features)["logits"])
    predicted = np.stack([row["logits"] for row in est.predict(ex.data.from_arrays(features))])
    np.testing.assert_allclose(alone, predicted, atol=1e-6 * np.abs(predicted).max(), rtol=0)
    assert not np.allclose(alone, ex.serving.load(base)(features)["logits"])  # the adapters count

    # The exports moved together: the base is found where it lies beside the adapters.
    os.rename(exports, tmp_path / "moved")
    np.testing.assert_array_equal(ex.serving.load(str(tmp_path / "moved" / "adapters"))(features)["logits"], alone)


@pytest.fixture
def two_runs_on_one_base(tmp_path):
    """``(base artifact, [(adapters artifact, its run's predictions)] * 2, features, other base artifact)``:
    the tests' MLP, two LoRA runs (different data) warm-started from one base, and an export of another base."""
    from models import blobs, estimator

    features = blobs(64, seed=9)[0]
    plain = estimator(None, lora=None)
    np.savez(tmp_path / "base.npz", **_named(plain.state().params))
    with pytest.warns(ex.UntrainedWarning):  # the initial parameters: the bases
        base = plain.export(str(tmp_path / "base"), example_features=features)
        other = estimator(None, lora=None, seed=1).export(str(tmp_path / "other"), example_features=features)
    runs = []
    for seed in (0, 1):
        lora = ex.LoRA(layers=["l1", "l2"], rank=4, alpha=8)
        est = estimator(
            None, optimizer=optax.adam(1e-2), lora=lora, warm_start=ex.WarmStart(str(tmp_path / "base.npz"))
        )
        est.train(ex.data.from_arrays(*blobs(256, seed=seed)), max_steps=8)
        path = est.export(str(tmp_path / f"adapters{seed}"), example_features=features, base_artifact=base)
        predicted = np.stack([row["logits"] for row in est.predict(ex.data.from_arrays(features))])
        runs.append((path, predicted, est))
    return base, runs, features, other


def test_two_adapters_on_one_base_each_predict_as_their_own_run(two_runs_on_one_base):
    base, runs, features, _ = two_runs_on_one_base
    served = []
    for path, predicted, _ in runs:
        model = ex.serving.load(path, base_artifact=base)
        np.testing.assert_allclose(model(features)["logits"], predicted, atol=1e-6 * np.abs(predicted).max(), rtol=0)
        served.append(model(features)["logits"])
    assert np.abs(served[0] - served[1]).max() > 1e-2  # each its own run, not the base nor the other


def test_a_base_that_is_not_the_runs_is_refused(two_runs_on_one_base, tmp_path):
    base, runs, features, other = two_runs_on_one_base
    path, _, est = runs[0]
    with pytest.raises(
        ex.ArtifactError, match=r"does not hold this run's base parameters: 2 arrays differ \(l1/kernel, l2/kernel\)"
    ) as e:
        est.export(str(tmp_path / "refused"), example_features=features, base_artifact=other)
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "refused")
    with pytest.raises(ex.ArtifactError, match=r"is not the base artifact .*adapters0's adapters were trained on"):
        ex.serving.load(path, base_artifact=other)
    with pytest.raises(ex.ArtifactError, match="would write the adapters over their base"):
        est.export(base, example_features=features, base_artifact=base)
    with pytest.raises(ex.ArtifactError, match="holds no export"):
        est.export(str(tmp_path / "refused"), example_features=features, base_artifact=str(tmp_path / "nothing"))
    with pytest.raises(ex.ArtifactError, match="is an adapters-only export; expected the whole export"):
        est.export(str(tmp_path / "refused"), example_features=features, base_artifact=runs[1][0])
    with pytest.raises(ex.ArtifactError, match="is an adapters-only export itself"):
        ex.serving.load(path, base_artifact=runs[1][0])
    with pytest.raises(ex.ArtifactError, match="is a whole export .*, not an adapters-only one"):
        ex.serving.load(base, base_artifact=other)
    with pytest.raises(ex.ConfigError, match="expected a LoRA run exported as 'jax'"):
        est.export(str(tmp_path / "refused"), example_features=features, base_artifact=base, format="tf_saved_model")
    from models import estimator

    with pytest.raises(ex.ConfigError, match=r"with RunConfig\(lora=None\); expected a LoRA run"):
        estimator(None).export(str(tmp_path / "refused"), example_features=features, base_artifact=base)
    os.rename(base, str(tmp_path / "elsewhere"))  # the base gone from its recorded path
    with pytest.raises(ex.ArtifactError, match=r"whose base artifact is not at .*base \(no signature.json there\)"):
        ex.serving.load(path)
    ex.serving.load(path, base_artifact=str(tmp_path / "elsewhere"))  # found where it is now


LORA_TASK = """
import dataclasses
import sys

import optax

sys.path.insert(0, {tests!r})
from models import blobs, mlp as model, model_fn  # noqa: E402

import estimax as ex  # noqa: E402

optimizer = optax.adam(1e-2)
params = {{"dropout": 0.3, "classes": 3, "lora": 0}}
DEFAULTS = {{"batch_size": 32, "max_steps": 4, "steps_per_loop": 2}}


def train_input(params):
    return ex.data.from_arrays(*blobs(128))


def eval_input(params):
    return ex.data.from_arrays(*blobs(32, seed=1))


def run_config(config, params):  # --set lora=1: adapters on both layers, the rest frozen
    lora = ex.LoRA(layers=["l1", "l2"], rank=4, alpha=8) if params["lora"] else None
    return dataclasses.replace(config, lora=lora)
"""


def test_estimax_export_base_artifact_writes_the_adapters_alone(tmp_path):
    from helpers import run_estimax

    task = tmp_path / "lora_task.py"
    task.write_text(LORA_TASK.format(tests=os.path.dirname(os.path.abspath(__file__))))
    base, run = str(tmp_path / "base"), str(tmp_path / "run")
    run_estimax("train", str(task), "--model-dir", base, cwd=tmp_path)
    exported = run_estimax("export", str(task), "--model-dir", base, "--output", "exports/base", cwd=tmp_path)
    run_estimax("train", str(task), "--set", "lora=1", "--model-dir", run, "--warm-start", base, cwd=tmp_path)
    args = ("--set", "lora=1", "--model-dir", run, "--base-artifact", "exports/base", "--output", "exports/a")
    path = run_estimax("export", str(task), *args, cwd=tmp_path).strip().splitlines()[-1]
    assert sorted(_stored(path)) == [f"l{i}/lora/lora_{ab}" for i in (1, 2) for ab in "ab"]
    features = {"x": np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)}
    on_base = ex.serving.load(path)(features)["logits"]
    assert not np.allclose(on_base, ex.serving.load(exported.strip().splitlines()[-1])(features)["logits"])
    merged = run_estimax("export", str(task), *args[:4], "--output", "exports/merged", cwd=tmp_path)
    merged = merged.strip().splitlines()[-1]
    np.testing.assert_array_equal(on_base, ex.serving.load(merged)(features)["logits"])  # the merged export's
