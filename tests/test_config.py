import os
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P
from models import blobs, estimator

import estimax as ex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_batch_size_must_divide_the_devices():
    est = estimator(train_batch_size=30)
    with pytest.raises(ValueError, match=r"train_batch_size=30\) does not divide the 8 devices.*use 24 or 32"):
        est.train(ex.data.from_arrays(*blobs(64)), max_steps=1)
    with pytest.raises(ValueError, match=r"eval_batch_size=4\) does not divide the 8 devices.*use 8"):
        estimator(eval_batch_size=4).evaluate(ex.data.from_arrays(*blobs(64)))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("train_batch_size", 0, "must be a positive integer"),
        ("steps_per_loop", 2.5, "must be a positive integer"),
        ("loop", "unrolled", "expected one of"),
    ],
)
def test_config_values_are_validated(field, value, message):
    with pytest.raises(ValueError, match=rf"{field}=.*{message}"):
        ex.RunConfig(**{field: value})


def test_config_imports_no_jax_and_no_writers():
    """Settings only: a RunConfig is built and checked without JAX, so the command line checks its flags without it."""
    code = (
        "import sys, estimax.config as c; c.RunConfig(mesh={'data': 2}, sharding_rules=[('a', ('data',))]); "
        "print(sorted(m for m in sys.modules if m == 'jax' or m in ('estimax.layout', 'estimax.trackers')))"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}  # this checkout
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


def test_mesh_and_sharding_rules_are_checked_at_run_config():
    assert ex.RunConfig(sharding_rules=[("a/.*", P("data", None))]).sharding_rules == (("a/.*", ("data", None)),)
    with pytest.raises(TypeError, match=r"RunConfig\(mesh=...\) has axis name 3; expected a non-empty string"):
        ex.RunConfig(mesh={3: 2})
    with pytest.raises(ValueError, match=r"sharding_rules=...\)\[0\]: '\(' is not a regex"):
        ex.RunConfig(sharding_rules=[("(", ("data",))])
    with pytest.raises(ValueError, match=r"compute_dtype='int8'\) is not a supported compute dtype"):
        ex.RunConfig(compute_dtype="int8")


def test_more_devices_than_available():
    with pytest.raises(ValueError, match=r"num_devices=9\) exceeds the 8 devices"):
        estimator(num_devices=9)


def test_train_needs_exactly_one_length():
    est = estimator()
    data = ex.data.from_arrays(*blobs(64))
    with pytest.raises(ValueError, match="expected exactly one of them"):
        est.train(data)
    with pytest.raises(ValueError, match="expected exactly one of them"):
        est.train(data, max_steps=3, epochs=1)
    with pytest.raises(TypeError, match=r"Counting in epochs needs an input of known size"):
        est.train([({"x": data.features["x"][:32]}, data.labels[:32])], epochs=1)


def test_best_says_which_direction_is_better():
    assert [ex.Best(name).direction for name in ("loss", "val_mse", "error_rate")] == ["min"] * 3
    assert [ex.Best(name).direction for name in ("accuracy", "top5_acc", "auc", "macro_f1")] == ["max"] * 4
    assert ex.Best("score", "min").direction == "min"
    with pytest.raises(
        ex.errors.ConfigError,
        match=r"Best\(metric='score'\) does not say whether higher or lower is better; expected direction='max' "
        r"or 'min'\. Fix: Best\('score', direction='max'\)",
    ):
        ex.Best("score")
    with pytest.raises(ex.errors.ConfigError, match=r"Best\(direction='up'\); expected 'max' or 'min'"):
        ex.Best("loss", "up")
    with pytest.raises(ValueError, match=r"Best\(patience=0\) must be a positive integer"):
        ex.Best(patience=0)
