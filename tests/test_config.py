import os
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P
from models import blobs, estimator

import estimax as ex

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

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
        ("loop", "unrolled", "expected one of"),
        ("seed", -1, "out of range; expected an integer from 0 to 2\\*\\*63 - 1"),
        ("seed", 2**70, "out of range"),
        ("sync_timeout_seconds", 0, "must be a number above 0"),
    ],
)
def test_config_values_are_validated(field, value, message):
    with pytest.raises(ex.ConfigError, match=rf"{field}=.*{message}") as caught:
        ex.RunConfig(**{field: value})
    assert not isinstance(caught.value, TypeError)


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"steps_per_loop": 2.5}, "steps_per_loop=2.5\\) is of type float; expected an integer"),
        ({"train_batch_size": "32"}, "train_batch_size='32'\\) is of type str; expected an integer"),
        ({"seed": "abc"}, "seed='abc'\\) is of type str; expected an integer"),
        ({"seed": 1.5}, "seed=1.5\\) is of type float"),
        ({"checkpoint": 1000}, "checkpoint=1000\\) is of type int; expected a CheckpointPolicy"),
        ({"checkpoint": 1000, "save_every_steps": 10}, "expected a CheckpointPolicy"),
        ({"quiet": "yes"}, "quiet='yes'\\) is of type str; expected True or False"),
        ({"tensorboard": 1}, "tensorboard=1\\) is of type int; expected True or False"),
        ({"model_dir": 123}, "model_dir=123\\) is of type int; expected a path"),
        ({"loop": 3}, "loop=3\\) is of type int; expected a string"),
    ],
)
def test_a_setting_of_the_wrong_type_is_a_type_error_naming_it(settings, expected):
    with pytest.raises(ex.ConfigTypeError, match=expected) as caught:
        ex.RunConfig(**settings)
    assert isinstance(caught.value, TypeError)


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"keep": "3"}, (ex.ConfigTypeError, "keep='3'\\) is of type str")),
        ({"every_seconds": "60"}, (ex.ConfigTypeError, "every_seconds='60'\\) is of type str")),
        ({"async_save": "no"}, (ex.ConfigTypeError, "async_save='no'\\) is of type str")),
        ({"keep": 0}, (ex.ConfigError, "keep=0\\) must be a positive integer")),
        ({"max_overhead": 2}, (ex.ConfigError, "max_overhead=2\\) is not a fraction")),
    ],
)
def test_checkpoint_policy_values_are_checked_when_it_is_made(settings, expected):
    kind, message = expected
    with pytest.raises(kind, match=message):
        ex.CheckpointPolicy(**settings)


def test_numpy_integers_and_flags_are_accepted_as_plain_values(tmp_path):
    import numpy as np

    config = ex.RunConfig(
        train_batch_size=np.int64(32), steps_per_loop=np.int32(4), seed=np.uint32(7), quiet=np.True_,
        checkpoint=ex.CheckpointPolicy(every_steps=np.int64(4), keep=np.int16(2), every_seconds=np.float32(30)),
    )  # fmt: skip
    assert type(config.train_batch_size) is int and type(config.seed) is int and config.quiet is True
    assert type(config.checkpoint.keep) is int and type(config.checkpoint.every_seconds) is float
    reference = estimator(str(tmp_path / "plain"), train_batch_size=32, steps_per_loop=4, seed=7)
    numpy = estimator(
        str(tmp_path / "numpy"), train_batch_size=np.int64(32), steps_per_loop=np.int32(4), seed=np.uint32(7)
    )
    for est in (reference, numpy):
        est.train(ex.data.from_arrays(*blobs(64)), max_steps=8)
    assert reference.evaluate(ex.data.from_arrays(*blobs(64))) == numpy.evaluate(ex.data.from_arrays(*blobs(64)))


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


def test_features_in_jax_float_dtypes_are_accepted():
    """bfloat16 features train; float8 ones reach the model, whose own limit is the error (no input check)."""
    import jax.numpy as jnp
    import numpy as np

    features, labels = blobs(64)
    narrow = {"x": features["x"].astype(jnp.bfloat16)}
    est = estimator()
    est.train(ex.data.from_arrays(narrow, labels), max_steps=4)
    assert est.step == 4 and np.isfinite(est.evaluate(ex.data.from_arrays(narrow, labels))["loss"])
    eight_bits = {"x": features["x"].astype(jnp.float8_e4m3fn)}
    with pytest.raises(ex.ModelFnError, match="model_fn cannot take the input's features.*8-bit floats"):
        estimator().train(ex.data.from_arrays(eight_bits, labels), max_steps=4)
