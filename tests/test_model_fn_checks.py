"""A model_fn is traced abstractly in every mode a call will use before that call does any work, and
mistakes of the user's input are blamed on the right thing, each an estimax error kind."""

import os
import warnings

import numpy as np
import pytest
from flax import nnx
from helpers import mean_loss_fn, no_predict_branch_fn, sgd_estimator, write_idx
from models import MLP, blobs, model_fn

import estimax as ex
from estimax.errors import ConfigError, InputError, StorageError
from estimax.examples import mnist


def test_a_mean_loss_is_refused_before_training_wherever_evaluation_pads(model_dir):
    est = sgd_estimator(mean_loss_fn, model_dir=model_dir)
    train, padded = ex.data.from_arrays(*blobs(256)), ex.data.from_arrays(*blobs(100))
    with pytest.raises(
        ex.ModelFnError,
        match=r"^model_fn returned scalar \['loss'\] in eval mode .*, and its 100 examples in batches of 32 end in "
        r"a batch that is padded \(4 valid rows\): .*Expected per-example values of shape \(32,\)\. Fix: return the "
        r"per-example loss",
    ):
        est.train_and_evaluate(train, padded, max_steps=8, eval_every=4)
    # A model_fn that fails in train mode fails at train()'s start, before the model_dir is touched.
    features, labels = blobs(64)
    with pytest.raises(ex.ModelFnError, match=r"model_fn read features\['x'\] in train mode"):
        est.train(ex.data.from_arrays({"pixels": features["x"]}, labels), max_steps=2)
    assert not os.path.exists(model_dir)  # raised before anything was written: no step ran
    batches = [({"x": features["x"][:32]}, labels[:32])]
    with pytest.raises(ex.ModelFnError, match=r"an input of unknown length \(list\) may end in a short batch"):
        est.evaluate(batches)
    per_example = sgd_estimator(model_dir=model_dir)  # a metric name that does not exist, with plain iterables
    with pytest.raises(ValueError, match=r"Best\(metric='acc'\): not among the evaluation's metrics"):
        per_example.train_and_evaluate(iter(batches * 8), batches, max_steps=8, eval_every=4, best=ex.Best("acc"))
    assert not os.path.exists(model_dir)
    with pytest.raises(ex.ModelFnError, match=r"its 100 examples in batches of 32"):
        est.evaluate(padded)  # at the start: not after evaluating every batch


def test_predict_without_a_predict_branch_is_refused_at_the_call():
    est = sgd_estimator(no_predict_branch_fn)
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


def test_images_of_another_size_are_named_not_the_labels(tmp_path):
    rng = np.random.default_rng(0)
    write_idx(tmp_path, "train", rng.integers(0, 255, (64, 14, 14)), rng.integers(0, 10, 64))
    with pytest.raises(
        InputError, match=r"train-images-idx3-ubyte: images of 14x14; expected 28x28, the size the model is built"
    ):
        mnist.train_input({"data_dir": str(tmp_path)})
    model_dir = str(tmp_path / "run")
    est = sgd_estimator(mnist.model_fn, mnist.model, model_dir=model_dir)
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
        sgd_estimator().train(ex.data.from_arrays(features, labels.astype(np.float32)), max_steps=1)


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
        sgd_estimator(model=MLP)
    assert sgd_estimator(model=_FactoryClass).state_shapes().params["inner"]["l1"]["kernel"].shape == (6, 32)


def test_a_model_dir_that_cannot_be_a_directory_is_refused_at_construction(tmp_path, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    with pytest.raises(ConfigError, match=rf"^RunConfig\(model_dir='{a_file}'\) is a file; expected a directory"):
        sgd_estimator(model_dir=str(a_file))
    with pytest.raises(ConfigError, match=rf"model_dir='{a_file}/run'\) lies below {a_file}, which is a file"):
        sgd_estimator(model_dir=str(a_file / "run"))
    assert a_file.read_text() == "kept"
    monkeypatch.delenv("ESTIMAX_TEST_UNSET", raising=False)
    with pytest.raises(
        ConfigError,
        match=r"model_dir='\$ESTIMAX_TEST_UNSET/run'\) refers to \$ESTIMAX_TEST_UNSET, not set in this environment; "
        r".*Fix: export ESTIMAX_TEST_UNSET=\.\.\.",
    ):
        sgd_estimator(model_dir="$ESTIMAX_TEST_UNSET/run")
    monkeypatch.chdir(tmp_path)
    assert not os.path.exists(tmp_path / "$ESTIMAX_TEST_UNSET")
    monkeypatch.setenv("ESTIMAX_TEST_RUNS", str(tmp_path / "runs"))
    assert sgd_estimator(model_dir="${ESTIMAX_TEST_RUNS}/run").run_dir.url == str(tmp_path / "runs" / "run")


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
            sgd_estimator().export("s3://absent-bucket/model", example_features={"x": features["x"][:1]})


def test_each_mode_and_batch_shape_is_traced_once_per_estimator():
    # A second call with the input's shapes traces the model_fn neither for its checks nor to compile.
    modes = []

    def counting_fn(model, features, labels, mode, params):
        modes.append(mode)
        return model_fn(model, features, labels, mode, params)

    est = sgd_estimator(counting_fn, steps_per_loop=4)
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
