"""Recurrent and time-distributed layers inside the device loop, against unrolled references.

The LSTM (``nnx.RNN``, a ``lax.scan`` over time) is compared with the same
cell called in a Python loop over time steps (unrolled when traced); the
time-distributed layer (``nnx.vmap`` over time) with the same layer called
once per time step in a Python loop. Both ways: gradients of one batch, and
whole training runs (``loop="scan"``, 4 steps per loop, 8 devices) against a
hand-written ``jax.jit`` loop over the reference model.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import estimax as ex
from estimax.examples import lstm, time_distributed

BATCH, STEPS, K = 32, 8, 4


def unrolled_lstm(model: lstm.LSTM, x):
    cell = model.rnn.cell
    zeros = jnp.zeros((x.shape[0], model.units), x.dtype)
    carry = (zeros, zeros)
    for t in range(x.shape[1]):
        carry, _ = cell(carry, x[:, t])
    return carry[1]


def per_step_time_distributed(model: time_distributed.TimeDistributed, x):
    return jnp.stack([model.layer(x[:, t]) for t in range(x.shape[1])], axis=1)


def _mse(outputs, labels):
    return jnp.mean(jnp.square(outputs - labels))


def _grads(module, forward, x, y):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    loss = lambda p: _mse(forward(nnx.merge(graphdef, p, rest), x), y)  # noqa: E731
    return jax.jit(jax.grad(loss))(params)


def _max_differences(grads, reference):
    a = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
    b = np.concatenate([np.ravel(g) for g in jax.tree.leaves(reference)])
    return float(np.max(np.abs(a - b))), float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _batch(input_shape, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((BATCH, *input_shape), dtype=np.float32), rng.random((BATCH, 10), dtype=np.float32)


def test_lstm_gradients_equal_an_unrolled_loop():
    module = lstm.build_model(nnx.Rngs(0), {})
    x, y = _batch(lstm.INPUT_SHAPE)
    grads = _grads(module, lambda m, x: m(x), x, y)
    reference = _grads(module, unrolled_lstm, x, y)
    max_abs, max_rel = _max_differences(grads, reference)
    print(f"LSTM vs unrolled: max abs {max_abs:.3g}, max rel {max_rel:.3g}")
    assert max_abs <= 1e-5 and max_rel <= 1e-5


def test_time_distributed_gradients_equal_a_per_step_loop():
    module = time_distributed.build_model(nnx.Rngs(0), {})
    x, y = _batch(time_distributed.INPUT_SHAPE)
    grads = _grads(module, lambda m, x: m(x), x, y)
    reference = _grads(module, per_step_time_distributed, x, y)
    max_abs, max_rel = _max_differences(grads, reference)
    print(f"TimeDistributed vs per-step loop: max abs {max_abs:.3g}, max rel {max_rel:.3g}")
    assert max_abs <= 1e-5 and max_rel <= 1e-5


def _train_against_reference(example, reference_forward):
    """estimax (scan of K steps, 8 devices) against a jit-per-step loop of the reference model, same batches."""
    data = example.regression.random_data(example.INPUT_SHAPE, 256)
    config = ex.RunConfig(train_batch_size=BATCH, steps_per_loop=K, loop="scan", log_every_steps=100)
    est = example.estimator(config).train(data, max_steps=STEPS)

    graphdef, params, rest = nnx.split(example.build_model(nnx.Rngs(0), {}), nnx.Param, ...)
    optimizer = optax.sgd(example.regression.LEARNING_RATE)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss = lambda p: _mse(reference_forward(nnx.merge(graphdef, p, rest), x), y)  # noqa: E731
        updates, opt_state = optimizer.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for features, labels in itertools.islice(data.train_batches(BATCH, seed=0), STEPS):
        params, opt_state = step(params, opt_state, features["x"], labels)
    trained = nnx.state(est.model(), nnx.Param)
    return _max_differences(jax.tree.leaves(trained), jax.tree.leaves(params))


def test_lstm_trains_in_the_device_loop_like_an_unrolled_reference():
    max_abs, max_rel = _train_against_reference(lstm, unrolled_lstm)
    assert max_rel <= 1e-5, (max_abs, max_rel)


def test_time_distributed_trains_in_the_device_loop_like_a_per_step_reference():
    max_abs, max_rel = _train_against_reference(time_distributed, per_step_time_distributed)
    assert max_rel <= 1e-5, (max_abs, max_rel)


def _program_size(fn, *args) -> int:
    return len(jax.jit(fn).lower(*args).as_text())


def test_program_does_not_grow_with_sequence_length():
    est = lstm.estimator(ex.RunConfig(train_batch_size=BATCH, steps_per_loop=K, loop="scan"))
    state = est.state()

    def stack(time_steps):
        features = {"x": jax.ShapeDtypeStruct((K, BATCH, time_steps, 10), jnp.float32)}
        return features, jax.ShapeDtypeStruct((K, BATCH, 10), jnp.float32)

    short, long = (_program_size(est.core.train_loop, state, stack(t)) for t in (10, 40))
    print(f"train loop program: T=10 {short} chars, T=40 {long} chars")
    assert long <= 1.05 * short

    # The measure can tell: the unrolled reference grows with T.
    module = lstm.build_model(nnx.Rngs(0), {})
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    unrolled = lambda p, x: unrolled_lstm(nnx.merge(graphdef, p, rest), x).sum()  # noqa: E731
    sizes = [_program_size(jax.grad(unrolled), params, jnp.zeros((BATCH, t, 10))) for t in (10, 40)]
    print(f"unrolled gradient program: T=10 {sizes[0]} chars, T=40 {sizes[1]} chars")
    assert sizes[1] > 2 * sizes[0]
