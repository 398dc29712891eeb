"""Adapters: the same tiny network through NNX, Linen, Keras 3 and plain functions trains the same.

Every adapter starts from the weights of one NNX network (copied across), is
trained by the same Estimator settings on 8 devices, and is compared with the
NNX run: evaluation loss before and after training, and predictions.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import blobs

import estimax as ex

keras = pytest.importorskip("keras")

DATA = ex.data.from_arrays(*blobs(256))
FEATURES = ex.data.from_arrays(blobs(256)[0])


class NNXNet(nnx.Module):
    """6 -> 32 -> (batch norm) -> relu -> 3."""

    def __init__(self, rngs, batch_norm=False):
        self.l1 = nnx.Linear(6, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs) if batch_norm else None
        self.l2 = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        return self.l2(nnx.relu(self.bn(h) if self.bn is not None else h))


def _initial_weights():
    net = NNXNet(nnx.Rngs(7))
    return [np.asarray(v[...]) for v in (net.l1.kernel, net.l1.bias, net.l2.kernel, net.l2.bias)]


WEIGHTS = _initial_weights()


def _weights():
    return WEIGHTS


def _nnx_factory(batch_norm=False):
    w1, b1, w2, b2 = _weights()

    def factory(rngs, params):
        net = NNXNet(rngs, batch_norm)
        for var, value in ((net.l1.kernel, w1), (net.l1.bias, b1), (net.l2.kernel, w2), (net.l2.bias, b2)):
            var[...] = jnp.asarray(value)
        return net

    return factory


class LinenNet(nn.Module):
    batch_norm: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        w1, b1, w2, b2 = _weights()
        const = lambda value: lambda *_: jnp.asarray(value)  # noqa: E731
        h = nn.Dense(32, kernel_init=const(w1), bias_init=const(b1))(x)
        if self.batch_norm:
            h = nn.BatchNorm(use_running_average=not train, momentum=0.99, epsilon=1e-5)(h)
        return nn.Dense(3, kernel_init=const(w2), bias_init=const(b2))(nn.relu(h))


def _keras_net(batch_norm=False):
    layers = [keras.Input((6,)), keras.layers.Dense(32)]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(momentum=0.99, epsilon=1e-5))
    model = keras.Sequential([*layers, keras.layers.Activation("relu"), keras.layers.Dense(3)])
    w1, b1, w2, b2 = _weights()
    model.layers[0].set_weights([w1, b1])
    model.layers[-1].set_weights([w2, b2])
    return model


def _model_fn(call):
    def model_fn(model, features, labels, mode, params):
        logits = call(model, features["x"], mode)
        if mode == ex.PREDICT:
            return ex.Spec(predictions=logits)
        return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    return model_fn


def _run(model, call=lambda m, x, mode: m(x), steps=8):
    config = ex.RunConfig(train_batch_size=32, steps_per_loop=4, loop="scan", log_every_steps=100)
    est = ex.Estimator(model=model, model_fn=_model_fn(call), optimizer=optax.sgd(0.1), config=config)
    before = est.evaluate(DATA)["loss"]
    est.train(DATA, max_steps=steps)
    predictions = np.stack(list(est.predict(FEATURES)))
    return before, est.evaluate(DATA)["loss"], predictions, est


def _assert_same_run(run, reference, rtol=1e-5):
    np.testing.assert_allclose(run[0], reference[0], rtol=rtol)
    np.testing.assert_allclose(run[1], reference[1], rtol=rtol)
    np.testing.assert_allclose(run[2], reference[2], rtol=rtol * 10, atol=1e-5)
    assert run[1] < 0.8 * run[0]  # it trained


@pytest.fixture(scope="module")
def nnx_run():
    return _run(_nnx_factory())


@pytest.fixture(scope="module")
def nnx_batch_norm_run():
    return _run(_nnx_factory(batch_norm=True))


def test_wrapped_nnx_factory_is_the_bare_factory(nnx_run):
    _assert_same_run(_run(ex.models.nnx(_nnx_factory())), nnx_run, rtol=1e-7)


def test_linen_trains_like_nnx(nnx_run):
    run = _run(ex.models.linen(LinenNet(), jnp.zeros((1, 6))))
    _assert_same_run(run, nnx_run)
    assert isinstance(run[3].model(), nn.Module)  # bound to the trained variables
    np.testing.assert_allclose(run[3].model()(jnp.asarray(blobs(256)[0]["x"])), run[2], rtol=1e-5, atol=1e-6)


def test_functional_trains_like_nnx(nnx_run):
    w1, b1, w2, b2 = _weights()
    seen_rngs = []

    def init(rng):
        return {"w1": jnp.asarray(w1), "b1": jnp.asarray(b1), "w2": jnp.asarray(w2), "b2": jnp.asarray(b2)}

    def apply(params, x, rng):
        seen_rngs.append(rng is not None)
        return nnx.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]

    _assert_same_run(_run(ex.models.functional(init, apply)), nnx_run)
    assert True in seen_rngs and False in seen_rngs  # a key in TRAIN, None in EVAL and PREDICT


def test_keras_trains_like_nnx(nnx_run):
    model = _keras_net()
    run = _run(ex.models.keras(model))
    _assert_same_run(run, nnx_run)
    assert run[3].model() is model  # the user's model, trained weights assigned
    np.testing.assert_allclose(model.predict(blobs(256)[0]["x"], verbose=0), run[2], rtol=1e-5, atol=1e-5)


def _stats(est):
    """Running mean and variance of the single batch norm layer, whatever the adapter."""
    state = est.state().model_state
    leaves = [np.asarray(x) for x in jax.tree.leaves(state) if np.asarray(x).dtype == np.float32]
    return sorted(leaves, key=lambda a: float(a.mean()))


def test_batch_norm_state_updates_in_train_and_is_used_in_eval(nnx_batch_norm_run):
    reference = nnx_batch_norm_run
    train_flag = lambda m, x, mode: m(x, train=mode == ex.TRAIN)  # noqa: E731
    linen = _run(ex.models.linen(LinenNet(batch_norm=True), jnp.zeros((1, 6))), train_flag)
    keras_run = _run(ex.models.keras(_keras_net(batch_norm=True)))
    for run in (linen, keras_run):
        _assert_same_run(run, reference, rtol=2e-5)
        for got, expected in zip(_stats(run[3]), _stats(reference[3]), strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # The statistics moved away from their initial (0, 1) in TRAIN, and EVAL uses them (not the batch's).
    mean, var = _stats(linen[3])
    assert np.abs(mean).max() > 1e-3 and np.abs(var - 1).max() > 1e-3
    variables = {"params": linen[3].state().params, **linen[3].state().model_state}
    expected = LinenNet(batch_norm=True).apply(variables, jnp.asarray(blobs(256)[0]["x"]), train=False)
    np.testing.assert_allclose(linen[2], expected, rtol=1e-5, atol=1e-6)


def test_linen_dropout_draws_from_the_step_key():
    class Dropped(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dense(3)(nn.Dropout(0.5, deterministic=not train)(nn.Dense(32)(x)))

    model = ex.models.linen(Dropped(), jnp.zeros((1, 6)))
    call = lambda m, x, mode: m(x, train=mode == ex.TRAIN)  # noqa: E731
    scan = _run(model, call, steps=8)
    config = ex.RunConfig(train_batch_size=32, steps_per_loop=1, loop="step")
    est = ex.Estimator(model=model, model_fn=_model_fn(call), optimizer=optax.sgd(0.1), config=config)
    est.train(DATA, max_steps=8)
    np.testing.assert_allclose(np.stack(list(est.predict(FEATURES))), scan[2], rtol=1e-5, atol=1e-6)


def test_models_passed_without_their_adapter_are_refused_with_the_fix():
    fn = _model_fn(lambda m, x, mode: m(x))
    with pytest.raises(TypeError, match=r"received a Flax Linen module \(LinenNet\).*ex.models.linen\(module"):
        ex.Estimator(model=LinenNet(), model_fn=fn, optimizer=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"received a Keras model \(Sequential\).*ex.models.keras\(keras_model\)"):
        ex.Estimator(model=_keras_net(), model_fn=fn, optimizer=optax.sgd(0.1))

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(TypeError, match=r"received a Keras model \(Subclassed\)"):
        ex.Estimator(model=Subclassed(), model_fn=fn, optimizer=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"Flax NNX module instance.*a factory, not an instance"):
        ex.Estimator(model=NNXNet(nnx.Rngs(0)), model_fn=fn, optimizer=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"signature \(params, features, rng\); expected an NNX factory.*functional"):
        ex.Estimator(model=lambda params, features, rng: features, model_fn=fn, optimizer=optax.sgd(0.1))


def test_wrapper_arguments_are_checked():
    with pytest.raises(ValueError, match=r"functional\(init=None\) is not a function; expected `init\(rng\)"):
        ex.models.functional(apply=lambda params, x, rng: x)
    with pytest.raises(TypeError, match=r"apply=...\) has signature \(params, x\); expected .*3 positional"):
        ex.models.functional(lambda rng: {}, lambda params, x: x)
    with pytest.raises(ValueError, match=r"linen\(LinenNet\(...\)\) received no example input"):
        ex.models.linen(LinenNet())
    with pytest.raises(TypeError, match=r"linen\(module=...\) received NNXNet; expected a flax.linen.Module"):
        ex.models.linen(NNXNet(nnx.Rngs(0)), jnp.zeros((1, 6)))
    with pytest.raises(ValueError, match=r"unbuilt Keras model"):
        ex.models.keras(keras.Sequential([keras.layers.Dense(3)]))


def test_keras_on_another_backend_is_refused(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "tensorflow")
    with pytest.raises(ValueError, match=r"on the 'tensorflow' backend; expected the 'jax' backend.*KERAS_BACKEND=jax"):
        ex.models.keras(_keras_net())


@pytest.mark.parametrize("kind", ["linen", "keras"])
def test_adapter_state_checkpoints_and_restores_in_a_new_estimator(kind, model_dir):
    def make():
        if kind == "linen":
            return ex.models.linen(LinenNet(batch_norm=True), jnp.zeros((1, 6))), lambda m, x, mode: m(
                x, mode == ex.TRAIN
            )
        return ex.models.keras(_keras_net(batch_norm=True)), lambda m, x, mode: m(x)

    config = ex.RunConfig(model_dir=model_dir, train_batch_size=32, steps_per_loop=4, loop="scan")
    model, call = make()
    first = ex.Estimator(model=model, model_fn=_model_fn(call), optimizer=optax.adam(0.1), config=config)
    first.train(DATA, max_steps=8)
    model, call = make()
    second = ex.Estimator(model=model, model_fn=_model_fn(call), optimizer=optax.adam(0.1), config=config)
    assert second.step == 8 and second.evaluate(DATA) == first.evaluate(DATA)
    assert second.train(DATA, max_steps=12).step == 12


def test_the_interactive_model_survives_further_training():
    est = ex.Estimator(model=_nnx_factory(), model_fn=_model_fn(lambda m, x, mode: m(x)), optimizer=optax.sgd(0.1))
    est.train(DATA, max_steps=2)
    model = est.model()
    expected = np.asarray(model(jnp.ones((2, 6))))
    est.train(DATA, max_steps=4)  # donates the state's buffers
    np.testing.assert_array_equal(model(jnp.ones((2, 6))), expected)
