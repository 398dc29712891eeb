"""What a model_fn writes in ``Spec(metrics=...)``: the built-in metrics' inputs of one batch,
and how the engine turns a Spec's metrics into states (plain per-example values are ``Mean``s).

Owns argument checks of the built-ins (before anything compiles); the states
are ``states``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from estimax.errors import ConfigError, EstimaxError
from estimax.metrics.classification import AUCState, ConfusionState, HitsState
from estimax.metrics.protocol import Inputs, Metric, empty_like, results
from estimax.metrics.states import (
    MaxState,
    MeanState,
    MinState,
    MomentsState,
    SumState,
)


def batch_states(values: dict, mask: jax.Array) -> dict[str, Metric]:
    """The state of one batch of every metric; plain per-example values are ``Mean``s."""
    return {k: _state(k, v if isinstance(v, Inputs) else Mean(v), mask) for k, v in values.items()}


def _state(name: str, inputs: Inputs, mask: jax.Array) -> Metric:
    """``inputs.state(mask)``; an input error (raised while tracing) names the metric."""
    try:
        return inputs.state(mask)
    except EstimaxError as error:
        raise type(error)(f"metrics[{name!r}] ({type(inputs).__name__}): {error}") from error


def result_names(values: dict, batch_size: int) -> list[str]:
    """The names an evaluation reports for these (abstract) ``eval_values``: ``"name/field"`` for
    metrics of several values, read from the result of an empty state."""
    names = []
    for name, value in values.items():
        if not isinstance(value, Inputs):
            names.append(name)
            continue
        mask = jax.ShapeDtypeStruct((batch_size,), jnp.bool_)
        state = jax.eval_shape(lambda v, m, name=name: _state(name, v, m), value, mask)
        try:
            names.extend(results(name, empty_like(state)))
        except Exception:  # a user's compute that needs examples: its name alone
            names.append(name)
    return names


def train_outputs(metrics: dict | None, batch_size: int) -> dict:
    """Per-step training outputs: plain values as their batch mean, metric inputs as states."""
    outputs, full = {}, None
    for name, value in (metrics or {}).items():
        if isinstance(value, Metric):  # a state already (merged over micro-batches)
            outputs[name] = value
        elif isinstance(value, Inputs):
            full = jnp.ones((batch_size,), bool) if full is None else full  # training batches have no padding
            outputs[name] = _state(name, value, full)
        else:
            outputs[name] = jnp.mean(jnp.asarray(value, jnp.float32))
    return outputs


class Mean(Inputs):
    """Mean of ``values`` over valid rows (all their elements), weighted by ``weights`` if given.

    Result: ``name``. Plain per-example arrays in ``Spec(metrics=...)`` are ``Mean``s.

    Args:
        values: one row per example.
        weights: broadcast to the shape of ``values`` (numpy rules), or ``None`` (all 1).
    """

    def __init__(self, values, weights=None):
        super().__init__(MeanState, values, weights=weights)


class Sum(Inputs):
    """Sum over valid rows; bool and integer values sum exactly as integers. Result: ``name``."""

    def __init__(self, values):
        super().__init__(SumState, values)


class Min(Inputs):
    """Smallest value over valid rows (+inf, or the dtype's largest integer, if none). Result: ``name``."""

    def __init__(self, values):
        super().__init__(MinState, values)


class Max(Inputs):
    """Largest value over valid rows (-inf, or the dtype's smallest integer, if none). Result: ``name``."""

    def __init__(self, values):
        super().__init__(MaxState, values)


class Std(Inputs):
    """Population standard deviation (``ddof=0``, like ``np.std``) over valid rows. Result: ``name``."""

    def __init__(self, values):
        super().__init__(MomentsState, values)


def _binary_config(metric: str, threshold, from_logits) -> dict:
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)):
        raise ConfigError(
            f"{metric}(threshold={threshold!r}); expected a number (default 0.5, or 0 with from_logits=True)."
        )
    return {"threshold": None if threshold is None else float(threshold), "from_logits": bool(from_logits)}


class Accuracy(Inputs):
    """Fraction of valid rows whose predicted class equals the label.

    Floats are never truncated to class ids: labels must be integers or bools.
    Labels outside the classes of the scores, and probabilities outside [0, 1]
    or NaN, make the result raise. Result: ``name``.

    Args:
        predictions: integer class ids shaped like ``labels``; scores with one
            more (class) axis, reduced by argmax; or, for a binary task, one float
            score per example (shape like ``labels``, or a class axis of size 1).
        labels: integer or bool class ids.
        threshold: a binary score above it is class 1; default 0.5 for a
            probability, 0 for a logit.
        from_logits: the binary scores are logits, not probabilities.
    """

    def __init__(self, predictions, labels, *, threshold: float | None = None, from_logits: bool = False):
        super().__init__(HitsState, predictions, labels, **_binary_config("Accuracy", threshold, from_logits))


class TopK(Inputs):
    """Fraction of valid rows whose label is among the ``k`` highest ``scores``.

    Ties at the boundary count as hits, like ``tf.nn.in_top_k``. Result: ``name``.

    Args:
        scores: one score per class, shaped ``(..., num_classes)``.
        labels: integer class ids.
        k: how many of the highest scores count as hits.
    """

    def __init__(self, scores, labels, k: int = 5):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"TopK(k={k!r}); expected a positive integer, e.g. TopK(logits, labels, k=5).")
        super().__init__(HitsState, scores, labels, k=k)


class ConfusionMatrix(Inputs):
    """The ``num_classes x num_classes`` matrix of valid (label, prediction) counts, and what follows from it.

    Results ``name/accuracy``, ``name/{precision,recall,f1}_{macro,micro}``,
    ``name/mean_per_class_accuracy`` (= ``recall_macro``) and, with
    ``per_class=True``, ``name/{precision,recall,f1}_<c>``. A class with no
    prediction has precision 0, one with no example recall 0, and F1 is 0
    when both are (scikit-learn's ``zero_division=0``, over all
    ``num_classes`` classes). Device memory: ``num_classes**2`` int32.

    Args:
        predictions: class ids, or scores with one more (class) axis of size
            ``num_classes`` (argmax); with ``num_classes=2`` also one float score per
            example, thresholded as ``Accuracy`` does (``threshold``, ``from_logits``).
        labels: integer or bool class ids.
        num_classes: the number of classes.
        per_class: also the results of each class.
        threshold: as ``Accuracy``'s, for one float score per example.
        from_logits: as ``Accuracy``'s, for one float score per example.
    """

    def __init__(
        self,
        predictions,
        labels,
        num_classes: int,
        per_class: bool = False,
        *,
        threshold: float | None = None,
        from_logits: bool = False,
    ):
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ConfigError(
                f"ConfusionMatrix(num_classes={num_classes!r}); expected an integer >= 2, the number of classes."
            )
        super().__init__(
            ConfusionState,
            predictions,
            labels,
            num_classes=num_classes,
            per_class=bool(per_class),
            **_binary_config("ConfusionMatrix", threshold, from_logits),
        )


class AUC(Inputs):
    """Area under the ROC curve (``curve="ROC"``) or the precision-recall curve (``curve="PR"``,
    average precision as scikit-learn defines it) of binary ``labels`` (bool or 0/1) and ``scores``.

    Scores are binned into ``num_thresholds`` equal bins of [0, 1]; the area is
    exact for the binned scores (within about 1/num_thresholds of the exact
    one). A score outside [0, 1] makes ``compute`` raise, naming the count.
    NaN when only one class occurs. Device memory: 2 x ``num_thresholds`` int32.

    Args:
        scores: probabilities, one per example.
        labels: bool or 0/1.
        num_thresholds: how many equal bins of [0, 1] the scores fall into.
        curve: ``"ROC"`` or ``"PR"``.
        from_logits: the scores are logits: a sigmoid is applied first.
    """

    def __init__(self, scores, labels, *, num_thresholds: int = 200, curve: str = "ROC", from_logits: bool = False):
        if isinstance(num_thresholds, bool) or not isinstance(num_thresholds, int) or num_thresholds < 2:
            raise ConfigError(f"AUC(num_thresholds={num_thresholds!r}); expected an integer >= 2 (default 200).")
        if curve not in ("ROC", "PR"):
            raise ConfigError(f"AUC(curve={curve!r}); expected 'ROC' or 'PR'.")
        super().__init__(
            AUCState,
            scores,
            labels,
            num_thresholds=num_thresholds,
            curve=curve,
            from_logits=bool(from_logits),
        )
