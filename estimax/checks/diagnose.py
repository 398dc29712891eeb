"""Errors a model_fn raises on the input, retold as estimax errors that name the input.

Owns turning what JAX, Optax or the user's code raised while a model_fn was
traced (a feature the input lacks, labels missing or of another shape or
dtype than the loss expects, features of another shape than the model was
built for, a loss computed in PREDICT mode where labels are None) into a
``ModelFnError`` that names the value, what was expected and the fix, with
the original error chained. Whether labels are the cause is decided by
tracing the model_fn again on the same features without them (PREDICT mode):
if it fails alike, the features are. Tracing runs before anything is
compiled, so these errors come before the first step.
Does not own checking what a model_fn returns (``checks/spec.py``) nor the
input itself (``data.checks``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from estimax.errors import ModelFnError

# Raised when Python code branches on a traced value: JAX's message and export's say what to change.
_TRACING_ERRORS = (jax.errors.ConcretizationTypeError, jax.errors.InconclusiveDimensionOperation)


def model_fn_error(
    error: Exception, features, labels, mode, without_labels: Callable[[], object] | None = None
) -> ModelFnError | None:
    """The estimax error for ``error``, or ``None`` to let it pass as it is.

    ``without_labels()`` traces the model_fn again on the same features in PREDICT mode with no
    labels; it tells a model that cannot take the features from a loss that cannot take the labels.
    """
    said = _first_line(error)
    received = f"features {describe(features)}, labels {describe(labels)}"
    if isinstance(error, KeyError) and isinstance(features, dict) and error.args and error.args[0] not in features:
        return ModelFnError(
            f"model_fn read features[{error.args[0]!r}] in {mode} mode, which the input lacks; the input has "
            f"features {sorted(map(str, features))}. Fix: add {error.args[0]!r} to the input's features, or read "
            "one of those."
        )
    if isinstance(error, _TRACING_ERRORS):  # JAX's own message says what to change
        return None
    if labels is not None and without_labels is not None and _fails_alike(without_labels, said):
        return ModelFnError(
            f"model_fn cannot take the input's features in {mode} mode: {said}; it fails alike without labels "
            f"(in predict mode), so the labels are not the cause; the input has features {describe(features)}. "
            "Fix: feed features of the shapes the model was built for (the error names the two shapes that "
            "disagree), or build the model for these."
        )
    if mode == "predict" and labels is None:
        return ModelFnError(
            f"model_fn raised in predict mode, where labels is None (predict() of an input without labels, and "
            f"export(), pass none): {said}; it received features {describe(features)}. Fix: return the "
            "predictions before anything that needs labels, e.g. `if mode == ex.PREDICT: return "
            "ex.Spec(predictions={'class': logits.argmax(-1)})` (if it already does, the features are not of "
            "the shapes the model was built for)."
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


def _fails_alike(call: Callable[[], object], said: str) -> bool:
    try:
        call()
    except Exception as error:
        return _first_line(error) == said
    return False


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
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(":. ")  # the message goes on after it
