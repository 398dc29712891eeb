"""Export: a trained model with batch norm and dropout, loaded in a fresh process without its code.

The model's module is written to a temporary directory, imported, trained on
8 simulated devices and exported; then the directory is deleted and a new
Python process (no model module on its path, one device) loads the artifact
with ``estimax.serving`` and must reproduce ``est.predict()``.
"""

import dataclasses
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import jax
import jaxlib
import numpy as np
import pytest
from helpers import compiler_flags, user_env
from jax.sharding import PartitionSpec as P

import estimax as ex
from estimax import serving
from estimax.serving import artifact as artifact_lib
from estimax.serving import export as export_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = "exported_model_under_test"
MODEL_SOURCE = """
import jax.numpy as jnp
import optax
from flax import nnx

import estimax as ex


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(6, 256, rngs=rngs)
        self.bn = nnx.BatchNorm(256, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.hidden = nnx.Linear(256, 256, rngs=rngs)
        self.l2 = nnx.Linear(256, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.hidden(self.drop(nnx.relu(self.bn(self.l1(x)))))))


def model_fn(model, features, labels, mode, params):
    x = features["x"] + features["shift"][:, None].astype(jnp.float32)
    logits = model(x)
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"logits": logits, "class": logits.argmax(-1)})
    return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels))
"""


def _features(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 6)).astype(np.float32), "shift": rng.integers(-2, 3, size=n).astype(np.int32)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(estimator, artifact path, predict inputs, est.predict outputs)``; the model module deleted."""
    base = tmp_path_factory.mktemp("export")
    code = base / "code"
    code.mkdir()
    (code / f"{MODULE}.py").write_text(MODEL_SOURCE)
    sys.path.insert(0, str(code))
    try:
        module = importlib.import_module(MODULE)
        est = ex.Estimator(
            model=lambda rngs, params: module.Net(rngs),
            model_fn=module.model_fn,
            optimizer=__import__("optax").adam(1e-2),
            config=ex.RunConfig(model_dir=str(base / "run"), train_batch_size=32, steps_per_loop=5, quiet=True),
        )
        features = _features(256)
        labels = (features["x"][:, 0] > 0).astype(np.int32) + (features["shift"] > 0)
        est.train(ex.data.from_arrays(features, labels), max_steps=10)
        path = est.export(str(base / "artifact"))  # the shapes of the training input
    finally:
        sys.path.remove(str(code))
        sys.modules.pop(MODULE, None)
        shutil.rmtree(code)
    inputs = _features(64, seed=1)
    return est, path, inputs, _predict(est, inputs)


def _predict(est, features, **config):
    """``est.predict()`` as arrays; ``config`` changes RunConfig (same model_dir: the same checkpoint)."""
    if config:
        config = dataclasses.replace(est.config, **config)
        est = ex.Estimator(est.core.adapter, est.core.model_fn, est.core.optimizer, config=config)
    rows = list(est.predict(ex.data.from_arrays(features)))
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


LOADER = textwrap.dedent(
    """
    import importlib.util, json, sys
    import numpy as np
    from estimax import serving

    inputs = dict(np.load(sys.argv[2]))
    model = serving.load(sys.argv[1])
    out = {}
    for n in (1, 7, 64, 0):
        for k, v in model({k: v[:n] for k, v in inputs.items()}).items():
            out[f"{k}@{n}"] = v
    np.savez(sys.argv[3], **out)
    print(json.dumps({
        "flax": "flax" in sys.modules,
        "model_module": importlib.util.find_spec(sys.argv[4]) is not None,
        "devices": len(__import__("jax").devices()),
    }))
    """
)


def test_fresh_process_without_the_model_code_equals_predict(trained, tmp_path):
    """Bitwise equal to predict() with the same batch on one device; 8 devices with 4 rows each
    sum in another order (float32 rounding)."""
    est, path, inputs, expected = trained
    np.savez(tmp_path / "inputs.npz", **inputs)
    env = user_env("PYTHONPATH", XLA_FLAGS=compiler_flags())  # compiled as here: bitwise comparable
    env["PYTHONPATH"] = ROOT  # estimax only: the model's directory is gone anyway
    result = subprocess.run(
        [sys.executable, "-c", LOADER, path, str(tmp_path / "inputs.npz"), str(tmp_path / "out.npz"), MODULE],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts == {"flax": False, "model_module": False, "devices": 1}
    out = np.load(tmp_path / "out.npz")
    for n in (1, 7, 64):
        one_device = _predict(est, {k: v[:n] for k, v in inputs.items()}, num_devices=1, predict_batch_size=n)
        np.testing.assert_array_equal(out[f"logits@{n}"], one_device["logits"])
        np.testing.assert_array_equal(out[f"class@{n}"], expected["class"][:n])
        np.testing.assert_allclose(out[f"logits@{n}"], expected["logits"][:n], rtol=1e-6, atol=1e-6)
    assert out["logits@0"].shape == (0, 3) and out["logits@0"].dtype == np.float32
    assert out["class@0"].shape == (0,) and out["class@0"].dtype == expected["class"].dtype


def test_artifact_layout_and_signature(trained):
    est, path, _, _ = trained
    signature = json.load(open(os.path.join(path, export_lib.SIGNATURE)))
    assert signature["platforms"] == ["cpu", "cuda", "tpu"]
    assert signature["step"] == 10 and signature["nr_devices"] == 1
    assert signature["inputs"] == {
        "x": {"dtype": "float32", "shape": ["b", 6]},
        "shift": {"dtype": "int32", "shape": ["b"]},
    }
    assert signature["outputs"]["logits"] == {"dtype": "float32", "shape": ["b", 3]}
    assert {"l1/kernel", "bn/mean", "bn/var", "bn/scale", "l2/bias"} <= set(signature["param_arrays"])
    assert set(signature["versions"]) == {"jax", "jaxlib", "estimax"}
    param_bytes = sum(np.prod(a["shape"]) * 4 for a in signature["param_arrays"].values())
    program_bytes = os.path.getsize(os.path.join(path, export_lib.PROGRAM))
    weights = np.asarray(jax.device_get(est.model().hidden.kernel[...]))
    assert weights[:4].tobytes() not in open(os.path.join(path, export_lib.PROGRAM), "rb").read()
    assert program_bytes < param_bytes / 10, (program_bytes, param_bytes)  # parameters are arguments


def test_a_sharded_model_exports_whole_arrays(trained, tmp_path):
    """The same checkpoint restored with FSDP and tensor-parallel shardings gives the same artifact."""
    est, path, inputs, _ = trained
    config = dataclasses.replace(
        est.config,
        mesh={"data": 2, "fsdp": 2, "model": 2},
        sharding_rules=[(r"hidden/kernel", (None, "model"))],
        fsdp_min_bytes=0,
    )
    sharded = ex.Estimator(est.core.adapter, est.core.model_fn, est.core.optimizer, config=config)
    kernel = sharded.state().params["hidden"]["kernel"].get_value()
    assert kernel.sharding.spec == P("fsdp", "model")
    out = serving.load(sharded.export(str(tmp_path / "sharded"), example_features=inputs))(inputs)
    np.testing.assert_array_equal(out["logits"], serving.load(path)(inputs)["logits"])


def test_example_features_and_a_clear_error_without_them(trained, tmp_path):
    est, _, inputs, expected = trained
    fresh = ex.Estimator(
        model=est.core.adapter, model_fn=est.core.model_fn, optimizer=est.core.optimizer, config=est.config
    )
    with pytest.raises(ValueError, match=r"export\(\) needs the shape and dtype of each feature.*example_features="):
        fresh.export(str(tmp_path / "none"))
    spec = {k: jax.ShapeDtypeStruct((5, *v.shape[1:]), v.dtype) for k, v in inputs.items()}
    path = fresh.export(str(tmp_path / "given"), example_features=spec, checkpoint=10)
    np.testing.assert_array_equal(serving.load(path)(inputs)["class"], expected["class"])


def test_an_earlier_export_is_replaced_and_nothing_else(trained, tmp_path):
    est = trained[0]
    target = str(tmp_path / "a")
    assert est.export(target) == target and est.export(target) == target
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no staging directory left behind
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"b is a non-empty directory that is not an estimax export.*Fix"):
        est.export(str(tmp_path / "b"))
    assert (tmp_path / "b" / "notes.txt").read_text() == "mine"


def test_branching_on_the_batch_size_is_a_clear_error(tmp_path):
    import optax
    from flax import nnx

    def branching_model_fn(model, features, labels, mode, params):
        if params["batch_size"] > 8:
            return ex.Spec(predictions=model(features))
        return ex.Spec(predictions=model(features) * 2)

    est = ex.Estimator(lambda rngs, params: nnx.Linear(3, 2, rngs=rngs), branching_model_fn, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"model_fn .*branching_model_fn cannot be exported.*batch_size.*Fix"):
        est.export(str(tmp_path / "a"), example_features=np.zeros((2, 3), np.float32))


def test_one_array_in_one_array_out(tmp_path):
    import optax
    from flax import nnx

    def model_fn(model, features, labels, mode, params):
        return ex.Spec(predictions=model(features))

    est = ex.Estimator(lambda rngs, params: nnx.Linear(3, 2, rngs=rngs), model_fn, optax.sgd(0.1))
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    expected = np.stack(list(est.predict(ex.data.from_arrays(x))))
    model = serving.load(est.export(str(tmp_path / "a")))
    assert model.signature["inputs"] == {"features": {"dtype": "float32", "shape": ["b", 3]}}
    np.testing.assert_array_equal(model(x), expected)
    np.testing.assert_array_equal(model({"features": x.astype(np.float64)}), expected)


# -- the loader's checks --------------------------------------------------------------------


def test_inputs_are_checked_against_the_signature(trained):
    _, path, inputs, expected = trained
    model = serving.load(path)
    with pytest.raises(ValueError, match=r"missing \['shift'\].*Expected exactly \['shift', 'x'\]"):
        model({"x": inputs["x"]})
    with pytest.raises(ValueError, match=r"unexpected \['y'\]"):
        model({**inputs, "y": inputs["x"]})
    with pytest.raises(ValueError, match=r"Feature 'x' has shape \(64, 5\); the signature says float32\[b, 6\]"):
        model({**inputs, "x": inputs["x"][:, :5]})
    with pytest.raises(TypeError, match=r"Feature 'shift' has dtype float64; the signature says int32\[b\].*lose"):
        model({**inputs, "shift": inputs["shift"] + 0.5})
    with pytest.raises(ValueError, match=r"Feature 'shift' has int64 values that do not fit int32 .*4294967296"):
        model({**inputs, "shift": np.full(64, 2**32, np.int64)})
    with pytest.raises(ValueError, match=r"different batch sizes"):
        model({**inputs, "shift": inputs["shift"][:3]})
    # Safe casts: float64 and int64 values that fit give the same answer.
    out = model({"x": inputs["x"].astype(np.float64), "shift": inputs["shift"].astype(np.int64)})
    np.testing.assert_array_equal(out["class"], expected["class"])


@pytest.fixture
def artifact_copy(trained, tmp_path):
    path = str(tmp_path / "copy")
    shutil.copytree(trained[1], path)
    return path


def test_truncated_program_is_an_error_naming_the_file(artifact_copy):
    program = os.path.join(artifact_copy, export_lib.PROGRAM)
    data = open(program, "rb").read()
    open(program, "wb").write(data[: len(data) // 2])
    with pytest.raises(serving.ArtifactError, match=rf"{program} differs from what was exported.*truncated"):
        serving.load(artifact_copy)


def test_altered_params_are_an_error_naming_the_array(artifact_copy):
    params = os.path.join(artifact_copy, export_lib.PARAMS)
    signature = json.load(open(os.path.join(artifact_copy, "signature.json")))
    arrays = artifact_lib.read_params(params, signature["param_arrays"])
    arrays["bn/mean"] = arrays["bn/mean"] + 1
    shutil.rmtree(params)
    export_lib.save_params(params, arrays)
    with pytest.raises(serving.ArtifactError, match=rf"{params}: array 'bn/mean' differs from what was exported"):
        serving.load(artifact_copy)


def test_truncated_params_are_an_error_naming_the_directory(artifact_copy):
    params = os.path.join(artifact_copy, export_lib.PARAMS)
    for root, _, files in os.walk(params):
        for name in files:
            if "manifest" in name or name.endswith(".ocdbt") or root.endswith("d"):
                open(os.path.join(root, name), "r+b").truncate(7)
    with pytest.raises(serving.ArtifactError, match=rf"{params}"):
        serving.load(artifact_copy)


def test_altered_or_missing_signature_is_an_error(artifact_copy):
    file = os.path.join(artifact_copy, export_lib.SIGNATURE)
    signature = json.load(open(file))
    signature["inputs"]["x"]["shape"] = ["b", 7]
    json.dump(signature, open(file, "w"))
    with pytest.raises(serving.ArtifactError, match=r"signature.json does not match model.jaxexport.*'inputs'"):
        serving.load(artifact_copy)
    open(file, "w").write('{"format": ')
    with pytest.raises(serving.ArtifactError, match=rf"{file} is not valid JSON"):
        serving.load(artifact_copy)
    os.remove(file)
    with pytest.raises(serving.ArtifactError, match=rf"{file} is missing"):
        serving.load(artifact_copy)


def test_a_jaxlib_outside_the_window_warns(artifact_copy):
    file = os.path.join(artifact_copy, export_lib.SIGNATURE)
    signature = json.load(open(file))
    signature["versions"]["jaxlib"] = "0.4.30"
    json.dump(signature, open(file, "w"))
    with pytest.warns(RuntimeWarning, match=r"exported with jaxlib 0.4.30; this is jaxlib .*newer than jax.export"):
        serving.load(artifact_copy)
    signature["versions"]["jaxlib"] = "99.0.0"
    json.dump(signature, open(file, "w"))
    with pytest.warns(RuntimeWarning, match=r"exported with jaxlib 99.0.0; this is jaxlib .*older than jax.export"):
        serving.load(artifact_copy)
    signature["versions"]["jaxlib"] = jaxlib.__version__
    json.dump(signature, open(file, "w"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        serving.load(artifact_copy)


def test_cli_export_of_the_digits_example(tmp_path, capsys):
    from estimax import cli
    from estimax.examples import digits

    model_dir = str(tmp_path / "run")
    config = ex.RunConfig(model_dir=model_dir, train_batch_size=64, steps_per_loop=2, quiet=True)
    digits.estimator(config).train(digits.load()[0], max_steps=2)
    output = str(tmp_path / "exports" / "digits")
    assert cli.main(["export", "--model-dir", model_dir, "--output", output, "--checkpoint", "2"]) == 0
    assert capsys.readouterr().out.strip() == output
    model = serving.load(str(tmp_path / "exports" / "digits"))
    assert model.step == 2 and model.signature["inputs"] == {"image": {"dtype": "float32", "shape": ["b", 8, 8]}}


def test_random_numbers_in_predict_mode_are_refused(tmp_path):
    import optax
    from flax import nnx

    class Noisy(nnx.Module):
        def __init__(self, rngs):
            self.dense, self.rngs = nnx.Linear(3, 2, rngs=rngs), rngs

        def __call__(self, x):
            return self.dense(x) + jax.random.normal(self.rngs.noise(), (x.shape[0], 2))

    def noisy_model_fn(model, features, labels, mode, params):
        return ex.Spec(predictions=model(features))

    est = ex.Estimator(lambda rngs, params: Noisy(nnx.Rngs(0, noise=1)), noisy_model_fn, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"noisy_model_fn draws random numbers in PREDICT mode.*Fix"):
        est.export(str(tmp_path / "a"), example_features=np.zeros((2, 3), np.float32))
    assert not os.path.exists(tmp_path / "a")


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is not None, reason="TensorFlow is installed")
def test_tf_saved_model_without_tensorflow_names_the_extra(trained, tmp_path):
    with pytest.raises(ImportError, match=r"format='tf_saved_model'\) needs TensorFlow.*pip install 'estimax\[tf\]'"):
        trained[0].export(str(tmp_path / "tf"), format="tf_saved_model")
    with pytest.raises(ValueError, match=r"export\(format='onnx'\); expected 'jax'"):
        trained[0].export(str(tmp_path / "tf"), format="onnx")
