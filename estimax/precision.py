"""Mixed precision: compute in a low-precision dtype, keep float32 masters.

Owns the casts around one call of the model_fn: floating parameters and
features go down to the compute dtype (the forward and backward pass run in
it), floating outputs (loss, metrics, predictions) come back up to float32,
and model state keeps its own dtype. Parameters, gradients and optimizer
state stay float32: the cast is differentiated, so gradients reach the
float32 masters. Integer leaves (labels, token ids, RNG keys) are never cast.
Also tells, from a traced model, how much of its matrix work still runs in
float32 (a layer that computes in its own dtype undoes the casts), and warns
when it is most of it.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from estimax.records.flops import equations

logger = logging.getLogger("estimax")


def cast_floating(tree, dtype):
    """``tree`` with every floating leaf cast to ``dtype``; other leaves unchanged."""
    return jax.tree.map(lambda x: x.astype(dtype) if _is_floating(x) else x, tree)


def like(tree, reference):
    """``tree`` with every leaf cast to the dtype of the same leaf of ``reference``."""
    return jax.tree.map(lambda x, r: jnp.asarray(x).astype(r.dtype), tree, reference)


def _is_floating(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, np.floating)


_MATMULS = ("dot_general", "conv_general_dilated")
FLOAT32_SHARE_WARNED = 0.5  # most of the work: a layer or two kept in float32 on purpose is not warned of


def check_matmuls(jaxpr, compute_dtype) -> None:
    """Warns when most of the matrix work of a model traced under ``compute_dtype`` (``jaxpr``)
    still runs in float32: the setting then buys little of its speed or memory."""
    share, wide, total = float32_matmuls(jaxpr)
    if share < FLOAT32_SHARE_WARNED:
        return
    name = jnp.dtype(compute_dtype).name
    logger.warning(
        "RunConfig(compute_dtype=%r): %d of the model's %d matrix products and convolutions (%.0f%% of their "
        "FLOPs) still take float32 operands; expected them in %s. A layer brings float32 back whatever its "
        "parameters' dtype, and every layer after it follows: flax.nnx.Embed does (its dtype defaults to its "
        "param_dtype, float32), and so do normalisation layers not given a dtype. Fix: give such a layer "
        "dtype=jnp.%s, or cast its output to its parameters' dtype (estimax/examples/lm.py casts its embeddings).",
        name,
        wide,
        total,
        100 * share,
        name,
        name,
    )


def float32_matmuls(jaxpr) -> tuple[float, int, int]:
    """``(share of the FLOPs, count, of how many)`` of ``jaxpr``'s matrix products and convolutions
    (those inside loops and other calls counted once) that take a float32 or wider floating operand."""
    wide_flops = all_flops = 0.0
    wide = total = 0
    for eqn in equations(jaxpr):
        if eqn.primitive.name not in _MATMULS:
            continue
        flops = _matmul_flops(eqn)
        is_wide = any(_is_wide_float(v.aval.dtype) for v in eqn.invars[:2])
        total, wide = total + 1, wide + is_wide
        all_flops, wide_flops = all_flops + flops, wide_flops + flops * is_wide
    return (wide_flops / all_flops if all_flops else 0.0), wide, total


def _matmul_flops(eqn) -> float:
    """Multiply-adds x 2: each output element sums over the contracted (or kernel) elements."""
    out = float(np.prod(eqn.outvars[0].aval.shape))
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    if eqn.primitive.name == "dot_general":
        (contracting, _), _ = eqn.params["dimension_numbers"]
        return 2 * out * float(np.prod([lhs[d] for d in contracting]))
    out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2 * out * float(np.prod(rhs)) / out_features / eqn.params["feature_group_count"]


def _is_wide_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize >= 4
