"""A wrong model_fn fails before compiling, with a message that says what to do."""

import jax.numpy as jnp
import optax
import pytest
from models import MLP, blobs, model_fn

import estimax as ex

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def _estimator(fn, **config):
    config.setdefault("train_batch_size", 32)
    return ex.Estimator(
        model=lambda rngs, p: MLP(rngs), model_fn=fn, optimizer=optax.sgd(0.1), config=ex.RunConfig(**config)
    )


DATA = ex.data.from_arrays(*blobs(128))


def test_model_fn_signature_is_checked_at_construction():
    with pytest.raises(TypeError, match=r"five positional arguments"):
        _estimator(lambda model, features, labels, mode: None)
    with pytest.raises(TypeError, match=r"model_fn=.*not callable"):
        _estimator("model_fn")
    with pytest.raises(TypeError, match=r"optax GradientTransformation"):
        ex.Estimator(model=lambda rngs, p: MLP(rngs), model_fn=model_fn, optimizer=0.1)


def test_model_factory_must_build_an_nnx_module():
    with pytest.raises(TypeError, match=r"returned an array or number; expected a Flax nnx.Module"):
        ex.Estimator(model=lambda rngs, p: 3, model_fn=model_fn, optimizer=optax.sgd(0.1))


def test_train_needs_a_loss():
    est = _estimator(lambda m, f, y, mode, p: ex.Spec(metrics={"a": m(f["x"]).sum(-1)}))
    with pytest.raises(ValueError, match=r"Spec\(loss=None\) in TRAIN mode"):
        est.train(DATA, max_steps=1)


def test_predict_needs_predictions_with_a_batch_axis():
    est = _estimator(lambda m, f, y, mode, p: ex.Spec(loss=m(f["x"]).sum(-1)), predict_batch_size=32)
    with pytest.raises(ValueError, match=r"Spec\(predictions=None\) in PREDICT mode"):
        list(est.predict(DATA))
    est = _estimator(lambda m, f, y, mode, p: ex.Spec(predictions={"total": m(f["x"]).sum()}))
    with pytest.raises(ValueError, match=r"prediction \['total'\] has shape \(\); expected the batch \(32\)"):
        list(est.predict(DATA))


def test_loss_must_be_per_example_or_scalar():
    est = _estimator(lambda m, f, y, mode, p: ex.Spec(loss=m(f["x"])))
    with pytest.raises(ValueError, match=r"loss has shape \(32, 3\) in train mode; expected .* \(32,\) or a scalar"):
        est.train(DATA, max_steps=1)


def test_model_fn_must_return_a_spec():
    est = _estimator(lambda m, f, y, mode, p: jnp.mean(m(f["x"])))
    with pytest.raises(TypeError, match=r"returned ArrayImpl|returned .*expected estimax.Spec"):
        est.train(DATA, max_steps=1)


def test_scalar_loss_trains():
    fn = lambda m, f, y, mode, p: ex.Spec(  # noqa: E731
        loss=optax.softmax_cross_entropy_with_integer_labels(m(f["x"]), y).mean()
    )
    assert _estimator(fn).train(DATA, max_steps=3).step == 3


def test_params_batch_size_is_the_global_batch_of_the_mode():
    seen = {}

    def fn(model, features, labels, mode, params):
        seen[str(mode)] = params["batch_size"]
        return model_fn(model, features, labels, mode, params)

    est = _estimator(fn, eval_batch_size=64, predict_batch_size=16)
    est.train(DATA, max_steps=1)
    est.evaluate(DATA)
    list(est.predict(DATA))
    assert seen == {"train": 32, "eval": 64, "predict": 16}
