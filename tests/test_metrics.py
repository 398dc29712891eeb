"""Mergeable metrics: exact over padding, devices, batch sizes and steps; checked against numpy and scikit-learn.

1,003 evaluation examples in batches of 64 on 8 devices: the last batch is
partial and padded, and every padded row is poisoned (NaN/inf scores, labels
out of range), so any leak of padding shows up as a wrong count or an error.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import warm
from models import mlp
from sklearn import metrics as sk

import estimax as ex
from estimax import loop as loop_lib
from estimax import metrics as M

# The metrics here come from the features; the model is evaluated untrained on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:Estimator.evaluate\\(\\) uses the initial, untrained weights")

N, C, T = 1003, 10, 200
RNG = np.random.default_rng(0)
LABELS = RNG.integers(0, C, N).astype(np.int32)
# Logits that favour the label, so that accuracy, top-k and AUC are far from trivial.
LOGITS = (RNG.normal(size=(N, C)) + 1.5 * np.eye(C)[LABELS]).astype(np.float32)
BINARY = (LABELS % 2).astype(np.int32)
SCORES = (1 / (1 + np.exp(-(LOGITS[:, 1] - LOGITS[:, 0] + 0.8 * BINARY)))).astype(np.float32)
VALUES = RNG.normal(size=N).astype(np.float32) * 3
WEIGHTS = RNG.uniform(0.5, 2.0, N).astype(np.float32)
COUNTS = RNG.integers(0, 7, N).astype(np.int32)
FEATURES = {
    "x": RNG.normal(size=(N, 6)).astype(np.float32),
    "logits": LOGITS,
    "score": SCORES,
    "value": VALUES,
    "weight": WEIGHTS,
    "count": COUNTS,
    "index": np.arange(N, dtype=np.int32),
    "present": np.ones(N, np.float32),  # padding rows are zeros: the model_fn poisons them
}
DATA = ex.data.from_arrays(FEATURES, LABELS)


def poisoned_model_fn(model, features, labels, mode, params):
    padded = features["present"] == 0
    logits = jnp.where(padded[:, None], jnp.nan, features["logits"])
    score = jnp.where(padded, jnp.inf, features["score"])
    value = jnp.where(padded, jnp.nan, features["value"])
    labels = jnp.where(padded, 99, labels)
    binary = labels % 2
    loss = optax.softmax_cross_entropy_with_integer_labels(model(features["x"]), jnp.where(padded, 0, labels))
    if mode == ex.PREDICT:
        return ex.Spec(predictions=logits)
    return ex.Spec(
        loss=loss,
        metrics={
            "accuracy": jnp.argmax(logits, -1) == labels,  # a plain per-example value: a Mean
            "auc": M.AUC(score, binary),
            "pr": M.AUC(score, binary, curve="PR"),
            "logit_auc": M.AUC(jnp.where(padded, jnp.nan, logits[:, 1] - logits[:, 0]), binary, from_logits=True),
            "prf": M.ConfusionMatrix(logits, labels, num_classes=C, per_class=True),
            "top3": M.TopK(logits, labels, k=3),
            "top1": M.Accuracy(logits, labels),
            "total": M.Sum(jnp.where(padded, -(2**30), features["count"])),
            "max": M.Max(value),
            "min": M.Min(value),
            "std": M.Std(value),
            "wmean": M.Mean(value, weights=features["weight"]),
        },
        eval_outputs={"index": features["index"], "score": score, "binary": binary},
    )


def make_estimator(model_fn=poisoned_model_fn, **config):
    config.setdefault("eval_batch_size", 64)
    config.setdefault("train_batch_size", 32)
    host_metrics = config.pop("host_metrics", None)
    return ex.Estimator(
        model=mlp,
        model_fn=model_fn,
        optimizer=optax.sgd(0.1),
        config=ex.RunConfig(**config),
        params={"dropout": 0.0, "classes": C},
        host_metrics=host_metrics,
    )


def histogram_auc(scores, labels, curve="ROC", num_thresholds=T):
    """The reference: the same bins in numpy float32, then scikit-learn on the binned scores."""
    bins = np.clip(np.floor(scores.astype(np.float32) * np.float32(num_thresholds)), 0, num_thresholds - 1)
    if curve == "ROC":
        return sk.roc_auc_score(labels, bins)
    return sk.average_precision_score(labels, bins)


def integer_leaves(states):
    return {
        name: [np.asarray(x) for x in jax.tree.leaves(s) if np.issubdtype(np.asarray(x).dtype, np.integer)]
        for name, s in states.items()
    }


@pytest.fixture(scope="module")
def evaluated():
    est = make_estimator(num_devices=8)
    return est, est.evaluate_states(DATA), est.evaluate(DATA)


def test_integer_states_equal_numpy_on_the_unpadded_data(evaluated):
    _, states, results = evaluated
    assert results["num_examples"] == N and int(states["num_examples"].total) == N
    np.testing.assert_array_equal(states["prf"].matrix, sk.confusion_matrix(LABELS, LOGITS.argmax(-1)))
    label_logit = LOGITS[np.arange(N), LABELS]
    top3 = int(((LOGITS > label_logit[:, None]).sum(-1) < 3).sum())
    assert (int(states["top3"].hits), int(states["top3"].count)) == (top3, N)
    assert int(states["top1"].hits) == int((LOGITS.argmax(-1) == LABELS).sum())
    assert int(states["total"].total) == int(COUNTS.sum()) and states["total"].total.dtype == np.int64
    assert float(states["max"].value) == float(VALUES.max()) and float(states["min"].value) == float(VALUES.min())
    bins = np.clip(np.floor(SCORES * np.float32(T)), 0, T - 1).astype(int)
    np.testing.assert_array_equal(states["auc"].positives, np.bincount(bins[BINARY == 1], minlength=T))
    np.testing.assert_array_equal(states["auc"].negatives, np.bincount(bins[BINARY == 0], minlength=T))
    assert int(states["auc"].bad_scores) == int(states["auc"].labels.count) == int(states["prf"].out_of_range) == 0


def test_classification_results_match_scikit_learn(evaluated):
    _, _, results = evaluated
    predicted, labels, every = LOGITS.argmax(-1), LABELS, list(range(C))
    differences = {}
    for average in ("macro", "micro"):
        for name, fn in (("precision", sk.precision_score), ("recall", sk.recall_score), ("f1", sk.f1_score)):
            expected = fn(labels, predicted, labels=every, average=average, zero_division=0)
            differences[f"{name}_{average}"] = abs(results[f"prf/{name}_{average}"] - expected)
    per_class = sk.precision_recall_fscore_support(labels, predicted, labels=every, zero_division=0)
    for c in range(C):
        for name, values in zip(("precision", "recall", "f1"), per_class[:3], strict=False):
            differences[f"{name}_{c}"] = abs(results[f"prf/{name}_{c}"] - values[c])
    differences["mean_per_class_accuracy"] = abs(
        results["prf/mean_per_class_accuracy"] - sk.balanced_accuracy_score(labels, predicted)
    )
    differences["accuracy"] = abs(results["prf/accuracy"] - sk.accuracy_score(labels, predicted))
    differences["top1"] = abs(results["top1"] - sk.accuracy_score(labels, predicted))
    differences["top3"] = abs(results["top3"] - sk.top_k_accuracy_score(labels, LOGITS, k=3, labels=every))
    differences["accuracy (plain Mean)"] = abs(results["accuracy"] - sk.accuracy_score(labels, predicted))
    worst = max(differences, key=differences.get)
    print(
        f"max |estimax - scikit-learn| over {len(differences)} classification results: "
        f"{differences[worst]:.2e} ({worst})"
    )
    assert differences[worst] <= 1e-6


def test_auc_equals_the_histogram_reference_and_approximates_scikit_learn(evaluated):
    _, _, results = evaluated
    assert results["auc"] == pytest.approx(histogram_auc(SCORES, BINARY), abs=1e-12)
    assert results["pr"] == pytest.approx(histogram_auc(SCORES, BINARY, "PR"), abs=1e-12)
    logit_scores = np.asarray(jax.nn.sigmoid(LOGITS[:, 1] - LOGITS[:, 0]))
    assert results["logit_auc"] == pytest.approx(histogram_auc(logit_scores, BINARY), abs=1e-12)
    roc = abs(results["auc"] - sk.roc_auc_score(BINARY, SCORES))
    pr = abs(results["pr"] - sk.average_precision_score(BINARY, SCORES))
    print(f"|AUC(200 bins) - roc_auc_score| = {roc:.2e}, |AUC(PR, 200 bins) - average_precision_score| = {pr:.2e}")
    assert 0.6 < results["auc"] < 0.99
    assert roc <= 2e-3
    assert pr <= 5e-3  # stated tolerance: a step function over 200 bins instead of every distinct score


def test_float_results_match_numpy(evaluated):
    _, _, results = evaluated
    assert results["std"] == pytest.approx(np.std(VALUES.astype(np.float64)), rel=1e-5)
    assert results["wmean"] == pytest.approx(np.average(VALUES, weights=WEIGHTS), rel=1e-5)
    assert results["total"] == COUNTS.sum() and results["max"] == VALUES.max()


@pytest.mark.parametrize(("num_devices", "eval_batch_size"), [(1, 64), (2, 64), (8, 8), (8, 128)])
def test_integer_states_are_identical_on_any_devices_and_batch_size(evaluated, num_devices, eval_batch_size):
    _, reference, _ = evaluated
    states = make_estimator(num_devices=num_devices, eval_batch_size=eval_batch_size).evaluate_states(DATA)
    for name, leaves in integer_leaves(states).items():
        for got, expected in zip(leaves, integer_leaves(reference)[name], strict=True):
            np.testing.assert_array_equal(got, expected, err_msg=name)


def test_segments_merged_on_the_host_equal_one_device_carry(evaluated, monkeypatch):
    _, reference, _ = evaluated
    monkeypatch.setattr(loop_lib, "FOLD_EVERY", 3)  # 16 batches: 5 host merges and a rest
    states = make_estimator(num_devices=8).evaluate_states(DATA)
    assert integer_leaves(states).keys() == integer_leaves(reference).keys()
    for name, leaves in integer_leaves(states).items():
        for got, expected in zip(leaves, integer_leaves(reference)[name], strict=True):
            np.testing.assert_array_equal(got, expected, err_msg=name)
    assert states["std"].compute() == pytest.approx(reference["std"].compute(), rel=1e-6)


def test_padding_poisoned_with_nan_changes_no_state():
    mask = np.arange(80) < 50
    poisoned = {
        "scores": np.where(mask, RNG.uniform(size=80), np.nan).astype(np.float32),
        "labels": np.where(mask, RNG.integers(0, 2, 80), 7),
        "values": np.where(mask, RNG.normal(size=80), np.nan).astype(np.float32),
    }
    clean = {k: v[:50] for k, v in poisoned.items()}
    every = np.ones(50, bool)
    for inputs in (
        lambda d: M.AUC(d["scores"], d["labels"]),
        lambda d: M.ConfusionMatrix(d["labels"], d["labels"], num_classes=2),
        lambda d: M.Mean(d["values"]),
        lambda d: M.Std(d["values"]),
        lambda d: M.Max(d["values"]),
        lambda d: M.Min(d["values"]),
        lambda d: M.Sum(d["values"]),
    ):
        got, expected = inputs(poisoned).state(mask), inputs(clean).state(every)
        jax.tree.map(_same, got, expected)


def _same(got, expected):
    """Integers exactly; floats up to the summation order (more rows, even if zero, sum in another order)."""
    got, expected = np.asarray(got), np.asarray(expected)
    if np.issubdtype(got.dtype, np.integer):
        np.testing.assert_array_equal(got, expected)
    else:
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def _random_states(seed):
    rng = np.random.default_rng(seed)
    n = 40  # one shape: the eager ops compile once; the splits differ by their random masks
    scores, labels = rng.uniform(size=n).astype(np.float32), rng.integers(0, 2, n)
    logits, classes, values = rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 4, n), rng.normal(size=n)
    mask = rng.uniform(size=n) < rng.uniform()
    return {
        "auc": M.AUC(scores, labels, num_thresholds=16).state(mask),
        "cm": M.ConfusionMatrix(logits, classes, num_classes=4).state(mask),
        "top2": M.TopK(logits, classes, k=2).state(mask),
        "sum": M.Sum(classes).state(mask),
        "max": M.Max(values).state(mask),
        "min": M.Min(classes).state(mask),
        "mean": M.Mean(values, weights=np.abs(values)).state(mask),
        "std": M.Std(values).state(mask),
    }


@pytest.mark.parametrize("seed", range(4))
def test_merge_laws_on_random_splits(seed):
    a, b, c = (M.to_host(_random_states(seed * 3 + i)) for i in range(3))
    for name in a:
        x, y, z = a[name], b[name], c[name]
        empty = M.to_host(M.empty_like(jax.eval_shape(lambda s=x: s)))
        for left, right in ((x.merge(empty), x), (x.merge(y), y.merge(x)), (x.merge(y).merge(z), x.merge(y.merge(z)))):
            for got, expected in zip(jax.tree.leaves(left), jax.tree.leaves(right), strict=True):
                if np.issubdtype(got.dtype, np.integer):
                    np.testing.assert_array_equal(got, expected, err_msg=name)
                else:
                    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12, err_msg=name)
    # Merging the parts is the state of the whole (the device computes it in one go).
    whole = M.AUC(np.arange(30) / 30, np.arange(30) % 3 == 0, num_thresholds=8).state(np.ones(30, bool))
    parts = [
        M.AUC(np.arange(30)[s] / 30, np.arange(30)[s] % 3 == 0, num_thresholds=8)
        for s in np.split(np.arange(30), [7, 19])
    ]
    merged = M.to_host(parts[0].state(np.ones(7, bool))).merge(M.to_host(parts[1].state(np.ones(12, bool))))
    merged = merged.merge(M.to_host(parts[2].state(np.ones(11, bool))))
    jax.tree.map(np.testing.assert_array_equal, merged, M.to_host(whole))


def _train_auc_model_fn(model, features, labels, mode, params):
    loss = optax.softmax_cross_entropy_with_integer_labels(model(features["x"]), labels)
    return ex.Spec(
        loss=loss,
        metrics={"auc": M.AUC(features["score"], labels % 2), "top3": M.TopK(features["logits"], labels, k=3)},
    )


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_a_windowed_train_auc_is_the_auc_over_the_window_examples(model_dir, grad_accum_steps):
    batches = [
        ({k: v[i * 32 : (i + 1) * 32] for k, v in FEATURES.items()}, LABELS[i * 32 : (i + 1) * 32]) for i in range(24)
    ]
    est = make_estimator(
        _train_auc_model_fn,
        model_dir=model_dir,
        steps_per_loop=4,
        log_every_steps=8,
        tensorboard=False,
        grad_accum_steps=grad_accum_steps,
    )
    est.train(batches, max_steps=24)
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if r["split"] == "train"]
    assert [r["step"] for r in train] == [8, 16, 24]
    for record in train:
        window = slice((record["step"] - 8) * 32, record["step"] * 32)  # the examples of these 8 steps
        expected = histogram_auc(SCORES[window], BINARY[window])
        assert record["auc"] == pytest.approx(expected, abs=1e-12)
        label_logit = LOGITS[window][np.arange(256), LABELS[window]]
        assert record["top3"] == ((LOGITS[window] > label_logit[:, None]).sum(-1) < 3).mean()


def test_host_metrics_get_every_row_once_in_input_order():
    seen = {}

    def host_metrics(outputs):
        seen.update(outputs)
        return {"sk_auc": sk.roc_auc_score(outputs["binary"], outputs["score"])}

    est = make_estimator(num_devices=8, host_metrics=host_metrics)
    results = est.evaluate(DATA)
    np.testing.assert_array_equal(seen["index"], np.arange(N))
    assert results["sk_auc"] == sk.roc_auc_score(BINARY, SCORES)
    # Per call, instead of the Estimator's; a name already taken is refused.
    assert est.evaluate(DATA, host_metrics=lambda o: {"rows": len(o["index"])})["rows"] == N
    with pytest.raises(ValueError, match=r"host_metrics returned \['auc'\], which the model_fn's metrics already name"):
        est.evaluate(DATA, host_metrics=lambda o: {"auc": 0.5})


def test_host_metrics_without_eval_outputs_is_refused_before_running():
    def model_fn(model, features, labels, mode, params):
        return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(model(features["x"]), labels))

    with pytest.raises(ValueError, match=r"host_metrics needs .* no Spec\(eval_outputs=...\)"):
        make_estimator(model_fn, host_metrics=lambda o: {}).evaluate(DATA)


def test_scores_outside_zero_one_are_refused_with_the_fix():
    def model_fn(model, features, labels, mode, params):
        logits = model(features["x"])
        return ex.Spec(loss=logits[:, 0], metrics={"auc": M.AUC(logits[:, 1] - logits[:, 0] + 100.0, labels % 2)})

    with pytest.raises(
        ValueError, match=r"Metric 'auc' \(AUCState\): 1003 valid scores are outside \[0, 1\].*from_logits=True"
    ):
        make_estimator(model_fn).evaluate(DATA)


def test_bad_metric_config_and_states_in_a_spec_are_refused():
    with pytest.raises(ValueError, match=r"AUC\(curve='roc'\); expected 'ROC' or 'PR'"):
        M.AUC(SCORES, BINARY, curve="roc")
    with pytest.raises(ValueError, match=r"TopK\(k=0\); expected a positive integer"):
        M.TopK(LOGITS, LABELS, k=0)
    with pytest.raises(ValueError, match=r"ConfusionMatrix\(num_classes=1\)"):
        M.ConfusionMatrix(LABELS, LABELS, num_classes=1)

    def model_fn(model, features, labels, mode, params):
        loss = optax.softmax_cross_entropy_with_integer_labels(model(features["x"]), labels)
        return ex.Spec(loss=loss, metrics={"s": M.SumState(jnp.sum(labels))})

    with pytest.raises(TypeError, match=r"is a metric state; expected its inputs of this batch.*SumState.of"):
        make_estimator(model_fn).evaluate(DATA)

    def model_fn(model, features, labels, mode, params):
        loss = optax.softmax_cross_entropy_with_integer_labels(model(features["x"]), labels)
        return ex.Spec(loss=loss, metrics={"auc": M.AUC(features["score"][:8], labels[:8])})

    with pytest.raises(ValueError, match=r"metrics\['auc'\] \(AUCState\) input .* has shape \(8,\)"):
        make_estimator(model_fn).evaluate(DATA)


class ErrorHistogram(M.Metric):
    """A user's metric: counts of |error| in unit bins [0, 1), [1, 2), ... and the bins beyond."""

    counts: jax.Array
    num_bins: int = M.static(4)

    @classmethod
    def from_batch(cls, predictions, targets, *, mask, num_bins=4):
        bins = jnp.clip(jnp.floor(jnp.abs(predictions - targets)), 0, num_bins).astype(jnp.int32)
        bins = jnp.where(mask, bins, num_bins + 1)  # padded rows: an index that is dropped
        return cls(jnp.zeros(num_bins + 1, jnp.int32).at[bins].add(1, mode="drop"), num_bins)

    @classmethod
    def empty(cls, num_bins=4):
        return cls(np.zeros(num_bins + 1, np.int32), num_bins)

    def merge(self, other):
        return ErrorHistogram(self.counts + other.counts, self.num_bins)

    def compute(self):
        fractions = np.asarray(self.counts, np.float64) / max(int(np.sum(self.counts)), 1)
        return {f"under_{b + 1}": float(np.sum(fractions[: b + 1])) for b in range(self.num_bins)}


def test_a_user_defined_metric_follows_the_protocol():
    def model_fn(model, features, labels, mode, params):
        loss = optax.softmax_cross_entropy_with_integer_labels(model(features["x"]), labels)
        hist = ErrorHistogram.of(
            jnp.where(features["present"] == 0, jnp.nan, features["value"]), jnp.zeros(len(labels)), num_bins=3
        )
        return ex.Spec(loss=loss, metrics={"err": hist})

    est = make_estimator(model_fn)
    results, states = est.evaluate(DATA), est.evaluate_states(DATA)
    expected = np.bincount(np.clip(np.floor(np.abs(VALUES)), 0, 3).astype(int), minlength=4)
    np.testing.assert_array_equal(states["err"].counts, expected)
    assert results["err/under_1"] == pytest.approx(expected[0] / N, abs=1e-12)
    assert results["err/under_3"] == pytest.approx(expected[:3].sum() / N, abs=1e-12)


def test_two_processes_of_four_devices_equal_one_of_eight(tmp_path):
    import subprocess
    import sys

    from helpers import finish, job_env

    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics_job.py")
    one = warm.run(
        [sys.executable, job, str(tmp_path / "one")],
        env=job_env(JAX_NUM_CPU_DEVICES="8"),
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0, one.stdout + one.stderr
    command = [sys.executable, "-m", "estimax.cli", "launch", "--num-processes", "2", "--devices-per-process", "4"]
    command += ["--", sys.executable, job, str(tmp_path / "two")]
    finish(subprocess.Popen(command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    (single,) = [json.load(open(tmp_path / "one" / "result-0.json"))]
    group = [json.load(open(tmp_path / "two" / f"result-{p}.json")) for p in range(2)]
    assert (single["processes"], single["devices"]) == (1, 8)
    for result in group:
        assert (result["processes"], result["devices"]) == (2, 8)
        assert result["states"] == single["states"]  # every integer state, exactly
        assert result["index"] == single["index"] == list(range(N))  # every row once, in input order, everywhere
        assert result["results"]["rows"] == N and result["results"]["num_examples"] == N
        for name, value in single["results"].items():
            assert result["results"][name] == pytest.approx(value, rel=1e-6, abs=1e-6), name  # float sums: any order


def test_a_clu_metric_wrapped_in_the_readme_adapter_agrees_with_the_built_ins():
    clu_metrics = pytest.importorskip("clu.metrics")
    from typing import Any

    class Clu(M.Metric):
        inner: Any
        kind: type = M.static()

        @classmethod
        def from_batch(cls, *, mask, kind, **outputs):
            return cls(kind.from_model_output(**outputs, mask=mask), kind)

        @classmethod
        def empty(cls, kind):
            return cls(kind.empty(), kind)

        def merge(self, other):
            return Clu(self.inner.merge(other.inner), self.kind)

        def compute(self):
            return float(self.inner.compute())

    def model_fn(model, features, labels, mode, params):
        logits = model(features["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return ex.Spec(
            loss=loss,
            metrics={
                "clu_accuracy": Clu.of(logits=logits, labels=labels, kind=clu_metrics.Accuracy),
                "accuracy": M.Accuracy(logits, labels),
                "clu_loss": Clu.of(values=loss, kind=clu_metrics.Average),
            },
        )

    results = make_estimator(model_fn).evaluate(DATA)
    assert results["clu_accuracy"] == pytest.approx(results["accuracy"], abs=1e-6)
    assert results["clu_loss"] == pytest.approx(results["loss"], rel=1e-5)


def _binary_model_fn(model, features, labels, mode, params):
    logit = jnp.log(features["score"]) - jnp.log1p(-features["score"])
    binary = labels % 2
    loss = optax.softmax_cross_entropy_with_integer_labels(model(features["x"]), labels)
    return ex.Spec(
        loss=loss,
        metrics={
            "acc": M.Accuracy(features["score"], binary),
            "acc_column": M.Accuracy(features["score"][:, None], binary),
            "acc_logits": M.Accuracy(logit, binary, from_logits=True),
            "acc_03": M.Accuracy(features["score"], binary == 1, threshold=0.3),
            "cm": M.ConfusionMatrix(features["score"], binary, num_classes=2, per_class=True),
        },
    )


def test_binary_scores_of_one_per_example_are_thresholded_like_scikit_learn():
    # Before: a float score per example was truncated to class 0 (accuracy = the share of negatives).
    results = make_estimator(_binary_model_fn).evaluate(DATA)
    predicted = (SCORES > 0.5).astype(int)
    expected = sk.accuracy_score(BINARY, predicted)
    assert expected != pytest.approx(sk.accuracy_score(BINARY, SCORES.astype(int)), abs=0.05)  # far from truncation
    for name in ("acc", "acc_column", "acc_logits", "cm/accuracy"):
        assert results[name] == pytest.approx(expected, abs=1e-12), name
    assert results["acc_03"] == pytest.approx(sk.accuracy_score(BINARY, SCORES > 0.3), abs=1e-12)
    precision, recall, f1, _ = sk.precision_recall_fscore_support(BINARY, predicted, zero_division=0)
    for c in (0, 1):
        assert results[f"cm/precision_{c}"] == pytest.approx(precision[c], abs=1e-12)
        assert results[f"cm/recall_{c}"] == pytest.approx(recall[c], abs=1e-12)
        assert results[f"cm/f1_{c}"] == pytest.approx(f1[c], abs=1e-12)
    assert results["cm/f1_macro"] == pytest.approx(sk.f1_score(BINARY, predicted, average="macro"), abs=1e-12)


@pytest.mark.parametrize(
    ("metric", "match"),
    [
        (lambda s, y, lg: M.Accuracy(lg, y.astype(jnp.float32)), r"metrics\['bad'\] \(Accuracy\).*labels are float32"),
        (lambda s, y, lg: M.TopK(lg, y.astype(jnp.float32), k=2), r"metrics\['bad'\] \(TopK\).*labels are float32"),
        (
            lambda s, y, lg: M.ConfusionMatrix(lg.argmax(-1).astype(jnp.float32), y, num_classes=C),
            r"metrics\['bad'\] \(ConfusionMatrix\).*float32 .* num_classes=10.*never truncated.*Fix:",
        ),
        (lambda s, y, lg: M.ConfusionMatrix(lg[:, :3], y, num_classes=C), r"have 3 classes .* num_classes=10"),
    ],
)
def test_float_class_ids_are_refused_naming_the_metric(metric, match):
    def model_fn(model, features, labels, mode, params):
        loss = optax.softmax_cross_entropy_with_integer_labels(model(features["x"]), labels)
        return ex.Spec(loss=loss, metrics={"bad": metric(features["score"], labels, features["logits"])})

    with pytest.raises(ex.errors.InputError, match=match):
        make_estimator(model_fn).evaluate(DATA)


def test_probabilities_outside_zero_one_are_refused_by_accuracy():
    def model_fn(model, features, labels, mode, params):
        loss = optax.softmax_cross_entropy_with_integer_labels(model(features["x"]), labels)
        return ex.Spec(loss=loss, metrics={"acc": M.Accuracy(features["score"] * 2, labels % 2)})

    expected = int(np.sum(SCORES * 2 > 1))
    with pytest.raises(ex.errors.InputError, match=rf"'acc' \(HitsState\): {expected} valid binary scores .*Fix:"):
        make_estimator(model_fn).evaluate(DATA)


BAD_LABELS = LABELS.copy()
BAD_LABELS[[5, 50, 500, 900]] = [-1, 10, 12, -1]  # outside the classes 0..9
BAD_DATA = ex.data.from_arrays(FEATURES, BAD_LABELS)


def test_labels_outside_the_classes_are_named_in_evaluation():
    # Before: Accuracy over scores counted a label -1 or 10 as a miss without a word, and the loss was NaN.
    def model_fn(model, features, labels, mode, params):
        loss = optax.softmax_cross_entropy_with_integer_labels(features["logits"], labels)
        return ex.Spec(loss=loss, metrics={"acc": M.Accuracy(features["logits"], labels)})

    with pytest.raises(
        ex.errors.InputError,
        match=r"Metric 'acc' \(HitsState\): 4 valid labels are outside the classes 0..9 \(values -1, 10, 12\).*Fix:",
    ):
        make_estimator(model_fn).evaluate(BAD_DATA)
    for metric in (M.TopK(LOGITS, BAD_LABELS, k=2), M.ConfusionMatrix(LOGITS, BAD_LABELS, num_classes=C)):
        state = M.to_host(metric.state(np.ones(N, bool)))
        assert (int(state.labels.count), state.labels.values()) == (4, [-1, 10, 12])
    in_range = np.isin(np.arange(N), [5, 50, 500, 900], invert=True)  # the matrix counts the others only
    matrix = M.to_host(M.ConfusionMatrix(LOGITS, BAD_LABELS, num_classes=C).state(np.ones(N, bool))).matrix
    np.testing.assert_array_equal(matrix, sk.confusion_matrix(LABELS[in_range], LOGITS.argmax(-1)[in_range]))


def test_a_nan_in_evaluation_names_the_metric_and_the_examples(caplog):
    # Before: labels outside the logits gave a NaN loss in the results and nothing else.
    def model_fn(model, features, labels, mode, params):
        return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(features["logits"], labels))

    with caplog.at_level("WARNING", logger="estimax"):
        results = make_estimator(model_fn).evaluate(BAD_DATA)
    assert np.isnan(results["loss"]) and results["num_examples"] == N  # the result is kept
    # -1 wraps around in optax (a finite loss); 10 and 12 are NaN.
    assert f"Metric 'loss' is NaN: 2 of {N} examples have NaN or Inf values" in caplog.text


def _train(model_fn, labels, last_step_apart=False, **config):
    from models import MLP, blobs

    features, _ = blobs(128)
    est = ex.Estimator(
        model=lambda rngs, p: MLP(rngs),
        model_fn=model_fn,
        optimizer=optax.sgd(0.1),
        config=ex.RunConfig(train_batch_size=128, steps_per_loop=2, **config),
    )
    est.core.last_step_apart = last_step_apart  # the loop GPUs run, here on the CPU
    return est.train(ex.data.from_arrays(features, labels), max_steps=2)


def test_labels_outside_the_classes_are_named_in_training():
    labels = np.arange(128, dtype=np.int32) % 3
    labels[[3, 7, 9]] = [5, -1, 5]

    def with_accuracy(model, features, labels, mode, params):
        logits = model(features["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return ex.Spec(loss=loss, metrics={"acc": M.Accuracy(logits, labels)})

    with pytest.raises(
        ex.errors.InputError,
        match=r"Training step 1, metric 'acc' \(HitsState\): 3 labels of the batch are outside the classes 0..2 "
        r"\(values -1, 5\)",
    ):
        _train(with_accuracy, labels)

    # Before: a NonFiniteError that never mentioned labels.
    def loss_only(model, features, labels, mode, params):
        logits = model(features["x"])
        return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    # Step 1 is not its loop's last: its labels are read because its loss is not finite, in both loops.
    for last_step_apart in (False, True):
        with pytest.raises(ex.NonFiniteError, match=r"The loss is not finite on 2 examples, whose labels are 5, 5"):
            _train(loss_only, labels, last_step_apart)


def test_a_loss_that_overflows_is_not_blamed_on_labels_in_range():
    labels = np.arange(128, dtype=np.int32) % 3

    def overflowing(model, features, labels, mode, params):
        logits = model(features["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return ex.Spec(loss=loss * jnp.exp(jnp.float32(100.0)))  # inf on every example: float32 overflows

    with pytest.raises(ex.NonFiniteError, match="The loss is infinite: an overflow") as caught:
        _train(overflowing, labels)
    assert "whose labels are" not in str(caught.value)


def test_metric_names_that_collide_are_refused_before_the_first_step(tmp_path):
    # Before: metrics={"loss": ...} replaced the loss in evaluate(), and "prf/accuracy" the matrix's own field.
    def model_fn(model, features, labels, mode, params):
        logits = model(features["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        metrics = {"prf": M.ConfusionMatrix(logits, labels, num_classes=C)}
        if mode == ex.EVAL:
            metrics.update(params["extra"])
        return ex.Spec(loss=loss, metrics=metrics)

    def estimator(extra, model_dir=None):
        return ex.Estimator(
            model=mlp,
            model_fn=model_fn,
            optimizer=optax.sgd(0.1),
            config=ex.RunConfig(model_dir=model_dir, train_batch_size=32, eval_batch_size=64),
            params={"dropout": 0.0, "classes": C, "extra": extra},
        )

    with pytest.raises(ex.errors.ConfigError, match=r"reports 'loss' twice: the engine's own 'loss' and metric 'loss'"):
        estimator({"loss": jnp.full(64, 42.0)}).evaluate(DATA)
    with pytest.raises(ex.errors.ConfigError, match=r"'num_examples' twice"):
        estimator({"num_examples": jnp.ones(64)}).evaluate(DATA)
    with pytest.raises(
        ex.errors.ConfigError,
        match=r"reports 'prf/accuracy' twice: metric 'prf' \(ConfusionMatrix\)'s field 'prf/accuracy' and metric "
        r"'prf/accuracy'.*Fix: rename",
    ):
        estimator({"prf/accuracy": jnp.ones(64)}).evaluate(DATA)
    est = estimator({"prf/accuracy": jnp.ones(64)}, str(tmp_path / "run"))
    with pytest.raises(ex.errors.ConfigError, match=r"'prf/accuracy' twice"):
        est.train_and_evaluate(DATA, DATA, max_steps=4, eval_every=2)
    assert int(est.state().step) == 0  # refused before the first training step
