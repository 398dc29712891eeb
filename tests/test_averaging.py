"""The moving average of the parameters (``averaging.py``): its formula against closed forms, bitwise
resume, its place on the devices, the weights each verb uses, and the settings' errors."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from models import blobs, estimator

import estimax as ex
from estimax.state import leaf_names

# -- the formula against closed forms ----------------------------------------------------------

W0, STEP = 0.125, 1 / 64  # SGD with a constant gradient: params_n = W0 - n * STEP, exact in float32


class Line(nnx.Module):
    def __init__(self, rngs, params):
        self.w = nnx.Param(jnp.full((4,), W0, jnp.float32))

    def __call__(self, x):
        return x @ self.w


def line_fn(model, features, labels, mode, params):
    out = model(features["x"])
    return ex.Spec(predictions=out) if mode == ex.PREDICT else ex.Spec(loss=out)  # d loss / d w = mean(x) = 1


def closed_form(decay: float, warmup: str, n: int) -> float:
    """The average after ``n`` steps as an explicit weighted sum of params_0..params_n (float64)."""
    params = W0 - STEP * np.arange(n + 1, dtype=np.float64)
    steps = np.arange(1, n + 1, dtype=np.float64)
    if warmup == "debias":  # optax.ema(debias=True): sum_i (1-d) d^(n-i) p_i / (1 - d^n); p_0 weighs 0
        weights = (1 - decay) * decay ** (n - steps) / (1 - decay**n)
        return float(weights @ params[1:])
    d = np.full(n, decay) if warmup == "none" else np.minimum(decay, (1 + steps) / (10 + steps))
    after = np.append(np.cumprod(d[::-1])[::-1], 1.0)  # after[i] = d_(i+1) * ... * d_n
    weights = np.concatenate([[after[0]], (1 - d) * after[1:]])  # p_0, then p_1 .. p_n
    assert abs(weights.sum() - 1) < 1e-12
    return float(weights @ params)


@pytest.mark.parametrize(("decay", "warmup"), [(0.5, "ramp"), (0.9, "ramp"), (0.8, "debias"), (0.8, "none")])
def test_the_average_equals_its_closed_form_over_a_known_sequence_of_parameters(decay, warmup):
    est = ex.Estimator(
        model=Line,
        model_fn=line_fn,
        optimizer=optax.sgd(STEP),
        config=ex.RunConfig(train_batch_size=8, steps_per_loop=4, quiet=True, ema_decay=decay, ema_warmup=warmup),
    )
    n = 12  # with decay 0.5 the ramp's (1+n)/(10+n) passes the decay at n = 8
    est.train(ex.data.from_arrays({"x": np.ones((64, 4), np.float32)}, np.zeros(64, np.float32)), max_steps=n)
    state = est.state()
    np.testing.assert_array_equal(np.asarray(state.params["w"][...]), np.float32(W0 - n * STEP))
    np.testing.assert_allclose(np.asarray(state.average["w"][...]), closed_form(decay, warmup, n), rtol=0, atol=1e-7)


# -- resume, loops, devices ----------------------------------------------------------------------


def _train_input():
    return ex.data.from_arrays(*blobs(256))


def _leaves(state) -> dict:
    names = leaf_names(state)
    return dict(zip(names, map(np.asarray, jax.tree.leaves(state)), strict=True))


def _assert_bitwise(a, b) -> None:
    a, b = _leaves(a), _leaves(b)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_resumed_run_equals_an_uninterrupted_one_bitwise_average_included(tmp_path):
    whole = estimator(str(tmp_path / "whole"), ema_decay=0.9, quiet=True)
    whole.train(_train_input(), max_steps=12)
    first = estimator(str(tmp_path / "resumed"), ema_decay=0.9, quiet=True)
    first.train(_train_input(), max_steps=6)
    second = estimator(str(tmp_path / "resumed"), ema_decay=0.9, quiet=True)  # a new process's view: from disk
    assert second.step == 6
    second.train(_train_input(), max_steps=12)
    _assert_bitwise(second.state(), whole.state())
    average, params = _leaves(whole.state().average), _leaves(whole.state().params)
    assert any(not np.array_equal(average[k], params[k]) for k in params)  # an average that is not the params


def test_one_step_per_loop_and_several_give_the_same_average():
    runs = []
    for steps_per_loop in (1, 5):
        est = estimator(ema_decay=0.95, ema_warmup="debias", steps_per_loop=steps_per_loop, quiet=True)
        est.train(_train_input(), max_steps=12)  # 5: two loops of 5 and one of 2
        runs.append(est.state())
    _assert_bitwise(*runs)


def test_under_fsdp_the_average_holds_the_bytes_per_device_of_the_parameters():
    est = estimator(ema_decay=0.99, mesh={"fsdp": 8}, fsdp_min_bytes=0, quiet=True)
    est.train(_train_input(), max_steps=4)
    state = est.state()

    def per_device(tree) -> dict:
        held: dict = {}
        for leaf in jax.tree.leaves(tree):
            for shard in leaf.addressable_shards:
                held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
        return held

    assert per_device(state.average) == per_device(state.params)
    total = sum(x.nbytes for x in jax.tree.leaves(state.params))
    assert max(per_device(state.params).values()) < total / 4  # sharded, not replicated
    pairs = zip(jax.tree.leaves(state.average), jax.tree.leaves(state.params), strict=True)
    specs = [(a.sharding.spec, p.sharding.spec) for a, p in pairs]
    assert all(a == p for a, p in specs) and sum(a != P() for a, _ in specs) == 3  # l2/bias (3,) stays whole
    totals = est.sharding_plan().totals
    assert totals["average"] == totals["params"] == max(per_device(state.params).values())


# -- which weights the verbs use -------------------------------------------------------------------


def _forward(params: dict, x: np.ndarray) -> np.ndarray:
    """The MLP of ``tests/models.py`` in numpy (no dropout at evaluation)."""
    hidden = np.maximum(x @ params["l1/kernel"] + params["l1/bias"], 0)
    return hidden @ params["l2/kernel"] + params["l2/bias"]


def _records(model_dir: str, split: str) -> list[dict]:
    with open(f"{model_dir}/metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


def test_evaluation_prediction_and_export_use_the_chosen_weights(tmp_path):
    model_dir = str(tmp_path / "run")
    features, labels = blobs(64, seed=1)
    est = estimator(model_dir, ema_decay=0.9, quiet=True)
    est.train(_train_input(), max_steps=10)
    state = est.state()
    average, raw = _leaves(state.average), _leaves(state.params)
    raw_est = estimator(model_dir, ema_decay=0.9, eval_weights="raw", quiet=True)
    for each, params in ((est, average), (raw_est, raw)):
        logits = _forward(params, features["x"])
        predicted = np.stack([p["logits"] for p in each.predict(ex.data.from_arrays(features))])
        np.testing.assert_allclose(predicted, logits, rtol=1e-5, atol=1e-5)
        results = each.evaluate(ex.data.from_arrays(features, labels))
        expected = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, labels)).mean()
        assert results["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert not np.allclose(_forward(average, features["x"]), _forward(raw, features["x"]))
    evaluations = _records(model_dir, "eval")
    assert [r.get("ema_decay") for r in evaluations] == [0.9, None]  # the record says which weights

    # 8 devices sum in another order than the artifact's one (float32 rounding): close, not bitwise
    served = ex.serving.load(est.export(str(tmp_path / "export")))({"x": features["x"]})["logits"]
    predicted = np.stack([p["logits"] for p in est.predict(ex.data.from_arrays(features))])
    np.testing.assert_allclose(served, predicted, rtol=1e-5, atol=1e-5)
    assert not np.allclose(served, _forward(raw, features["x"]), rtol=1e-3, atol=1e-3)


def test_train_and_evaluate_chooses_the_best_checkpoint_by_the_average(tmp_path):
    model_dir = str(tmp_path / "run")
    features, labels = blobs(64, seed=1)
    est = estimator(model_dir, ema_decay=0.9, quiet=True)
    est.train_and_evaluate(
        _train_input(), ex.data.from_arrays(features, labels), max_steps=8, eval_every=4, best=ex.Best("loss")
    )
    evaluations = _records(model_dir, "eval")
    assert [r["step"] for r in evaluations] == [4, 8] and all(r["ema_decay"] == 0.9 for r in evaluations)
    logits = _forward(_leaves(est.state().average), features["x"])
    expected = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, labels)).mean()
    assert evaluations[-1]["loss"] == pytest.approx(float(expected), rel=1e-5)


# -- checkpoints of runs with and without an average, warm start -----------------------------------


def test_a_checkpoint_without_an_average_loads_into_a_run_that_keeps_one(tmp_path, estimax_log):
    model_dir = str(tmp_path / "run")
    plain = estimator(model_dir, quiet=True)
    plain.train(_train_input(), max_steps=4)
    averaged = estimator(model_dir, ema_decay=0.9, quiet=True)
    state = averaged.state()
    _assert_bitwise(state.average, state.params)
    _assert_bitwise(state.params, plain.state().params)
    assert "holds no parameter average" in estimax_log.text
    averaged.train(_train_input(), max_steps=8)  # and training goes on, saving the average
    assert estimator(model_dir, quiet=True).state().average is None  # dropped by a run that keeps none
    assert "it is not used" in estimax_log.text


def test_a_warm_started_average_starts_from_the_loaded_parameters(tmp_path):
    source = estimator(str(tmp_path / "source"), quiet=True)
    source.train(_train_input(), max_steps=4)
    est = estimator(ema_decay=0.9, warm_start=ex.WarmStart(str(tmp_path / "source")), quiet=True)
    state = est.state()
    _assert_bitwise(state.params, source.state().params)
    _assert_bitwise(state.average, state.params)


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"ema_decay": 1.0}, ex.ConfigError, r"ema_decay=1.0\) is outside \(0, 1\); expected .* e.g. 0.999"),
        ({"ema_decay": 0}, ex.ConfigError, r"ema_decay=0\) is outside \(0, 1\)"),
        ({"ema_decay": float("nan")}, ex.ConfigError, r"ema_decay=nan\) is outside \(0, 1\)"),
        ({"ema_decay": "0.9"}, ex.ConfigTypeError, r"ema_decay='0.9'\) is of type str; expected a number"),
        ({"ema_decay": 0.9, "ema_warmup": "tf"}, ex.ConfigError, r"ema_warmup='tf'\); expected one of"),
        ({"ema_decay": 0.9, "eval_weights": "ema"}, ex.ConfigError, r"eval_weights='ema'\); expected one of"),
        ({"eval_weights": "average"}, ex.ConfigError, r"ema_decay=None: no parameter average is kept. Fix: set"),
    ],
)
def test_settings_of_the_average_are_checked(settings, error, match):
    with pytest.raises(error, match=match):
        ex.RunConfig(**settings)


def test_a_model_without_an_average_keeps_none_and_logs_nothing_of_it(caplog):
    est = estimator(quiet=True)
    with caplog.at_level(logging.WARNING):
        est.train(_train_input(), max_steps=2)
    assert est.state().average is None and est.sharding_plan().totals["average"] == 0


# -- the command line ----------------------------------------------------------------------------


def test_the_command_line_keeps_evaluates_and_leaves_out_the_average(tmp_path):
    from helpers import run_estimax as _estimax

    model_dir = str(tmp_path / "run")
    _estimax("train", "--model-dir", model_dir, "--max-steps", "10", "--steps-per-loop", "5", "--ema-decay", "0.9")
    averaged = json.loads(_estimax("evaluate", "--model-dir", model_dir, "--ema-decay", "0.9").splitlines()[-1])
    raw = json.loads(_estimax("evaluate", "--model-dir", model_dir).splitlines()[-1])  # a run keeping none
    assert averaged["ema_decay"] == 0.9 and "ema_decay" not in raw and averaged["loss"] != raw["loss"]
    assert [r.get("ema_decay") for r in _records(model_dir, "eval")][-2:] == [0.9, None]  # after train's own
