"""Mixed precision: bfloat16 compute, float32 parameters, optimizer state and model state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import blobs

import estimax as ex

DATA = ex.data.from_arrays(*blobs(512))


class Net(nnx.Module):
    def __init__(self, rngs, dtype=None):
        self.l1 = nnx.Linear(6, 64, rngs=rngs)
        # Flax normalisation computes statistics in float32 and returns float32 unless given a dtype.
        self.bn = nnx.BatchNorm(64, dtype=dtype, rngs=rngs)
        self.l2 = nnx.Linear(64, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def _run(compute_dtype, seen):
    def model_fn(model, features, labels, mode, params):
        logits = model(features["x"])
        seen.update({"features": features["x"].dtype, "kernel": model.l1.kernel[...].dtype, "logits": logits.dtype})
        if mode == ex.PREDICT:
            return ex.Spec(predictions={"logits": logits})
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
        return ex.Spec(loss=loss, metrics={"accuracy": logits.argmax(-1) == labels})

    config = ex.RunConfig(train_batch_size=64, steps_per_loop=10, loop="scan", compute_dtype=compute_dtype)
    factory = lambda rngs, p: Net(rngs, compute_dtype)  # noqa: E731
    est = ex.Estimator(model=factory, model_fn=model_fn, optimizer=optax.adam(1e-2), config=config)
    before = est.evaluate(DATA)["loss"]
    after = est.train(DATA, max_steps=30).evaluate(DATA)["loss"]
    return before, after, est


def _floating_dtypes(tree):
    return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_bfloat16_compute_keeps_float32_masters_and_a_close_loss():
    seen32, seen16 = {}, {}
    before32, after32, _ = _run(None, seen32)
    before16, after16, est = _run("bfloat16", seen16)
    print(f"eval loss float32 {before32:.5f} -> {after32:.5f}; bfloat16 {before16:.5f} -> {after16:.5f}")

    assert set(seen32.values()) == {jnp.dtype(jnp.float32)}
    assert set(seen16.values()) == {jnp.dtype(jnp.bfloat16)}  # the forward runs in bfloat16
    state = est.state()
    assert _floating_dtypes(state.params) == {"float32"}
    assert _floating_dtypes(state.opt_state) == {"float32"}
    assert _floating_dtypes(state.model_state) == {"float32"}  # batch statistics
    (row, *_) = est.predict(DATA)
    assert row["logits"].dtype == np.float32  # outputs leave in float32

    np.testing.assert_allclose(before16, before32, rtol=1e-2)
    np.testing.assert_allclose(after16, after32, rtol=5e-2)
    assert after16 < 0.5 * before16  # it trained


def test_compute_dtype_is_checked():
    with pytest.raises(ValueError, match=r"compute_dtype='int8'\) is not a supported compute dtype; expected one of"):
        ex.RunConfig(compute_dtype="int8")


class Embedded(nnx.Module):
    """Token ids -> class logits through nnx.Embed, whose output is float32 (its dtype defaults to
    its param_dtype) whatever its table holds, unless ``cast`` brings it to the table's dtype."""

    def __init__(self, rngs, cast: bool):
        self.embed = nnx.Embed(32, 64, rngs=rngs)
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.out = nnx.Linear(64, 3, rngs=rngs)
        self.cast = cast

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.cast:
            x = x.astype(self.embed.embedding.dtype)
        return self.out(nnx.relu(self.hidden(x)))


@pytest.mark.parametrize(
    "compute_dtype, cast, warned", [("bfloat16", False, True), ("bfloat16", True, False), (None, False, False)]
)
def test_matrix_work_left_in_float32_is_warned_of_with_the_fix(estimax_log, compute_dtype, cast, warned):
    tokens = np.random.default_rng(0).integers(0, 32, (256,)).astype(np.int32)
    labels = (tokens % 3).astype(np.int32)

    def model_fn(model, features, labels, mode, params):
        logits = model(features["tokens"]).astype(jnp.float32)
        return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels))

    config = ex.RunConfig(train_batch_size=32, steps_per_loop=2, compute_dtype=compute_dtype, quiet=True)
    est = ex.Estimator(
        model=lambda rngs, p: Embedded(rngs, cast), model_fn=model_fn, optimizer=optax.sgd(0.1), config=config
    )
    est.train(ex.data.from_arrays({"tokens": tokens}, labels), max_steps=4)
    warnings = [r.getMessage() for r in estimax_log.records if "still take float32 operands" in r.getMessage()]
    assert bool(warnings) == warned, warnings
    if warned:  # both matrix products, all of their FLOPs, and what to do
        (message,) = warnings
        assert "compute_dtype='bfloat16'): 2 of the model's 2 matrix products" in message
        assert "(100% of their FLOPs)" in message and "nnx.Embed" in message and "dtype=jnp.bfloat16" in message
