"""Named evaluation sets: each set evaluated exactly, recorded under its name, and Best deciding by one."""

import io
import json
import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import warm
from flax import nnx
from helpers import user_env
from models import mlp
from sklearn import metrics as sk

import estimax as ex
from estimax.cli import task as task_lib

# The metrics come from the features; the model is evaluated untrained on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:Estimator.evaluate\\(\\) uses the initial, untrained weights")

C = 4
EVAL_BATCH = 16  # 96 examples fill 6 batches; 37 end in a batch of 5 valid rows and 11 padded ones


def _set(n: int, seed: int):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, C, n).astype(np.int32)
    features = {
        "x": rng.normal(size=(n, 6)).astype(np.float32),
        "logits": (rng.normal(size=(n, C)) + 1.2 * np.eye(C)[labels]).astype(np.float32),
        "value": rng.normal(size=n).astype(np.float32) * 3,
        "present": np.ones(n, np.float32),  # padding rows are zeros: the model_fn poisons them
    }
    return features, labels


VAL, TEST = _set(96, 1), _set(37, 2)


def poisoned_model_fn(model, features, labels, mode, params):
    padded = features["present"] == 0
    logits = jnp.where(padded[:, None], jnp.nan, features["logits"])
    value = jnp.where(padded, jnp.nan, features["value"])
    if mode == ex.PREDICT:
        return ex.Spec(predictions=logits)
    loss = value + 0.0 * model(features["x"]).sum(-1)  # the model takes part; the value decides
    return ex.Spec(loss=loss, metrics={"accuracy": jnp.argmax(logits, -1) == labels})


def make_estimator(model_dir=None, model_fn=poisoned_model_fn, **config):
    return ex.Estimator(
        model=mlp,
        model_fn=model_fn,
        optimizer=optax.sgd(0.0),  # training leaves the parameters (and so every metric) as they are
        config=ex.RunConfig(model_dir=model_dir, eval_batch_size=EVAL_BATCH, train_batch_size=16, **config),
        params={"dropout": 0.0, "classes": C},
    )


def reference(data) -> dict:
    """What an exact evaluation of ``data`` is: scikit-learn's accuracy, numpy's mean loss, the count."""
    features, labels = data
    return {
        "loss": float(np.mean(features["value"], dtype=np.float64)),
        "accuracy": sk.accuracy_score(labels, features["logits"].argmax(-1)),
        "num_examples": len(labels),
    }


def _check_equal(results: dict, expected: dict) -> None:
    assert results["num_examples"] == expected["num_examples"]
    assert results["accuracy"] == pytest.approx(expected["accuracy"], rel=1e-6)
    assert results["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)


def _records(model_dir: str) -> list[dict]:
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _tensorboard(model_dir: str):
    """The model_dir's TensorBoard runs as TensorBoard's own multiplexer finds them (run name: reader)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    runs = EventMultiplexer(size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    runs.AddRunsFromDirectory(model_dir).Reload()
    return {name: runs.GetAccumulator(name) for name in runs.Runs()}


class SetPicture(ex.Hook):
    """After each evaluation, an image of the set's name and step: the tag is the hook's, the split the set's."""

    def after_eval(self, evaluation):
        evaluation.summaries.image("picture", picture(evaluation.split, evaluation.step))


def picture(split: str, step: int) -> np.ndarray:
    return np.full((2, 3), (len(split) * 16 + step) % 256, np.uint8)


def test_each_set_equals_its_reference_and_one_input_is_unchanged(model_dir):
    sets = {"val": ex.data.from_arrays(*VAL), "test": ex.data.from_arrays(*TEST)}
    est = make_estimator(model_dir)
    results = est.evaluate(sets)
    assert list(results) == ["val", "test"]
    _check_equal(results["val"], reference(VAL))
    _check_equal(results["test"], reference(TEST))
    single = est.evaluate(ex.data.from_arrays(*TEST))  # today's flat dict, the same numbers
    assert single == results["test"]
    states = est.evaluate_states(sets)
    assert set(states) == {"val", "test"} and int(states["test"]["num_examples"].total) == 37
    records = _records(model_dir)
    assert [(r["split"], r.get("set")) for r in records] == [("eval_val", "val"), ("eval_test", "test"), ("eval", None)]
    assert {k: v for k, v in records[1].items() if k not in ("split", "set", "step")} == results["test"]


def test_one_named_set_evaluated_on_a_given_state_and_recorded_under_its_name(model_dir):
    # The entry point a process that follows a run reuses: one set, a state it restored, its records.
    est = make_estimator(model_dir)
    test = est._checks.evaluate(ex.data.from_arrays(*TEST))
    results = est._evaluations.one_set("test", test, est.state(), record=True)
    _check_equal(results, reference(TEST))
    assert [(r["split"], r["set"], r["step"]) for r in _records(model_dir)] == [("eval_test", "test", 0)]
    with pytest.raises(ex.ConfigError, match=r"the evaluation set has the set name 'a/b'"):
        est._evaluations.one_set("a/b", test, est.state())


def test_training_records_each_set_under_its_name_in_jsonl_tensorboard_and_log(model_dir, estimax_log):
    from PIL import Image
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    sets = {"val": ex.data.from_arrays(*VAL), "test": ex.data.from_arrays(*TEST)}
    est = make_estimator(model_dir, tensorboard=True, steps_per_loop=2, log_every_steps=2)
    final = est.train_and_evaluate(ex.data.from_arrays(*VAL), sets, max_steps=8, eval_every=4, hooks=[SetPicture()])
    assert set(final) == {"val", "test"}
    assert est.compiled().eval_step == 1  # sets of one feature shape share the evaluation program
    _check_equal(final["val"], reference(VAL))
    _check_equal(final["test"], reference(TEST))
    records = _records(model_dir)
    runs = _tensorboard(model_dir)
    assert list(runs) == ["."]  # the training is one TensorBoard run: the model_dir itself
    events = runs["."]
    tags = events.Tags()
    assert {tag.split("/")[0] for tag in tags["scalars"]} == {"train", "eval_val", "eval_test"}
    assert sorted(tags["images"]) == ["eval_test/picture", "eval_val/picture"]
    train = [r for r in records if r["split"] == "train"]
    losses = [e.value for e in events.Scalars("train/loss")]
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))  # every step
    assert [r["step"] for r in train] == [2, 4, 6, 8]  # each log line: the mean of the steps since the last
    assert [r["loss"] for r in train] == pytest.approx([np.mean(losses[i : i + 2]) for i in (0, 2, 4, 6)], rel=1e-5)
    for name, data in (("val", VAL), ("test", TEST)):
        mine = [r for r in records if r["split"] == f"eval_{name}"]
        assert [r["step"] for r in mine] == [4, 8] and all(r["set"] == name for r in mine)
        for record in mine:
            _check_equal(record, reference(data))
        for tag in ("accuracy", "loss"):  # TensorBoard's own reader: the set's tags in the one run
            assert [e.step for e in events.Scalars(f"eval_{name}/{tag}")] == [4, 8]
            for event, record in zip(events.Scalars(f"eval_{name}/{tag}"), mine, strict=True):
                assert event.value == pytest.approx(record[tag], rel=1e-6, abs=1e-6)
        assert [e.step for e in events.Scalars(f"eval_{name}/num_examples")] == [4, 8]
        assert events.Scalars(f"eval_{name}/num_examples")[0].value == len(data[1])
        images = events.Images(f"eval_{name}/picture")
        assert [i.step for i in images] == [4, 8]
        for image in images:
            decoded = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)))
            np.testing.assert_array_equal(decoded, picture(f"eval_{name}", image.step))
    (content,) = events.PluginTagToContent("hparams").values()  # the HPARAMS tab's session: this run
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert (hparams["classes"].number_value, hparams["train_batch_size"].number_value) == (C, 16)
    assert not [r for r in records if r["split"] == "eval"]  # no unnamed set: nothing under plain "eval"
    assert not [tag for tag in tags["scalars"] if tag.startswith("eval/")]
    # The CUSTOM SCALARS tab: per metric evaluated, one chart of it in every split (its tags by regex).
    layout = layout_pb2.Layout.FromString(events.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    (category,) = layout.category
    charts = {chart.title: list(chart.multiline.tag) for chart in category.chart}
    assert sorted(charts) == ["accuracy", "loss"]
    for metric, (pattern,) in charts.items():
        matched = sorted(tag for tag in tags["scalars"] if re.search(pattern, tag))
        assert matched == [f"eval_test/{metric}", f"eval_val/{metric}", f"train/{metric}"]
    summary = [r for r in records if r["split"] == "summary"][-1]
    assert summary["val/accuracy"] == final["val"]["accuracy"] and summary["test/num_examples"] == 37
    lines = [r.getMessage() for r in estimax_log.records]
    assert any(line.startswith("eval_val step 8") for line in lines)
    assert any(line.startswith("eval_test step 8") and "num_examples 37" in line for line in lines)
    # Nothing left to train: the current state's evaluation, per set, recorded under each name again.
    again = est.train_and_evaluate(ex.data.from_arrays(*VAL), sets, max_steps=8, eval_every=4)
    assert again == final


class Scalar(nnx.Module):
    """One parameter ``w``: SGD at rate 0.1 on ``(w - 1)^2`` from 0 makes it ``1 - 0.8**step``."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.zeros(()))

    def __call__(self, x):
        return self.w * jnp.ones(x.shape[0])


def _moving_model_fn(model, features, labels, mode, params):
    w = model(features["x"])
    if mode == ex.PREDICT:
        return ex.Spec(predictions=w)
    return ex.Spec(loss=(w - 1.0) ** 2, metrics={"error": jnp.abs(w - features["target"])})


def _target(value: float, n: int = 24):
    return {"x": np.zeros((n, 1), np.float32), "target": np.full(n, value, np.float32)}, np.zeros(n, np.int32)


# w after steps 2, 4, 6, 8: 0.36, 0.5904, 0.7379, 0.8322. "near" (target 0.6) is best at step 4;
# "far" (target 1.0) improves to the end: the sets disagree on the best step.
NEAR, FAR = _target(0.6), _target(1.0)


def _moving_estimator(model_dir):
    return ex.Estimator(
        model=lambda rngs, params: Scalar(rngs),
        model_fn=_moving_model_fn,
        optimizer=optax.sgd(0.1),
        config=ex.RunConfig(model_dir=model_dir, train_batch_size=8, eval_batch_size=16, steps_per_loop=2),
    )


def _best_step(model_dir) -> int:
    (step,) = [int(d) for d in os.listdir(os.path.join(model_dir, "best")) if d.isdigit()]
    return step


@pytest.mark.parametrize("decides, best_step", [("near", 4), ("far", 8)])
def test_best_is_decided_by_the_named_set(tmp_path, decides, best_step):
    model_dir = str(tmp_path / "run")
    est = _moving_estimator(model_dir)
    sets = {"near": ex.data.from_arrays(*NEAR), "far": ex.data.from_arrays(*FAR)}
    best = ex.Best("error", set=decides)
    est.train_and_evaluate(ex.data.from_arrays(*FAR), sets, max_steps=8, eval_every=2, best=best)
    errors = {
        r["step"]: r["error"] for r in _records(model_dir) if r["split"] == f"eval_{decides}"
    }  # the hand computation: |w - target| with w = 1 - 0.8**step
    for step, error in errors.items():
        target = 0.6 if decides == "near" else 1.0
        assert error == pytest.approx(abs(1 - 0.8**step - target), rel=1e-4)
    assert min(errors, key=errors.get) == best_step == _best_step(model_dir)
    kept = est.evaluate(sets, checkpoint=os.path.join(model_dir, "best"))
    assert kept[decides]["error"] == pytest.approx(errors[best_step], rel=1e-6)


def test_patience_watches_the_named_set(model_dir):
    est = _moving_estimator(model_dir)
    sets = {"near": ex.data.from_arrays(*NEAR), "far": ex.data.from_arrays(*FAR)}
    best = ex.Best("error", set="near", patience=2, keep_checkpoint=False)
    est.train_and_evaluate(ex.data.from_arrays(*FAR), sets, max_steps=20, eval_every=2, best=best)
    assert est.step == 8  # best at 4; steps 6 and 8 did not improve on it


def test_one_set_decides_without_naming_it(model_dir):
    est = _moving_estimator(model_dir)
    best = ex.Best("error")
    est.train_and_evaluate(
        ex.data.from_arrays(*FAR), {"near": ex.data.from_arrays(*NEAR)}, max_steps=8, eval_every=2, best=best
    )
    assert _best_step(model_dir) == 4


def test_wrong_sets_are_one_config_error_each_before_anything_runs(model_dir):
    est = make_estimator(model_dir)
    val, test = ex.data.from_arrays(*VAL), ex.data.from_arrays(*TEST)
    train = ex.data.from_arrays(*VAL)
    cases = [
        ({}, None, ex.ConfigError, r"eval_input=\{\} is an empty mapping; expected one input, or a mapping"),
        ({1: val}, None, ex.ConfigTypeError, r"set name 1 \(int\); expected text"),
        ({"a/b": val}, None, ex.ConfigError, r"set name 'a/b'; expected letters, digits"),
        ({"..": val}, None, ex.ConfigError, r"set name '\.\.'"),
        ({"x": VAL[0]["x"]}, None, ex.ConfigTypeError, r"maps 'x' to an array of shape \(96, 6\)"),
        ({"val": val, "test": test}, ex.Best("accuracy"), ex.ConfigError, r"which of the evaluation sets"),
        ({"val": val}, ex.Best("accuracy", set="test"), ex.ConfigError, r"Best\(set='test'\) is not among"),
        (val, ex.Best("accuracy", set="val"), ex.ConfigError, r"eval_input is one unnamed input"),
    ]
    for eval_input, best, kind, match in cases:
        with pytest.raises(kind, match=match) as error:
            est.train_and_evaluate(train, eval_input, max_steps=4, eval_every=2, best=best)
        assert "\n" not in str(error.value)
    stopping = ex.EarlyStopping("loss")  # watches "eval", which named sets do not record
    with pytest.raises(ex.ConfigError, match=r"EarlyStopping\(split='eval'\) watches no evaluation .*'eval_val'"):
        est.train_and_evaluate(train, {"val": val}, max_steps=4, eval_every=2, hooks=[stopping])
    with pytest.raises(ex.ConfigError, match=r"evaluate\(input=\.\.\.\)=\{\} is an empty mapping"):
        est.evaluate({})
    with pytest.raises(ex.ConfigError, match=r"Best\(set=\.\.\.\) has the set name 'a/b'"):
        ex.Best("accuracy", set="a/b")
    assert est.step == 0 and not os.path.exists(os.path.join(model_dir, "metrics.jsonl"))


def test_a_task_whose_eval_input_is_a_mapping_trains_evaluates_and_predicts(tmp_path):
    guide = open(os.path.join(ROOT, "docs", "guides", "task-modules.md")).read()
    task = guide.split("```python\n", 1)[1].split("```", 1)[0]  # the guide's task, with two named sets
    two_sets = "{'val': _blobs(params, seed=1), 'test': _blobs(dict(params, num_examples=45), seed=2)}"
    task = task.replace("    return _blobs(params, seed=1)", f"    return {two_sets}")
    assert "'test'" in task
    (tmp_path / "sets_task.py").write_text(task)
    model_dir = str(tmp_path / "run")
    common = ("sets_task.py", "--model-dir", model_dir)
    out = _estimax("train", *common, "--max-steps", "8", "--eval-every", "4", cwd=tmp_path)
    assert re.search(r"held-out accuracy \S+ on 192 examples of val, accuracy \S+ on 45 examples of test", out)
    results = json.loads(_estimax("evaluate", *common, cwd=tmp_path).strip().splitlines()[-1])
    assert results["val"]["num_examples"] == 192 and results["test"]["num_examples"] == 45
    splits = [(r["split"], r["step"]) for r in _records(model_dir) if r["split"].startswith("eval")]
    trained = [("eval_val", 4), ("eval_test", 4), ("eval_val", 8), ("eval_test", 8)]
    assert splits == [*trained, ("eval_val", 8), ("eval_test", 8)]  # then the evaluate command's
    predict_input = task_lib.load(str(tmp_path / "sets_task.py")).input("predict")
    assert len(predict_input) == 192  # with no predict_input, predict and export read the first set


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _estimax(*args, cwd) -> str:
    env = user_env()  # the user's machine: real devices
    env["PYTHONPATH"] = ROOT  # this checkout's estimax
    result = warm.run(
        [sys.executable, "-m", "estimax.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
