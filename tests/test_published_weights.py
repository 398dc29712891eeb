"""Starting from published weights: files written by other libraries' own writers (safetensors,
Keras 3, Flax, Orbax) loaded into an estimax model through ``WarmStart``, compared with the
arrays those libraries wrote, and the mistakes of a warm start each reported on one line."""

import os

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from models import blobs, estimator

import estimax as ex
from estimax.state import leaf_names

FEATURES, LABELS = blobs(64)
DATA = ex.data.from_arrays(FEATURES, LABELS)
RNG = np.random.default_rng(7)


def _params(est) -> dict[str, np.ndarray]:
    params = est.state().params
    return {n: np.asarray(x) for n, x in zip(leaf_names(params), jax.tree.leaves(params), strict=True)}


def _reference_loss(w1, b1, w2, b2) -> float:
    """The mean cross-entropy of the MLP of ``tests/models.py`` on DATA, in float64 numpy."""
    hidden = np.maximum(FEATURES["x"].astype(np.float64) @ w1 + b1, 0)
    logits = hidden @ w2 + b2
    logits = logits - logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-log_probs[np.arange(len(LABELS)), LABELS].mean())


def _torch_style_arrays(dtype=np.float32) -> dict[str, np.ndarray]:
    """An MLP 6-32-3 as PyTorch names and lays it out: Linear weights (out, in)."""
    return {
        "encoder.weight": RNG.normal(size=(32, 6)).astype(dtype),
        "encoder.bias": RNG.normal(size=(32,)).astype(dtype),
        "classifier.weight": RNG.normal(size=(3, 32)).astype(dtype),
        "classifier.bias": RNG.normal(size=(3,)).astype(dtype),
        "pooler.weight": RNG.normal(size=(4, 4)).astype(dtype),
    }


TORCH_NAMES = {r"^l1/kernel$": "encoder.weight", r"^l1/bias$": "encoder.bias"}
TORCH_NAMES |= {r"^l2/kernel$": "classifier.weight", r"^l2/bias$": "classifier.bias"}


def test_a_safetensors_file_in_bfloat16_with_pytorch_names_and_layout_starts_training(tmp_path):
    import safetensors.numpy

    arrays = _torch_style_arrays(ml_dtypes.bfloat16)
    path = str(tmp_path / "model.safetensors")
    safetensors.numpy.save_file(arrays, path)
    warm = ex.WarmStart(path, rename=TORCH_NAMES, transpose=[".*/kernel"])

    est = estimator(str(tmp_path / "run"), optimizer=optax.sgd(0.05), warm_start=warm, dropout=0.0)
    plan = warm.plan(est.state_shapes().params)
    assert plan.loaded == [
        ("l1/bias", "encoder.bias"),
        ("l1/kernel", "encoder.weight"),
        ("l2/bias", "classifier.bias"),
        ("l2/kernel", "classifier.weight"),
    ]
    assert plan.skipped == ["pooler.weight"] and plan.initialised == [] and plan.problems == ()
    assert plan.notes["l1/kernel"] == "transposed; bfloat16 -> float32"  # bf16 into float32 is exact
    assert str(plan).startswith(f"warm start from {path} (safetensors): 4 loaded, 1 skipped, 0 left at")
    assert "  load  l1/kernel  <- encoder.weight  (transposed; bfloat16 -> float32)" in str(plan)

    loaded = _params(est)
    expected = {
        "l1/kernel": arrays["encoder.weight"].T,
        "l1/bias": arrays["encoder.bias"],
        "l2/kernel": arrays["classifier.weight"].T,
        "l2/bias": arrays["classifier.bias"],
    }
    for name, array in expected.items():
        assert loaded[name].dtype == np.float32
        np.testing.assert_array_equal(loaded[name], array.astype(np.float32))
    reference = _reference_loss(
        *(expected[n].astype(np.float64) for n in ("l1/kernel", "l1/bias", "l2/kernel", "l2/bias"))
    )
    np.testing.assert_allclose(est.evaluate(DATA)["loss"], reference, rtol=1e-5)
    est.train(DATA, max_steps=4)
    assert est.evaluate(DATA)["loss"] < reference  # training went on from the file's weights
    assert not np.array_equal(_params(est)["l1/kernel"], loaded["l1/kernel"])


def test_a_keras_weights_h5_file_loads_by_layer_name_and_variable_index(tmp_path):
    import keras

    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(32, activation="relu", name="body")(inputs)
    outputs = keras.layers.Dense(3, name="head")(keras.layers.BatchNormalization(name="norm")(hidden))
    model = keras.Model(inputs, outputs)
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    by_path = {v.path: np.asarray(v.value) for v in model.weights}

    # Keras keeps no variable names: a Dense layer's kernel is its variable 0, its bias 1
    warm = ex.WarmStart(path, rename={r"^l1/kernel$": "body/0", r"^l1/bias$": "body/1"})
    est = estimator(warm_start=warm)
    plan = warm.plan(est.state_shapes().params)
    assert plan.loaded == [("l1/bias", "body/1"), ("l1/kernel", "body/0")]
    assert plan.skipped == ["head/0", "head/1", "norm/0", "norm/1", "norm/2", "norm/3"]
    assert plan.initialised == ["l2/bias", "l2/kernel"]  # no l2/... in the file: left at initialisation
    loaded = _params(est)
    np.testing.assert_array_equal(loaded["l1/kernel"], by_path["body/kernel"])
    np.testing.assert_array_equal(loaded["l1/bias"], by_path["body/bias"])

    model.save(str(tmp_path / "model.keras"))  # the whole model: a zip holding model.weights.h5
    archive = ex.WarmStart(str(tmp_path / "model.keras"), rename=warm.rename)
    plan = archive.plan(est.state_shapes().params)
    assert plan.loaded == [("l1/bias", "body/1"), ("l1/kernel", "body/0")] and plan.source.endswith("(keras archive)")


def test_a_flax_msgpack_file_of_linen_parameters(tmp_path):
    from flax import linen as nn
    from flax import serialization

    class LinenMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            hidden = nn.relu(nn.Dense(32)(x))  # Dense_0
            return nn.Dense(3)(hidden)  # Dense_1

    variables = LinenMLP().init(jax.random.key(3), np.zeros((1, 6), np.float32))
    path = str(tmp_path / "linen.msgpack")
    with open(path, "wb") as f:
        f.write(serialization.to_bytes(variables))

    warm = ex.WarmStart(path, rename={"^l1/": "params/Dense_0/", "^l2/": "params/Dense_1/"})
    est = estimator(warm_start=warm)
    plan = warm.plan(est.state_shapes().params)
    assert [s for _, s in plan.loaded] == [
        "params/Dense_0/bias",
        "params/Dense_0/kernel",
        "params/Dense_1/bias",
        "params/Dense_1/kernel",
    ]
    loaded = _params(est)
    for layer, dense in (("l1", "Dense_0"), ("l2", "Dense_1")):
        for leaf in ("kernel", "bias"):
            np.testing.assert_array_equal(loaded[f"{layer}/{leaf}"], np.asarray(variables["params"][dense][leaf]))


def test_another_projects_orbax_checkpoints_a_pytree_and_a_managers_latest_step(tmp_path):
    import orbax.checkpoint as ocp

    first = {"model": {"dense": {"w": RNG.normal(size=(6, 32)).astype(np.float32)}}, "epoch": 3}
    ocp.PyTreeCheckpointer().save(str(tmp_path / "pytree"), first)
    warm = ex.WarmStart(str(tmp_path / "pytree"), include=["l1/kernel"], rename={"l1/kernel": "model/dense/w"})
    plan = warm.plan(estimator().state_shapes().params)
    assert plan.loaded == [("l1/kernel", "model/dense/w")] and plan.skipped == ["epoch"]
    np.testing.assert_array_equal(_params(estimator(warm_start=warm))["l1/kernel"], first["model"]["dense"]["w"])

    with ocp.CheckpointManager(str(tmp_path / "manager")) as manager:
        for step in (10, 20):
            tree = {"model": {"dense": {"w": np.full((6, 32), step, np.float32)}}}
            manager.save(step, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    warm = ex.WarmStart(str(tmp_path / "manager"), include=["l1/kernel"], rename={"l1/kernel": "model/dense/w"})
    np.testing.assert_array_equal(_params(estimator(warm_start=warm))["l1/kernel"], np.full((6, 32), 20.0))
    step_10 = ex.WarmStart(str(tmp_path / "manager" / "10"), include=["l1/kernel"], rename=warm.rename)
    assert f"warm start from {tmp_path / 'manager' / '10' / 'default'} (orbax): 1 loaded" in str(
        step_10.plan(estimator().state_shapes().params)
    )


def test_each_mistake_is_one_line_naming_the_parameter(tmp_path):
    import safetensors.numpy

    arrays = {
        "encoder.weight": np.ones((32, 6), np.float32),  # PyTorch's layout, no transpose asked
        "encoder.bias": np.ones((32,), np.complex64),  # complex into float32 loses the imaginary part
        "classifier.weight": np.ones((32, 4), np.float32),  # 4 classes, the model has 3
        "classifier.bias": np.ones((3,), np.float64),  # narrower: loads, with a note
    }
    path = str(tmp_path / "model.safetensors")
    safetensors.numpy.save_file(arrays, path)
    rename = dict(TORCH_NAMES) | {r"^l1/bias$": "encoder.biases"}  # a name the file does not hold
    warm = ex.WarmStart(path, rename=rename)
    shapes = estimator().state_shapes().params
    plan = warm.plan(shapes)
    assert plan.loaded == [("l2/bias", "classifier.bias")] and plan.notes == {"l2/bias": "float64 -> float32, inexact"}
    assert plan.problems == (
        "parameter l1/bias is renamed to encoder.biases by rename['^l1/bias$'], which the file does not hold "
        "(close: encoder.bias, encoder.weight). Fix: correct the rule, or exclude it, e.g. exclude=['l1/bias'].",
        "parameter l1/kernel has shape (6, 32) but encoder.weight in the file has shape (32, 6): transposed? "
        "Fix: WarmStart(..., transpose=['l1/kernel']).",
        "parameter l2/kernel has shape (32, 3) but classifier.weight in the file has shape (32, 4). "
        "Fix: exclude it, e.g. exclude=['l2/.*'].",
    )
    assert (
        str(plan).splitlines()[0]
        == f"warm start from {path} (safetensors): 1 loaded, 1 skipped, 0 left at initialisation, 3 cannot load"
    )
    with pytest.raises(ex.CheckpointError, match=r"3 parameter\(s\) cannot load:\nparameter l1/bias .*\n") as raised:
        _ = estimator(warm_start=warm).step
    assert len(str(raised.value).splitlines()) == 4

    bias_only = ex.WarmStart(path, include=["l1/bias"], rename={"l1/bias": "encoder.bias"})
    (line,) = bias_only.plan(shapes).problems
    assert line.startswith("parameter l1/bias is float32 but encoder.bias in the file is complex64: a cast")

    too_many = ex.WarmStart(path, include=["l2/kernel"], rename=TORCH_NAMES, transpose=["l2/kernel"])
    (line,) = too_many.plan(shapes).problems
    assert line == (
        "parameter l2/kernel has shape (32, 3) but classifier.weight in the file has shape (32, 4). "
        "Fix: exclude it, e.g. exclude=['l2/.*']."
    )  # transposed, (4, 32) fits no better: the file's shape is named
    safetensors.numpy.save_file({"w": np.ones((6, 32), np.float32)}, str(tmp_path / "flax-layout.safetensors"))
    needless = ex.WarmStart(
        str(tmp_path / "flax-layout.safetensors"),
        include=["l1/kernel"],
        rename={"l1/kernel": "w"},
        transpose=["l1/kernel"],
    )
    (line,) = needless.plan(shapes).problems
    assert line == (
        "parameter l1/kernel has shape (6, 32), as w in the file has, but transpose turns it into (32, 6). "
        "Fix: leave l1/kernel out of WarmStart(transpose=...)."
    )
    transposed = ex.WarmStart(path, include=["l1/kernel"], rename=TORCH_NAMES, transpose={"l1/kernel": (1, 0, 2)})
    (line,) = transposed.plan(shapes).problems
    assert line.startswith("parameter l1/kernel: transpose axes (1, 0, 2) do not order the 2 axes of encoder.weight")


def test_files_it_cannot_read_are_named_with_the_fix(tmp_path, monkeypatch):
    pickle = tmp_path / "pytorch_model.bin"
    pickle.write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(ex.CheckpointError, match=r"pytorch_model.bin is a pickle .* safetensors.torch.save_file"):
        ex.WarmStart(str(pickle)).plan({})
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(ex.CheckpointError, match=r"hub/pytorch_model.bin is a pickle"):
        ex.WarmStart(str(tmp_path / "hub")).plan({})
    unknown = tmp_path / "weights.dat"
    unknown.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ex.CheckpointError, match=r"weights.dat is a file of an unknown format \(it starts with b'GGUF"):
        ex.WarmStart(str(unknown)).plan({})
    with pytest.raises(
        ex.ConfigTypeError, match=r"WarmStart\(transpose='l1/kernel'\): a string.*transpose=\['l1/kernel'\]"
    ):
        ex.WarmStart(str(unknown), transpose="l1/kernel")

    monkeypatch.setitem(__import__("sys").modules, "safetensors", None)  # as if it were not installed
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ex.MissingLibraryError, match=r"pip install 'estimax\[weights\]'"):
        ex.WarmStart(str(tmp_path / "model.safetensors")).plan({})


def test_a_file_without_a_known_suffix_is_recognised_by_its_content(tmp_path):
    import safetensors.numpy

    path = str(tmp_path / "weights")
    safetensors.numpy.save_file({"l1/kernel": np.ones((6, 32), np.float32)}, path)
    assert os.path.isfile(path)
    plan = ex.WarmStart(path).plan(estimator().state_shapes().params)
    assert plan.loaded == [("l1/kernel", "l1/kernel")] and plan.source == f"{path} (safetensors)"


def test_files_on_a_store_are_read_through_it(tmp_path):
    """A URL's file is read whole through fsspec (here its in-memory store), then by its library."""
    import fsspec
    import safetensors.numpy
    from flax import serialization

    root = f"memory://published-{tmp_path.name}"
    kernel = RNG.normal(size=(6, 32)).astype(np.float32)
    fs = fsspec.filesystem("memory")
    fs.pipe(f"{root}/model.safetensors", safetensors.numpy.save({"l1/kernel": kernel}))
    fs.pipe(f"{root}/model.msgpack", serialization.msgpack_serialize({"l1": {"kernel": kernel}}))
    for name in ("model.safetensors", "model.msgpack"):
        est = estimator(warm_start=ex.WarmStart(f"{root}/{name}", include=["l1/kernel"]))
        np.testing.assert_array_equal(_params(est)["l1/kernel"], kernel)


def test_a_directory_of_safetensors_shards_reads_as_one_file(tmp_path):
    import safetensors.numpy

    kernel, bias = RNG.normal(size=(6, 32)).astype(np.float32), RNG.normal(size=(32,)).astype(np.float32)
    safetensors.numpy.save_file({"l1/kernel": kernel}, str(tmp_path / "model-00001-of-00002.safetensors"))
    safetensors.numpy.save_file({"l1/bias": bias}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    est = estimator(warm_start=ex.WarmStart(str(tmp_path)))
    np.testing.assert_array_equal(_params(est)["l1/kernel"], kernel)
    np.testing.assert_array_equal(_params(est)["l1/bias"], bias)


def test_an_estimax_run_is_still_read_as_one_not_as_another_projects_orbax_checkpoint(tmp_path):
    source = estimator(str(tmp_path / "source"))
    source.train(DATA, max_steps=4)
    trained = _params(source)
    for path in ("source", "source/checkpoints", "source/checkpoints/4"):
        warm = ex.WarmStart(str(tmp_path / path))
        plan = warm.plan(source.state_shapes().params)
        assert plan.source.endswith("(estimax checkpoint)") and len(plan.loaded) == 4, path
    np.testing.assert_array_equal(_params(estimator(warm_start=warm))["l2/kernel"], trained["l2/kernel"])
