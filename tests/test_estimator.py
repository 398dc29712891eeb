"""Training, evaluation and prediction against references, on 8 simulated devices."""

import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import MLP, blobs, estimator, model_fn

import estimax as ex


def _param_leaves(est):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(est.model(), nnx.Param))]


def _max_relative(a, b):
    return max(float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-12)) for x, y in zip(a, b, strict=True))


@pytest.mark.quick
def test_training_matches_a_handwritten_jit_loop():
    features, labels = blobs(256)
    data = ex.data.from_arrays(features, labels)
    est = estimator(dropout=0.0, loop="scan", steps_per_loop=5).train(data, max_steps=12)

    # Reference: one device, one jax.jit call per step, same initialisation and batches.
    graphdef, params, rest = nnx.split(MLP(nnx.Rngs(0), dropout=0.0), nnx.Param, ...)
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss(p):
            logits = nnx.merge(graphdef, p, rest)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        updates, opt_state = optimizer.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for f, y in itertools.islice(data.train_batches(32, seed=0), 12):
        params, opt_state = step(params, opt_state, f["x"], y)
    reference = [np.asarray(x) for x in jax.tree.leaves(params)]
    assert _max_relative(_param_leaves(est), reference) <= 1e-5


def _predictions_after(steps, **config):
    features, labels = blobs(256)
    est = estimator(**config).train(ex.data.from_arrays(features, labels), max_steps=steps)
    return [np.stack([r["logits"] for r in est.predict(ex.data.from_arrays(features))])], est


@pytest.mark.quick
def test_results_do_not_depend_on_steps_per_loop_mode_or_device_count():
    (k1,), _ = _predictions_after(14, steps_per_loop=1, loop="scan")
    (k4,), _ = _predictions_after(14, steps_per_loop=4, loop="scan")
    (k7,), _ = _predictions_after(14, steps_per_loop=7, loop="scan")
    (k4_step,), _ = _predictions_after(14, steps_per_loop=4, loop="step")
    (one_device,), _ = _predictions_after(14, steps_per_loop=4, loop="scan", num_devices=1)
    for other in (k4, k7, k4_step):
        assert _max_relative([other], [k1]) <= 1e-6
    assert _max_relative([one_device], [k4]) <= 1e-5
    # Dropout is active: a run without it ends elsewhere.
    (no_dropout,), _ = _predictions_after(14, steps_per_loop=4, loop="scan", dropout=0.0)
    assert _max_relative([no_dropout], [k4]) > 1e-3


def test_only_the_shorter_final_loop_compiles_again():
    features, labels = blobs(256)
    data = ex.data.from_arrays(features, labels)
    est = estimator(loop="scan", steps_per_loop=4, eval_batch_size=64)
    est.train(data, max_steps=14)  # loops of 4, 4, 4, 2
    assert est.compiled().train_scan == 2
    est.train(data, steps=8)  # two more full loops
    est.evaluate(data)
    est.evaluate(data)
    assert est.compiled() == ex.Compiled("scan", train_scan=2, eval_step=1)
    assert est.step == 22


def test_step_mode_compiles_one_step():
    features, labels = blobs(256)
    est = estimator(loop="step", steps_per_loop=4).train(ex.data.from_arrays(features, labels), max_steps=14)
    assert est.compiled() == ex.Compiled("step", train_step=1)


class _TinyCNN(nnx.Module):
    def __init__(self, rngs, params):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.out = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.conv(x.reshape(-1, 3, 2, 1))).mean(axis=(1, 2)))


def test_auto_chooses_from_the_traced_step_without_compiling_the_other_mode(estimax_log):
    features, labels = blobs(512)
    data = ex.data.from_arrays(features, labels)
    est = estimator(loop="auto", steps_per_loop=16, dropout=0.0).train(data, max_steps=40)
    config = ex.RunConfig(train_batch_size=32, steps_per_loop=16)
    cnn = ex.Estimator(_TinyCNN, model_fn, optax.sgd(0.1), config=config).train(data, max_steps=40)
    assert (est.compiled().loop, est.compiled().train_step) == ("scan", 0)
    assert (cnn.compiled().loop, cnn.compiled().train_scan) == ("step", 0)
    assert "loop=auto: using scan: no convolution in the training step" in estimax_log.text
    assert "loop=auto: using step: the training step has 2 convolutions" in estimax_log.text  # forward, kernel gradient
    reference = estimator(loop="scan", steps_per_loop=16, dropout=0.0).train(data, max_steps=40)
    assert all(np.array_equal(a, b) for a, b in zip(_param_leaves(est), _param_leaves(reference), strict=True))


def test_a_resumed_auto_run_keeps_the_mode_of_its_checkpoint(tmp_path, estimax_log):
    data = ex.data.from_arrays(*blobs(512))
    model_dir = str(tmp_path / "run")
    estimator(model_dir, loop="step", steps_per_loop=4, save_every_steps=4).train(data, max_steps=8)
    estimax_log.clear()
    resumed = estimator(model_dir, loop="auto", steps_per_loop=4).train(data, max_steps=16)
    assert (resumed.compiled().loop, resumed.compiled().train_scan) == ("step", 0)
    assert "loop=auto: using step, the loop the checkpoint of step 8 was trained with" in estimax_log.text
    assert "no convolution" not in estimax_log.text  # not chosen again


@pytest.mark.quick
def test_evaluate_counts_every_example_once():
    features, labels = blobs(1001, seed=1)
    est = estimator(eval_batch_size=64).train(ex.data.from_arrays(*blobs(512)), max_steps=20)
    results = est.evaluate(ex.data.from_arrays(features, labels))

    logits = np.asarray(est.model()(jnp.asarray(features["x"])))
    log_probs = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    assert results["num_examples"] == 1001
    np.testing.assert_allclose(results["accuracy"], np.mean(logits.argmax(-1) == labels), rtol=1e-6)
    np.testing.assert_allclose(results["loss"], -np.mean(log_probs[np.arange(1001), labels]), rtol=1e-5)


def test_evaluate_steps_limits_the_batches():
    features, labels = blobs(1001)
    est = estimator(eval_batch_size=64)
    assert est.evaluate(ex.data.from_arrays(features, labels), steps=3)["num_examples"] == 192


@pytest.mark.quick
def test_predict_returns_every_example_in_order():
    features, _ = blobs(1001, seed=2)
    est = estimator(predict_batch_size=64).train(ex.data.from_arrays(*blobs(512)), max_steps=8)
    rows = list(est.predict(ex.data.from_arrays(features)))
    assert len(rows) == 1001 and isinstance(rows[0]["logits"], np.ndarray)
    expected = np.asarray(est.model()(jnp.asarray(features["x"])))
    np.testing.assert_allclose(np.stack([r["logits"] for r in rows]), expected, rtol=1e-5, atol=1e-6)
    assert [int(r["class"]) for r in rows] == list(expected.argmax(-1))


def _scalar_metric_fn(model, features, labels, mode, params):
    spec = model_fn(model, features, labels, mode, params)
    if mode == ex.PREDICT:
        return spec
    return spec._replace(metrics={"accuracy": jnp.mean(spec.metrics["accuracy"])})


def test_scalar_metrics_are_refused_only_on_padded_batches():
    est = ex.Estimator(
        model=lambda rngs, p: MLP(rngs),
        model_fn=_scalar_metric_fn,
        optimizer=optax.sgd(0.1),
        config=ex.RunConfig(train_batch_size=32, eval_batch_size=64),
    )
    full = est.evaluate(ex.data.from_arrays(*blobs(1024)))
    assert full["num_examples"] == 1024
    with pytest.raises(ValueError, match=r"scalar \['accuracy'\].*padded \(41 valid rows\)"):
        est.evaluate(ex.data.from_arrays(*blobs(1001)))


def test_plain_iterables_of_host_batches():
    features, labels = blobs(320)
    batches = [({"x": features["x"][i : i + 32]}, labels[i : i + 32]) for i in range(0, 320, 32)]
    est = estimator(steps_per_loop=4).train(batches, max_steps=100)
    assert est.step == 10  # the input ran out
    assert est.evaluate(batches)["num_examples"] == 320
    assert len(list(est.predict([(b[0], None) for b in batches]))) == 320


def test_epochs_train_whole_passes(caplog):
    data = ex.data.from_arrays(*blobs(1000))
    with caplog.at_level("INFO", logger="estimax"):
        est = estimator(train_batch_size=64).train(data, epochs=2)
    assert est.step == 2 * 15
    assert "15 steps of 64 examples; 40 examples per epoch are dropped" in caplog.text


@pytest.mark.quick
def test_checkpoints_restore_in_a_new_estimator(model_dir):
    data = ex.data.from_arrays(*blobs(256))
    first = estimator(model_dir, save_every_steps=4).train(data, max_steps=12)
    assert sorted(int(d) for d in os.listdir(os.path.join(model_dir, "checkpoints"))) == [4, 8, 12]
    second = estimator(model_dir, save_every_steps=4)
    assert second.step == 12
    for a, b in zip(_param_leaves(first), _param_leaves(second), strict=True):
        np.testing.assert_array_equal(a, b)
    assert second.evaluate(data) == first.evaluate(data)
    second.train(data, steps=4)
    assert second.step == 16 and estimator(model_dir).step == 16


def test_metrics_file_logs_crossed_steps_and_evaluations(model_dir):
    data = ex.data.from_arrays(*blobs(256))
    est = estimator(model_dir, steps_per_loop=4, log_every_steps=10).train(data, max_steps=24)
    est.evaluate(data)
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == [12, 20, 24]  # loops end at 4, 8, 12, ...: 10 and 20 crossed, then the end
    assert all(isinstance(r[k], float) for r in train for k in ("loss", "accuracy"))
    # Throughput is timed between loops (not the first: compilation; not the last: no loop after it).
    assert all(isinstance(r[k], float) for r in train[:2] for k in ("steps_per_sec", "examples_per_sec"))
    assert "steps_per_sec" not in train[2]
    (evaluation,) = [r for r in records if r["split"] == "eval"]
    assert evaluation["step"] == 24 and evaluation["num_examples"] == 256


def test_loops_make_no_implicit_transfers():
    data = ex.data.from_arrays(*blobs(256))
    est = estimator(loop="scan")
    assert est.step == 0  # initialises outside the guard
    with jax.transfer_guard("disallow"):
        est.train(data, max_steps=8)
        est.evaluate(data)
        list(est.predict(data))


def test_a_state_donated_outside_estimax_is_one_clear_error():
    est = estimator(steps_per_loop=2).train(ex.data.from_arrays(*blobs(64)), max_steps=2)
    jax.jit(lambda state: state, donate_argnums=0)(est.state())  # the user's own program takes the arrays
    with pytest.raises(ex.EstimaxError, match=r"state of step 2 has arrays that were deleted or donated.*jnp.copy"):
        est.train(ex.data.from_arrays(*blobs(64)), max_steps=4)
