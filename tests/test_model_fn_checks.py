"""A model_fn is traced abstractly in every mode a call will use before that call does any work, and
mistakes of the user's input are blamed on the right thing, each an estimax error kind."""

import os
import struct
import warnings

import numpy as np
import optax
import pytest
from flax import nnx
from models import MLP, blobs, mlp, model_fn

import estimax as ex
from estimax.errors import ConfigError, InputError, StorageError
from estimax.examples import mnist


def _estimator(fn=model_fn, model=mlp, **config):
    config.setdefault("train_batch_size", 32)
    return ex.Estimator(model=model, model_fn=fn, optimizer=optax.sgd(0.1), config=ex.RunConfig(**config))


def _mean_loss_fn(model, features, labels, mode, params):
    spec = model_fn(model, features, labels, mode, params)
    return spec if mode == ex.PREDICT else spec._replace(loss=spec.loss.mean())


def _no_predict_branch_fn(model, features, labels, mode, params):
    logits = model(features["x"])
    return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def test_a_mean_loss_is_refused_before_training_wherever_evaluation_pads(model_dir):
    est = _estimator(_mean_loss_fn, model_dir=model_dir)
    train, padded = ex.data.from_arrays(*blobs(256)), ex.data.from_arrays(*blobs(100))
    with pytest.raises(
        ex.ModelFnError,
        match=r"^model_fn returned scalar \['loss'\] in eval mode .*, and its 100 examples in batches of 32 end in "
        r"a batch that is padded \(4 valid rows\): .*Expected per-example values of shape \(32,\)\. Fix: return the "
        r"per-example loss",
    ):
        est.train_and_evaluate(train, padded, max_steps=8, eval_every_steps=4)
    # A model_fn that fails in train mode fails at train()'s start, before the model_dir is touched.
    features, labels = blobs(64)
    with pytest.raises(ex.ModelFnError, match=r"model_fn read features\['x'\] in train mode"):
        est.train(ex.data.from_arrays({"pixels": features["x"]}, labels), max_steps=2)
    assert not os.path.exists(model_dir)  # raised before anything was written: no step ran
    batches = [({"x": features["x"][:32]}, labels[:32])]
    with pytest.raises(ex.ModelFnError, match=r"an input of unknown length \(list\) may end in a short batch"):
        est.evaluate(batches)
    per_example = _estimator(model_dir=model_dir)  # a metric name that does not exist, with plain iterables
    with pytest.raises(ValueError, match=r"Best\(metric='acc'\): not among the evaluation's metrics"):
        per_example.train_and_evaluate(iter(batches * 8), batches, max_steps=8, eval_every_steps=4, best=ex.Best("acc"))
    assert not os.path.exists(model_dir)
    with pytest.raises(ex.ModelFnError, match=r"its 100 examples in batches of 32"):
        est.evaluate(padded)  # at the start: not after evaluating every batch


def test_predict_without_a_predict_branch_is_refused_at_the_call():
    est = _estimator(_no_predict_branch_fn)
    features, _ = blobs(64)
    with pytest.raises(
        ex.ModelFnError,
        match=r"^model_fn raised in predict mode, where labels is None \(.*\): TypeError: .*integer.*; it received "
        r"features \{\['x'\]: float32 \(32, 6\)\}\. Fix: return the predictions before anything that needs labels",
    ):
        est.predict(ex.data.from_arrays(features))  # the call itself, not the first next()
    generator = (({"x": features["x"][i : i + 32]}, None) for i in (0, 32))
    with pytest.raises(ex.ModelFnError, match=r"in predict mode, where labels is None"):
        est.predict(generator)


def _write_idx(directory, split, images, labels):
    for kind, array, magic in (("images", images, 2051), ("labels", labels, 2049)):
        header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
        suffix = "idx3-ubyte" if kind == "images" else "idx1-ubyte"
        (directory / f"{split}-{kind}-{suffix}").write_bytes(header + array.astype(np.uint8).tobytes())


def test_images_of_another_size_are_named_not_the_labels(tmp_path):
    rng = np.random.default_rng(0)
    _write_idx(tmp_path, "train", rng.integers(0, 255, (64, 14, 14)), rng.integers(0, 10, 64))
    with pytest.raises(
        InputError, match=r"train-images-idx3-ubyte: images of 14x14; expected 28x28, the size the model is built"
    ):
        mnist.train_input({"data_dir": str(tmp_path)})
    model_dir = str(tmp_path / "run")
    est = _estimator(mnist.model_fn, mnist.model, model_dir=model_dir)
    with pytest.raises(
        ex.ModelFnError,
        match=r"^model_fn cannot take the input's features in train mode: TypeError: dot_general .*; it fails alike "
        r"without labels \(in predict mode\), so the labels are not the cause; the input has features "
        r"\{\['image'\]: float32 \(32, 14, 14\)\}\. Fix: feed features of the shapes the model was built for",
    ):
        est.train(ex.data.idx.mnist(tmp_path), max_steps=1)
    assert not os.path.exists(model_dir)
    # Labels the loss cannot take are still blamed on the labels.
    features, labels = blobs(64)
    with pytest.raises(ex.ModelFnError, match=r"labels \{array: float32 \(32,\)\}\. Fix: if the loss expects"):
        _estimator().train(ex.data.from_arrays(features, labels.astype(np.float32)), max_steps=1)


class _FactoryClass(nnx.Module):
    def __init__(self, rngs, params):
        self.inner = MLP(rngs)

    def __call__(self, x):
        return self.inner(x)


def test_a_module_class_is_refused_unless_it_is_a_factory():
    with pytest.raises(
        ConfigError,
        match=r"^Estimator\(model=MLP\) received the class MLP; expected an NNX factory .*Fix: model=lambda rngs, "
        r"params: MLP\(rngs=rngs\)\.$",
    ):
        _estimator(model=MLP)
    assert _estimator(model=_FactoryClass).state_shapes().params["inner"]["l1"]["kernel"].shape == (6, 32)


def test_a_model_dir_that_cannot_be_a_directory_is_refused_at_construction(tmp_path, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    with pytest.raises(ConfigError, match=rf"^RunConfig\(model_dir='{a_file}'\) is a file; expected a directory"):
        _estimator(model_dir=str(a_file))
    with pytest.raises(ConfigError, match=rf"model_dir='{a_file}/run'\) lies below {a_file}, which is a file"):
        _estimator(model_dir=str(a_file / "run"))
    assert a_file.read_text() == "kept"
    monkeypatch.delenv("ESTIMAX_TEST_UNSET", raising=False)
    with pytest.raises(
        ConfigError,
        match=r"model_dir='\$ESTIMAX_TEST_UNSET/run'\) refers to \$ESTIMAX_TEST_UNSET, not set in this environment; "
        r".*Fix: export ESTIMAX_TEST_UNSET=\.\.\.",
    ):
        _estimator(model_dir="$ESTIMAX_TEST_UNSET/run")
    monkeypatch.chdir(tmp_path)
    assert not os.path.exists(tmp_path / "$ESTIMAX_TEST_UNSET")
    monkeypatch.setenv("ESTIMAX_TEST_RUNS", str(tmp_path / "runs"))
    assert _estimator(model_dir="${ESTIMAX_TEST_RUNS}/run").run_dir.url == str(tmp_path / "runs" / "run")


def test_best_takes_mode_as_a_deprecated_alias_of_direction():
    with pytest.warns(DeprecationWarning, match=r"Best\(mode='max'\) is deprecated; pass Best\(direction='max'\)"):
        best = ex.Best("score", mode="max")
    assert best == ex.Best("score", direction="max")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigError, match=r"Best\(direction='min', mode='max'\); expected one of them"):
            ex.Best("score", direction="min", mode="max")


def test_export_to_a_missing_bucket_names_the_url(s3):
    features, _ = blobs(8)
    with pytest.raises(
        StorageError, match=r"^s3://absent-bucket/model: bucket 'absent-bucket' does not exist .*Fix: create it"
    ):
        with pytest.warns(ex.UntrainedWarning):
            _estimator().export("s3://absent-bucket/model", example_features={"x": features["x"][:1]})


def test_each_mode_and_batch_shape_is_traced_once_per_estimator():
    # A second call with the input's shapes traces the model_fn neither for its checks nor to compile.
    modes = []

    def counting_fn(model, features, labels, mode, params):
        modes.append(mode)
        return model_fn(model, features, labels, mode, params)

    est = _estimator(counting_fn, steps_per_loop=4)
    data = ex.data.from_arrays(*blobs(256))
    est.train(data, steps=4)
    est.evaluate(data)
    traced = len(modes)
    est.train(data, steps=4)
    est.evaluate(data)
    assert len(modes) == traced
    est.train(ex.data.from_arrays({"x": np.zeros((256, 6), np.float32)}, np.zeros(256, np.int32)), steps=4)
    assert len(modes) == traced  # the same shapes from another input
    features, labels = blobs(64)
    est.evaluate(ex.data.from_arrays({"x": features["x"].astype(np.float16)}, labels))  # another dtype is traced
    assert len(modes) > traced
