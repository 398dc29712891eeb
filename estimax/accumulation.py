"""Gradient accumulation: one optimizer step over several micro-batches of the global batch.

Owns the strided split of a global batch into micro-batches, the scan that
sums gradients, losses and metrics over them, the check that a batch splits
evenly, and the warning for ``optax.MultiSteps``. Does not own the model call
or the optimizer update (``step.py``), nor where arrays live (the mesh).

Exactness: per-example losses and metrics are summed over every micro-batch
and divided by the number of examples of the global batch, so the step sees
the gradient of the global batch's mean loss (up to float rounding), not the
mean of micro-batch means. A scalar loss or metric (a micro-batch mean) is
weighted by its rows, which is the mean of the micro-batch means: exact only
because every micro-batch has the same number of rows (training batches are
never padded).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from estimax import metrics as metrics_lib


def split(batch, num_micro_batches: int):
    """``(B, ...) -> (A, B // A, ...)`` for every leaf: micro-batch ``i`` holds rows ``i, i + A, ...``.

    Strided, not contiguous: a device's block of rows of the global batch
    holds whole groups of ``A`` rows, so each micro-batch keeps the batch's
    sharding and no rows move between devices (a contiguous split makes the
    compiler gather the batch).
    """

    def one(x):
        return jnp.swapaxes(x.reshape((x.shape[0] // num_micro_batches, num_micro_batches) + x.shape[1:]), 0, 1)

    return jax.tree.map(one, batch)


def accumulate(loss_fn: Callable, params, model_state, batch, num_micro_batches: int):
    """The gradient, loss and metrics of ``batch``, computed over ``num_micro_batches`` micro-batches.

    ``loss_fn(params, model_state, micro_batch, index) -> (loss, (metrics, model_state))``
    returns per-example values ``(rows,)`` (or scalars) and the model state
    after the micro-batch, which the next micro-batch starts from.

    Returns ``(loss, metrics, model_state, grads)``: the loss and metrics are
    sums over all rows divided by the rows of ``batch``, ``grads`` the gradient
    of that loss, accumulated in float32 and returned in the parameters'
    dtypes.
    """
    micro_batches = split(batch, num_micro_batches)
    rows = jax.tree.leaves(batch)[0].shape[0]
    micro_rows = rows // num_micro_batches

    def summed(params, model_state, micro_batch, index):
        loss, (metrics, model_state) = loss_fn(params, model_state, micro_batch, index)
        totals = {k: _total(v, micro_rows) for k, v in metrics.items()}  # metric inputs: their states
        return _total(loss, micro_rows), (totals, model_state)

    def body(carry, micro):
        grad_sum, loss_sum, metric_sums, model_state = carry
        (loss, (metrics, model_state)), grads = jax.value_and_grad(summed, has_aux=True)(params, model_state, *micro)
        grad_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads)
        metric_sums = {k: _merge(metric_sums[k], v) for k, v in metrics.items()}
        return (grad_sum, loss_sum + loss, metric_sums, model_state), None

    first = jax.tree.map(lambda x: x[0], micro_batches)
    metric_shapes = jax.eval_shape(summed, params, model_state, first, 0)[1][0]
    zeros = (
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
        jnp.zeros((), jnp.float32),
        {k: _empty(m) for k, m in metric_shapes.items()},
        model_state,
    )
    indices = jnp.arange(num_micro_batches, dtype=jnp.uint32)
    (grad_sum, loss_sum, metric_sums, model_state), _ = jax.lax.scan(body, zeros, (micro_batches, indices))
    grads = jax.tree.map(lambda s, p: (s / rows).astype(p.dtype), grad_sum, params)
    metrics = {k: v if isinstance(v, metrics_lib.Metric) else v / rows for k, v in metric_sums.items()}
    return loss_sum / rows, metrics, model_state, grads


def _total(values, rows: int):
    """Per-example values: their sum; a scalar (a micro-batch mean): weighted by the micro-batch's rows;
    metric inputs: their state (training micro-batches have no padding)."""
    if metrics_lib.is_metric_inputs(values):
        return values.state(jnp.ones((rows,), bool))
    values = jnp.asarray(values, jnp.float32)
    return jnp.sum(values) if values.ndim else values * rows


def _merge(total, value):
    return total.merge(value) if isinstance(total, metrics_lib.Metric) else total + value


def _empty(shape):
    if isinstance(shape, metrics_lib.Metric):
        return jax.tree.map(jnp.asarray, metrics_lib.empty_like(shape))
    return jnp.zeros(shape.shape, jnp.float32)


def warn_if_multisteps(opt_state) -> None:
    """``optax.MultiSteps`` accumulates across optimizer calls: the engine's step then counts mini-steps."""
    is_multisteps = lambda x: isinstance(x, optax.MultiStepsState)  # noqa: E731
    if any(is_multisteps(x) for x in jax.tree.leaves(opt_state, is_leaf=is_multisteps)):
        warnings.warn(
            "The optimizer is an optax.MultiSteps: it applies an update every k calls, so the step "
            "counter, max_steps, checkpoints and logs count mini-steps, not optimizer updates. "
            "Fix: pass the inner optimizer and RunConfig(grad_accum_steps=k), which accumulates "
            "inside one step (and needs no gradient buffer in the optimizer state).",
            UserWarning,
            stacklevel=3,
        )
