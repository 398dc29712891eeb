"""Errors a model_fn raises on the input, retold as estimax errors that name the input.

Owns turning what JAX, Optax or the user's code raised while a model_fn was
traced (a feature the input lacks, labels missing or of another shape or
dtype than the loss expects) into a ``ModelFnError`` that names the value,
what was expected and the fix, with the original error chained. Tracing runs
before anything is compiled, so these errors come before the first step.
Does not own checking what a model_fn returns (``step.check_spec``) nor the
input itself (``data.checks``).
"""

from __future__ import annotations

import jax
import numpy as np

from estimax.errors import ModelFnError


def model_fn_error(error: Exception, features, labels, mode) -> ModelFnError | None:
    """The estimax error for ``error``, or ``None`` to let it pass as it is (in PREDICT mode only a
    missing feature is retold: there are no labels, and export explains its own tracing errors)."""
    said = _first_line(error)
    received = f"features {describe(features)}, labels {describe(labels)}"
    if isinstance(error, KeyError) and isinstance(features, dict) and error.args and error.args[0] not in features:
        return ModelFnError(
            f"model_fn read features[{error.args[0]!r}] in {mode} mode, which the input lacks; the input has "
            f"features {sorted(map(str, features))}. Fix: add {error.args[0]!r} to the input's features, or read "
            "one of those."
        )
    if mode == "predict":
        return None
    if labels is None:
        return ModelFnError(
            f"model_fn raised in {mode} mode, and the input has no labels (labels is None): {said}; it received "
            f"{received}. Fix: give the input labels, e.g. ex.data.from_arrays(features, labels), or make model_fn "
            "work without them."
        )
    return ModelFnError(
        f"model_fn raised in {mode} mode: {said}; it received {received}. Fix: if the loss expects other labels, "
        "convert them in the input: integer class ids of shape (batch,) for optax.*_with_integer_labels losses, "
        "one-hot floats of shape (batch, classes) for optax.softmax_cross_entropy, floats of shape (batch,) for "
        "regression."
    )


def describe(tree) -> str:
    """``{'x': float32 (32, 6)}``: dtype and shape of every array of a pytree."""
    if tree is None:
        return "None"
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    parts = [f"{jax.tree_util.keystr(p) or 'array'}: {_dtype(x)} {tuple(np.shape(x))}" for p, x in leaves]
    return "{" + ", ".join(parts) + "}"


def _dtype(x) -> str:
    return str(getattr(x, "dtype", type(x).__name__))


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
