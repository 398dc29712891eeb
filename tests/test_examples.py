"""The bundled examples at small size: the two 2018 programs and the MNIST model, on 8 devices."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import estimax as ex
from estimax import cli
from estimax.examples import digits, lstm, mnist, regression, time_distributed

EXAMPLES = [lstm, time_distributed]


def _params(est):
    return [np.asarray(x) for x in jax.tree.leaves(est.state().params)]


def _train(example, steps, **config):
    config = {"train_batch_size": 64, "log_every_steps": 100, **config}
    data = regression.random_data(example.INPUT_SHAPE, 256)
    return example.estimator(ex.RunConfig(**config)).train(data, max_steps=steps), data


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_2018_program_gives_the_same_result_with_and_without_the_device_loop(example):
    looped, data = _train(example, 10, steps_per_loop=2, loop="scan")
    stepped, _ = _train(example, 10, steps_per_loop=1)
    for a, b in zip(_params(looped), _params(stepped), strict=True):
        assert np.max(np.abs(a - b)) <= 1e-6 * np.max(np.abs(b))
    results = looped.evaluate(data)
    assert np.isfinite(results["loss"]) and results["loss"] == stepped.evaluate(data)["loss"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_2018_program_loss_decreases_over_a_longer_run(example):
    est, data = _train(example, 0, steps_per_loop=25, loop="scan")
    losses = [est.train(data, max_steps=steps).evaluate(data)["loss"] for steps in (0, 100, 200, 300)]
    assert np.all(np.isfinite(losses)) and np.all(np.diff(losses) < 0), losses


@pytest.mark.parametrize("name", ["lstm", "time_distributed"])
def test_cli_trains_evaluates_and_predicts_the_example(name, tmp_path, capsys):
    model_dir, output = str(tmp_path / name), str(tmp_path / "predictions.jsonl")
    common = ["--example", name, "--model-dir", model_dir, "--batch-size", "64"]
    assert cli.main(["train", *common, "--max-steps", "4"]) == 0
    assert "after 4 steps" in capsys.readouterr().out
    assert cli.main(["evaluate", *common]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_examples"] == 1024
    assert cli.main(["predict", *common, "--output", output]) == 0
    assert "1024 predictions" in capsys.readouterr().out
    with open(output) as f:
        first = json.loads(f.readline())
    assert first["index"] == 0 and len(first["output"]) == 10


def test_mnist_model_trains_one_step_with_the_decaying_schedule():
    schedule = mnist.learning_rate()
    assert float(schedule(0)) == pytest.approx(0.05)
    assert float(schedule(99_999)) == pytest.approx(0.05)
    assert float(schedule(100_000)) == pytest.approx(0.05 * 0.96)
    # The optimizer's first update is plain SGD at 0.05.
    grads = {"w": jax.numpy.arange(4.0)}
    optimizer = mnist.optimizer()
    updates, _ = optimizer.update(grads, optimizer.init(grads), grads)
    np.testing.assert_allclose(updates["w"], -0.05 * np.arange(4.0), rtol=1e-6)

    assert isinstance(nnx.eval_shape(lambda: mnist.build_model(nnx.Rngs(0), {})), digits.CNN)
    rng = np.random.default_rng(0)
    data = ex.data.from_arrays(
        {"image": rng.random((16, 28, 28), dtype=np.float32)}, rng.integers(0, 10, 16).astype(np.int32)
    )
    est = mnist.estimator(ex.RunConfig(train_batch_size=8, steps_per_loop=1, loop="step"))
    initial = _params(est)
    est.train(data, max_steps=1)
    assert est.step == 1
    assert all(np.max(np.abs(t - s)) > 0 for t, s in zip(_params(est), initial, strict=True))
    assert all(np.all(np.isfinite(t)) for t in _params(est))


def test_the_digits_cnn_computes_its_convolutions_like_lax():
    """The digits CNN's convolutions as matrix products of shifted windows (``windowed_conv``): its values and
    gradients against ``lax.conv_general_dilated``'s, at its layers' shapes and others; a call it does not
    compute itself (a stride of 2) goes to lax as it is."""
    rng = np.random.default_rng(0)
    for features_in, features_out, kernel, size, strides in [(1, 32, 5, 8, 1), (32, 64, 5, 4, 1), (3, 8, 4, 7, 1),
                                                              (2, 3, 3, 5, 2)]:  # fmt: skip
        x = jnp.asarray(rng.standard_normal((3, size, size, features_in)), jnp.float32)
        layers = [
            nnx.Conv(features_in, features_out, (kernel, kernel), strides, padding="SAME", rngs=nnx.Rngs(0), **conv)
            for conv in ({}, {"conv_general_dilated": digits.windowed_conv})
        ]
        (expected, expected_grads), (got, grads) = [
            nnx.value_and_grad(lambda layer, x: (layer(x) ** 2).sum(), argnums=(0, 1))(layer, x) for layer in layers
        ]
        np.testing.assert_allclose(got, expected, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
