"""Mixed precision: compute in a low-precision dtype, keep float32 masters.

Owns the casts around one call of the model_fn: floating parameters and
features go down to the compute dtype (the forward and backward pass run in
it), floating outputs (loss, metrics, predictions) come back up to float32,
and model state keeps its own dtype. Parameters, gradients and optimizer
state stay float32: the cast is differentiated, so gradients reach the
float32 masters. Integer leaves (labels, token ids, RNG keys) are never cast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from estimax.errors import ConfigError

COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


def check_compute_dtype(name: str | None) -> None:
    if name is not None and name not in COMPUTE_DTYPES:
        raise ConfigError(
            f"RunConfig(compute_dtype={name!r}) is not a supported compute dtype; expected one of "
            f"{COMPUTE_DTYPES} or None (compute in the parameters' dtype)."
        )


def cast_floating(tree, dtype):
    """``tree`` with every floating leaf cast to ``dtype``; other leaves unchanged."""
    return jax.tree.map(lambda x: x.astype(dtype) if _is_floating(x) else x, tree)


def like(tree, reference):
    """``tree`` with every leaf cast to the dtype of the same leaf of ``reference``."""
    return jax.tree.map(lambda x, r: jnp.asarray(x).astype(r.dtype), tree, reference)


def _is_floating(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, np.floating)
