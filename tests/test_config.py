import pytest
from models import blobs, estimator

import estimax as ex


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
