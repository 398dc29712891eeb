"""Gradient accumulation: A micro-batches per step train like one big batch, counted in optimizer steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import Outputs, final_params, saved_checkpoints, start_resumable, train_losses, wait_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import MLP, blobs, estimator, model_fn

import estimax as ex

DATA = ex.data.from_arrays(*blobs(512))


def _train(steps=50, **config):
    outputs = Outputs()
    config = {"train_batch_size": 64, "loop": "scan", "steps_per_loop": 25, "quiet": True, **config}
    est = estimator(None, dropout=0.0, **config).train(DATA, max_steps=steps, hooks=[outputs])
    return est, _params(est), outputs


def _params(est):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(est.model(), nnx.Param))]


@pytest.fixture(scope="module")
def one_batch():
    return _train(grad_accum_steps=1)


@pytest.mark.parametrize("accum", [2, 4, 8])
def test_accumulated_steps_match_one_big_batch(one_batch, accum):
    _, reference, ref_outputs = one_batch
    est, params, outputs = _train(grad_accum_steps=accum)
    assert est.step == 50
    for got, want in zip(params, reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for name in ("loss", "accuracy", "grad_norm"):
        np.testing.assert_allclose(outputs[name], ref_outputs[name], rtol=1e-5, atol=1e-6)


def test_accumulation_under_fsdp_matches_one_replicated_batch(one_batch):
    est, params, outputs = _train(grad_accum_steps=4, mesh={"fsdp": 8}, fsdp_min_bytes=0)
    assert any("fsdp" in tuple(row.spec) for row in est.sharding_plan())  # the state really is sharded
    for got, want in zip(params, one_batch[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(outputs["loss"], one_batch[2]["loss"], rtol=1e-5, atol=1e-6)


def test_a_scalar_loss_is_the_mean_of_equal_micro_batch_means(one_batch):
    def scalar_loss_fn(model, features, labels, mode, params):
        spec = model_fn(model, features, labels, mode, params)
        return spec._replace(loss=jnp.mean(spec.loss), metrics={"accuracy": jnp.mean(spec.metrics["accuracy"])})

    est = ex.Estimator(
        model=lambda rngs, p: MLP(rngs, dropout=0.0),
        model_fn=scalar_loss_fn,
        optimizer=optax.sgd(0.1),
        config=ex.RunConfig(train_batch_size=64, loop="scan", steps_per_loop=25, quiet=True, grad_accum_steps=4),
    )
    est.train(DATA, max_steps=50)
    for got, want in zip(_params(est), one_batch[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def _train_step_before_accumulation(core, state, batch):
    """``Core.train_step`` as it was before gradient accumulation existed (its gradient part, verbatim)."""
    batch_size = jax.tree.leaves(batch[0])[0].shape[0]

    def loss_fn(params):
        spec, module = core.call(params, state, batch, ex.TRAIN, batch_size)
        return jnp.mean(spec.loss), (spec, core.adapter.model_state(module))

    (loss, (spec, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = core.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return ex.TrainState(state.step + 1, params, opt_state, model_state, state.rng), loss


def test_one_micro_batch_is_bit_identical_to_the_step_before_accumulation():
    features, labels = blobs(64 * 6)
    batches = [({"x": features["x"][64 * i : 64 * (i + 1)]}, labels[64 * i : 64 * (i + 1)]) for i in range(6)]
    outputs = Outputs()
    est = estimator(None, dropout=0.3, train_batch_size=64, loop="scan", steps_per_loop=3, quiet=True)
    initial = jax.device_get(est.state())
    est.train(batches, max_steps=6, hooks=[outputs])

    replicated, stacked = NamedSharding(est.mesh, P()), NamedSharding(est.mesh, P(None, "data"))
    reference = jax.jit(
        lambda s, stack: jax.lax.scan(lambda s, b: _train_step_before_accumulation(est.core, s, b), s, stack),
        in_shardings=(replicated, stacked),
        out_shardings=(replicated, replicated),
    )
    state, losses = jax.device_put(initial, replicated), []
    for first in (0, 3):
        stack = jax.tree.map(lambda *xs: np.stack(xs), *batches[first : first + 3])
        state, loss = reference(state, stack)
        losses.append(np.asarray(loss))
    np.testing.assert_array_equal(outputs["loss"], np.concatenate(losses))
    for got, want in zip(_params(est), jax.tree.leaves(jax.device_get(state.params)), strict=True):
        np.testing.assert_array_equal(got, want)  # bitwise, dropout included


def test_steps_and_schedules_count_optimizer_updates():
    schedule = optax.linear_schedule(0.1, 0.01, transition_steps=12)
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    outputs = Outputs()
    est = estimator(None, optimizer=optimizer, train_batch_size=64, grad_accum_steps=4, steps_per_loop=4, quiet=True)
    est.train(DATA, max_steps=12, hooks=[outputs])
    assert est.step == 12 and len(outputs["loss"]) == 12
    assert int(jax.device_get(est.state().opt_state.count)) == 12  # one optimizer update per step
    np.testing.assert_allclose(outputs["learning_rate"], [schedule(n) for n in range(12)], rtol=1e-6)
    assert outputs["learning_rate"][-1] == pytest.approx(float(schedule(11)))


def test_strided_micro_batches_gather_nothing():
    est = estimator(None, train_batch_size=64, grad_accum_steps=4, loop="step", steps_per_loop=1, quiet=True)
    est.train(DATA, max_steps=1)
    features, labels = blobs(64)
    batch = jax.device_put(({"x": features["x"]}, labels), NamedSharding(est.mesh, P("data")))
    hlo = jax.jit(est.core.train_step).lower(est.state(), batch).compile().as_text()
    assert "all-reduce" in hlo  # the gradient is reduced over the devices ...
    assert "all-gather" not in hlo and "all-to-all" not in hlo  # ... and no rows of the batch move


class MaskRecorder(nnx.Module):
    """Keeps the dropout mask of the first row of its last ``slots`` calls in its (non-trained) state."""

    def __init__(self, rngs, slots=4, width=64):
        self.w = nnx.Param(jnp.ones((width,)))
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.masks = nnx.BatchStat(jnp.zeros((slots, width)))

    def __call__(self, x):
        kept = (self.drop(jnp.ones_like(x)) > 0).astype(jnp.float32)
        self.masks[...] = jnp.roll(self.masks[...], 1, axis=0).at[0].set(kept[0])
        return jnp.sum(x * self.w * kept, axis=-1)


def test_each_micro_batch_draws_its_own_dropout_mask():
    est = ex.Estimator(
        model=lambda rngs, p: MaskRecorder(rngs),
        model_fn=lambda model, f, y, mode, p: ex.Spec(loss=jnp.square(model(f["x"]) - y)),
        optimizer=optax.sgd(0.0),
        config=ex.RunConfig(train_batch_size=32, grad_accum_steps=4, quiet=True),
    )
    ones = np.ones((32, 64), np.float32)
    est.train([({"x": ones}, np.zeros(32, np.float32))], max_steps=1)
    masks = np.asarray(est.model().masks[...])
    assert masks.sum() > 0 and len({m.tobytes() for m in masks}) == 4  # four calls, four different masks


class Normalized(nnx.Module):
    def __init__(self, rngs, momentum=0.9):
        self.norm = nnx.BatchNorm(6, momentum=momentum, rngs=rngs)
        self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(x))


def test_batch_statistics_update_once_per_micro_batch():
    features, labels = blobs(32)
    est = ex.Estimator(
        model=lambda rngs, p: Normalized(rngs),
        model_fn=model_fn,
        optimizer=optax.sgd(0.1),
        config=ex.RunConfig(train_batch_size=32, grad_accum_steps=2, quiet=True),
    )
    est.train([(features, labels)], max_steps=1)
    mean = np.asarray(est.model().norm.mean[...])
    # Micro-batch i is rows i, i+2, ...: two moving-average updates, in order, from zero.
    first, second = features["x"][0::2].mean(0), features["x"][1::2].mean(0)
    np.testing.assert_allclose(mean, 0.1 * (0.9 * first + second), rtol=1e-5, atol=1e-6)
    assert not np.allclose(mean, 0.1 * features["x"].mean(0), atol=1e-3)  # not one big batch's update


def test_killed_and_resumed_with_accumulation_is_bitwise_identical(tmp_path):
    steps = 16
    uninterrupted, resumed = str(tmp_path / "uninterrupted"), str(tmp_path / "resumed")
    process = start_resumable(uninterrupted, steps, "accum=2")
    assert process.wait(timeout=120) == 0, process.stdout.read()
    process = start_resumable(resumed, steps, "accum=2")
    wait_for(process, lambda: max(saved_checkpoints(resumed)[0] or [0]) >= 6)
    process.kill()
    process.wait()
    assert max(saved_checkpoints(resumed)[0]) < steps
    process = start_resumable(resumed, steps, "accum=2")
    assert process.wait(timeout=120) == 0, process.stdout.read()
    (step, params), (ref_step, ref_params) = final_params(resumed), final_params(uninterrupted)
    assert step == ref_step == steps
    for name, value in ref_params.items():
        np.testing.assert_array_equal(params[name], value)
    assert train_losses(resumed) == train_losses(uninterrupted)


def test_a_batch_that_does_not_split_is_refused_before_compiling():
    with pytest.raises(
        ValueError,
        match=r"train_batch_size=60\) does not split into grad_accum_steps=8 .* use train_batch_size 56 or 64\.",
    ):
        ex.RunConfig(train_batch_size=60, grad_accum_steps=8)
    with pytest.raises(ValueError, match=r"grad_accum_steps=0\) must be a positive integer"):
        ex.RunConfig(grad_accum_steps=0)
    est = estimator(None, train_batch_size=80, grad_accum_steps=4)
    with pytest.raises(
        ValueError,
        match=r"train_batch_size=80\) with grad_accum_steps=4 does not split into 4 micro-batches over the 8 "
        r"batch shards; expected a multiple of 4 x 8 = 32\. Fix: use train_batch_size 64 or 96",
    ):
        est.train(DATA, max_steps=1)
    assert est.compiled() == ex.Compiled("auto")  # nothing was compiled


def test_optax_multisteps_still_trains_but_warns_that_steps_are_mini_steps():
    with pytest.warns(UserWarning, match=r"optax.MultiSteps.*count mini-steps.*grad_accum_steps=k"):
        est = estimator(None, optimizer=optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), quiet=True)
    est.train(DATA, max_steps=8)
    assert est.step == 8 and int(jax.device_get(est.state().opt_state.gradient_step)) == 4
