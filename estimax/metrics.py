"""Mergeable metrics: sufficient statistics of one batch, merged exactly, computed on the host.

A metric *state* is a small pytree of sufficient statistics, a subclass of
``Metric`` (a frozen dataclass; fields marked ``static()`` such as
``num_classes`` are hashable aux data). It is built from one batch and the
padding mask (``from_batch``), merged associatively and commutatively
(``merge``, whose identity is ``empty``) and turned into numbers on the host in
float64 (``compute``). A model_fn returns metric *inputs* (``Inputs``: the
arrays of one batch and the static config, e.g. ``AUC(scores, labels)``); the
engine builds the states with the mask inside the compiled step, where sums
over the sharded global batch merge every device and host, merges batches in
the evaluation carry and training steps on the host (in int64/float64).

Padding is removed by selection (``where``, integer masks), never by
multiplication, so a NaN in a padded row changes nothing. Owns no I/O and no
device placement.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NUM_EXAMPLES = "num_examples"  # the count of valid examples every evaluation reports


# -- the protocol ---------------------------------------------------------------


def static(default: Any = dataclasses.MISSING):
    """A static config field of a ``Metric`` (hashable aux data, e.g. ``num_classes``)."""
    return dataclasses.field(default=default, metadata={"static": True})


class Metric:
    """Base class of metric states: subclasses are frozen dataclass pytrees.

    A subclass declares its fields (arrays; ``static()`` for config) and implements:

    * ``from_batch(cls, *inputs, mask, **config)``: the state of one batch,
      ``mask`` (``(batch,)`` bool) ``False`` on padded rows, which must not
      count (select with ``jnp.where``; never multiply by the mask);
    * ``empty(cls, **config)``: the identity of ``merge``, built from the
      static fields;
    * ``merge(self, other)``: associative and commutative; it runs on the
      device (jax arrays) and on the host (numpy int64/float64), so use
      operators or ``_xp(x)``-style dispatch rather than ``jnp`` only;
    * ``compute(self)``: on the host, a float or a dict of floats (reported
      as ``"<name>/<field>"``).

    In a Spec, ``MyMetric.of(*inputs, **config)`` stands for its inputs.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)
        fields = dataclasses.fields(cls)
        jax.tree_util.register_dataclass(
            cls,
            data_fields=[f.name for f in fields if not f.metadata.get("static")],
            meta_fields=[f.name for f in fields if f.metadata.get("static")],
        )

    @classmethod
    def of(cls, *inputs, **config) -> Inputs:
        """This metric's inputs of one batch, for ``Spec(metrics=...)``."""
        return Inputs(cls, *inputs, **config)

    @classmethod
    def from_batch(cls, *inputs, mask, **config):
        raise NotImplementedError(f"{cls.__name__}.from_batch")

    @classmethod
    def empty(cls, **config):
        raise NotImplementedError(f"{cls.__name__}.empty")

    def merge(self, other):
        raise NotImplementedError(f"{type(self).__name__}.merge")

    def compute(self) -> float | dict[str, float]:
        raise NotImplementedError(f"{type(self).__name__}.compute")


class Inputs:
    """A metric's inputs of one batch: arrays with the batch as leading axis, and static config.

    What a model_fn puts in ``Spec(metrics=...)``; ``state(mask)`` builds the
    metric's state with the padding mask. Array keyword arguments are inputs;
    other keyword arguments (ints, strings, bools, None) are static config.
    """

    def __init__(self, metric: type, *inputs, **config):
        self.metric = metric
        self.inputs = tuple(inputs)
        self.arrays = {k: v for k, v in config.items() if _is_array(v)}
        self.config = {k: v for k, v in config.items() if not _is_array(v)}
        for name, value in self.config.items():
            try:
                hash(value)
            except TypeError:
                raise TypeError(
                    f"{metric.__name__} config {name}={value!r} is not hashable; expected an int, "
                    "float, string, bool or None (arrays are inputs: pass them as jax/numpy arrays)."
                ) from None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_node(cls, Inputs._flatten, functools.partial(Inputs._unflatten, cls))

    def _flatten(self):
        return (self.inputs, self.arrays), (self.metric, tuple(sorted(self.config.items())))

    @staticmethod
    def _unflatten(cls, aux, children):
        inputs = object.__new__(cls)
        inputs.metric, config = aux
        inputs.inputs, inputs.arrays = children
        inputs.config = dict(config)
        return inputs

    def state(self, mask: jax.Array) -> Metric:
        return self.metric.from_batch(*self.inputs, mask=mask, **self.arrays, **self.config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.metric.__name__}, config={self.config})"


jax.tree_util.register_pytree_node(Inputs, Inputs._flatten, functools.partial(Inputs._unflatten, Inputs))


def _is_array(value) -> bool:
    return isinstance(value, jax.Array | np.ndarray | np.generic)


# -- what the engine does with them ---------------------------------------------


def is_metric_inputs(value) -> bool:
    return isinstance(value, Inputs)


def batch_states(values: dict, mask: jax.Array) -> dict[str, Metric]:
    """The state of one batch of every metric; plain per-example values are ``Mean``s."""
    return {k: (v if isinstance(v, Inputs) else Mean(v)).state(mask) for k, v in values.items()}


def train_outputs(metrics: dict | None, batch_size: int) -> dict:
    """Per-step training outputs: plain values as their batch mean, metric inputs as states."""
    outputs, full = {}, None
    for name, value in (metrics or {}).items():
        if isinstance(value, Inputs):
            full = jnp.ones((batch_size,), bool) if full is None else full  # training batches have no padding
            outputs[name] = value.state(full)
        else:
            outputs[name] = jnp.mean(jnp.asarray(value, jnp.float32))
    return outputs


def config_of(state: Metric) -> dict:
    """The static config fields of a state."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.metadata.get("static")}


def empty_like(state: Metric) -> Metric:
    """The identity of ``state``'s merge, as host arrays of its shapes and dtypes (``state`` may be abstract)."""
    empty = type(state).empty(**config_of(state))
    try:
        return jax.tree.map(lambda e, s: np.broadcast_to(np.asarray(e, s.dtype), s.shape).copy(), empty, state)
    except (ValueError, TypeError) as error:
        raise TypeError(
            f"{type(state).__name__}.empty() gives {jax.tree.map(np.shape, empty)}, which does not match "
            f"the state of a batch {jax.tree.map(np.shape, state)}; expected the same fields, shapes and config."
        ) from error


def to_host(state):
    """A state (or a pytree of them) on the host: integers as int64, floats as float64."""

    def widen(x):
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.integer):
            return x.astype(np.int64)
        if np.issubdtype(x.dtype, np.floating):
            return x.astype(np.float64)
        return x

    return jax.tree.map(widen, jax.device_get(state))


def merge_steps(stacked: Metric) -> Metric:
    """Merges a state whose leaves have a leading steps axis into one state (on the host)."""
    num_steps = jax.tree.leaves(stacked)[0].shape[0]
    steps = [jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(num_steps)]
    return functools.reduce(lambda a, b: a.merge(b), steps)


def results(name: str, state: Metric) -> dict[str, float]:
    """``state.compute()`` under flat names: ``name`` or ``"name/field"``; errors name the metric."""
    try:
        value = state.compute()
    except ValueError as error:
        raise ValueError(f"Metric {name!r} ({type(state).__name__}): {error}") from error
    if isinstance(value, dict):
        return {f"{name}/{field}": float(v) for field, v in value.items()}
    return {name: float(value)}


# -- helpers for built-ins --------------------------------------------------------


def _xp(x):
    """numpy for host arrays, jax.numpy otherwise: ``merge`` runs on both."""
    return np if isinstance(x, np.ndarray | np.generic) else jnp


def _mask_like(mask: jax.Array, x: jax.Array) -> jax.Array:
    """The per-example mask broadcast over the trailing axes of ``x``."""
    return jnp.broadcast_to(jnp.reshape(mask, mask.shape + (1,) * (jnp.ndim(x) - 1)), jnp.shape(x))


def _count(mask) -> jax.Array:
    return jnp.sum(mask, dtype=jnp.int32)


def _divide(a, b):
    """``a / b`` in float64, 0 where ``b`` is 0 (scikit-learn's ``zero_division=0``)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape), where=b != 0)


def _class_ids(predictions, labels):
    """Class ids from ids, or from scores with one more (class) axis than the labels."""
    predictions = jnp.asarray(predictions)
    if predictions.ndim == jnp.ndim(labels) + 1:
        return jnp.argmax(predictions, axis=-1)
    return predictions


# -- states -----------------------------------------------------------------------


class MeanState(Metric):
    total: jax.Array
    count: jax.Array  # int32 without weights, the sum of weights with them

    @classmethod
    def from_batch(cls, values, weights=None, *, mask):
        values = jnp.asarray(values, jnp.float32)
        if values.ndim == 0:  # a batch-level scalar: only where nothing is padded (checked by the engine)
            valid = _count(mask)
            return cls(values * valid, valid)
        valid = _mask_like(mask, values)
        if weights is None:
            # where(), not multiply: a NaN on a padded row must not leak into the sum.
            return cls(jnp.sum(jnp.where(valid, values, 0.0)), _count(valid))
        weights = jnp.broadcast_to(jnp.asarray(weights, jnp.float32), values.shape)
        return cls(jnp.sum(jnp.where(valid, values * weights, 0.0)), jnp.sum(jnp.where(valid, weights, 0.0)))

    @classmethod
    def empty(cls):
        return cls(np.float32(0), np.int32(0))

    def merge(self, other):
        return MeanState(self.total + other.total, self.count + other.count)

    def compute(self) -> float:
        count = float(self.count)
        return float(self.total) / count if count else float("nan")


class SumState(Metric):
    total: jax.Array

    @classmethod
    def from_batch(cls, values, *, mask):
        values = jnp.asarray(values)
        exact = jnp.issubdtype(values.dtype, jnp.integer) or values.dtype == jnp.bool_
        values = values.astype(jnp.int32 if exact else jnp.float32)  # counts stay integers
        return cls(jnp.sum(jnp.where(_mask_like(mask, values), values, 0)))

    @classmethod
    def empty(cls):
        return cls(np.int32(0))  # cast to the state's dtype by the engine

    def merge(self, other):
        return SumState(self.total + other.total)

    def compute(self) -> float:
        return float(self.total)


def _extreme_input(values):
    values = jnp.asarray(values)
    if values.dtype == jnp.bool_:
        values = values.astype(jnp.int32)
    elif jnp.issubdtype(values.dtype, jnp.floating):
        values = values.astype(jnp.float32)
    return values


def _identity(dtype: str, largest: bool):
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.asarray(info.max if largest else info.min, dtype)
    return np.asarray(np.inf if largest else -np.inf, dtype)


class MinState(Metric):
    value: jax.Array
    dtype: str = static()

    @classmethod
    def from_batch(cls, values, *, mask):
        values = _extreme_input(values)
        identity = _identity(values.dtype.name, largest=True)
        return cls(jnp.min(jnp.where(_mask_like(mask, values), values, identity)), values.dtype.name)

    @classmethod
    def empty(cls, dtype):
        return cls(_identity(dtype, largest=True), dtype)

    def merge(self, other):
        return MinState(_xp(self.value).minimum(self.value, other.value), self.dtype)

    def compute(self) -> float:
        return float(self.value)


class MaxState(Metric):
    value: jax.Array
    dtype: str = static()

    @classmethod
    def from_batch(cls, values, *, mask):
        values = _extreme_input(values)
        identity = _identity(values.dtype.name, largest=False)
        return cls(jnp.max(jnp.where(_mask_like(mask, values), values, identity)), values.dtype.name)

    @classmethod
    def empty(cls, dtype):
        return cls(_identity(dtype, largest=False), dtype)

    def merge(self, other):
        return MaxState(_xp(self.value).maximum(self.value, other.value), self.dtype)

    def compute(self) -> float:
        return float(self.value)


class MomentsState(Metric):
    """Count, mean and sum of squared deviations, merged with Chan et al.'s parallel formula
    (no cancellation of ``E[x^2] - E[x]^2``)."""

    count: jax.Array
    mean: jax.Array
    m2: jax.Array

    @classmethod
    def from_batch(cls, values, *, mask):
        values = jnp.asarray(values, jnp.float32)
        valid = _mask_like(mask, values)
        count = _count(valid)
        mean = jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(count, 1)
        m2 = jnp.sum(jnp.where(valid, jnp.square(values - mean), 0.0))
        return cls(count, mean, m2)

    @classmethod
    def empty(cls):
        return cls(np.int32(0), np.float32(0), np.float32(0))

    def merge(self, other):
        xp = _xp(self.mean)
        count = self.count + other.count
        share = xp.where(count > 0, other.count / xp.maximum(count, 1), 0.0)
        delta = other.mean - self.mean
        mean = self.mean + delta * share
        m2 = self.m2 + other.m2 + xp.square(delta) * self.count * share
        return MomentsState(count, mean.astype(self.mean.dtype), m2.astype(self.m2.dtype))

    def compute(self) -> float:
        count = float(self.count)
        return math.sqrt(max(float(self.m2) / count, 0.0)) if count else float("nan")


class HitsState(Metric):
    """Hits among counted examples (accuracy, top-k accuracy); labels outside the classes are counted apart."""

    hits: jax.Array
    count: jax.Array
    out_of_range: jax.Array

    @classmethod
    def empty(cls):
        return cls(np.int32(0), np.int32(0), np.int32(0))

    @classmethod
    def from_hits(cls, hits, valid, out_of_range):
        return cls(_count(jnp.where(valid, hits, False)), _count(valid), _count(out_of_range))

    @classmethod
    def from_batch(cls, predictions, labels, *, mask, k=None):
        labels = jnp.asarray(labels)
        valid = _mask_like(mask, labels)
        if k is None:  # accuracy: predicted ids (or scores over classes) equal to the labels
            return cls.from_hits(_class_ids(predictions, labels) == labels, valid, jnp.zeros_like(valid))
        scores = jnp.asarray(predictions, jnp.float32)
        num_classes = scores.shape[-1]
        in_range = (labels >= 0) & (labels < num_classes)
        label_score = jnp.take_along_axis(scores, jnp.where(in_range, labels, 0)[..., None], axis=-1)
        # In the top k when fewer than k classes score strictly higher (ties count as hits, like tf.nn.in_top_k).
        higher = jnp.sum(scores > label_score, axis=-1)
        return cls.from_hits(in_range & (higher < k), valid, valid & ~in_range)

    def merge(self, other):
        return HitsState(self.hits + other.hits, self.count + other.count, self.out_of_range + other.out_of_range)

    def compute(self) -> float:
        if self.out_of_range:
            raise ValueError(
                f"{int(self.out_of_range)} valid labels are outside the classes of the scores; expected class "
                "ids 0..num_classes-1. Fix: check the labels, or the number of classes of the model's output."
            )
        return float(_divide(self.hits, self.count)) if self.count else float("nan")


class ConfusionState(Metric):
    """``matrix[true, predicted]`` counts (scikit-learn's orientation) of valid rows."""

    matrix: jax.Array
    out_of_range: jax.Array
    num_classes: int = static()
    per_class: bool = static(False)

    @classmethod
    def from_batch(cls, predictions, labels, *, mask, num_classes, per_class=False):
        labels = jnp.asarray(labels).astype(jnp.int32)
        predictions = _class_ids(predictions, labels).astype(jnp.int32)
        valid = _mask_like(mask, labels)
        in_range = (labels >= 0) & (labels < num_classes) & (predictions >= 0) & (predictions < num_classes)
        cells = jnp.where(valid & in_range, labels * num_classes + predictions, num_classes * num_classes)
        counts = jnp.zeros(num_classes * num_classes, jnp.int32).at[cells.ravel()].add(1, mode="drop")
        return cls(counts.reshape(num_classes, num_classes), _count(valid & ~in_range), num_classes, per_class)

    @classmethod
    def empty(cls, num_classes, per_class=False):
        return cls(np.zeros((num_classes, num_classes), np.int32), np.int32(0), num_classes, per_class)

    def merge(self, other):
        return ConfusionState(
            self.matrix + other.matrix, self.out_of_range + other.out_of_range, self.num_classes, self.per_class
        )

    def compute(self) -> dict[str, float]:
        if self.out_of_range:
            raise ValueError(
                f"{int(self.out_of_range)} valid rows have a label or prediction outside [0, {self.num_classes}); "
                f"expected class ids 0..{self.num_classes - 1}. Fix: set num_classes to the number of classes, "
                "or check the labels."
            )
        matrix = np.asarray(self.matrix, np.float64)
        true_positives, predicted, actual = np.diag(matrix), matrix.sum(axis=0), matrix.sum(axis=1)
        precision, recall = _divide(true_positives, predicted), _divide(true_positives, actual)
        f1 = _divide(2 * true_positives, predicted + actual)
        micro = float(_divide(true_positives.sum(), matrix.sum()))  # single-label: micro P = R = F1 = accuracy
        values = {
            "accuracy": micro,
            "precision_macro": float(precision.mean()),
            "recall_macro": float(recall.mean()),
            "f1_macro": float(f1.mean()),
            "precision_micro": micro,
            "recall_micro": micro,
            "f1_micro": micro,
            "mean_per_class_accuracy": float(recall.mean()),
        }
        if self.per_class:
            for name, per in (("precision", precision), ("recall", recall), ("f1", f1)):
                values.update({f"{name}_{c}": float(v) for c, v in enumerate(per)})
        return values


class AUCState(Metric):
    """Histograms of valid positives and negatives over ``num_thresholds`` equal bins of [0, 1]."""

    positives: jax.Array
    negatives: jax.Array
    bad_scores: jax.Array  # valid rows whose score is outside [0, 1] (or NaN)
    bad_labels: jax.Array  # valid rows whose label is not 0 or 1
    num_thresholds: int = static(200)
    curve: str = static("ROC")
    from_logits: bool = static(False)

    @classmethod
    def from_batch(cls, scores, labels, *, mask, num_thresholds=200, curve="ROC", from_logits=False):
        scores = jnp.asarray(scores, jnp.float32)
        if from_logits:
            scores = jax.nn.sigmoid(scores)
        labels = jnp.broadcast_to(jnp.asarray(labels), scores.shape)
        valid = _mask_like(mask, scores)
        in_range = (scores >= 0) & (scores <= 1)  # False for NaN
        positive, negative = labels == 1, labels == 0
        counted = valid & in_range & (positive | negative)
        bins = jnp.clip(jnp.floor(jnp.where(in_range, scores, 0.0) * num_thresholds), 0, num_thresholds - 1)
        bins = bins.astype(jnp.int32)

        def histogram(select):
            index = jnp.where(counted & select, bins, num_thresholds).ravel()  # out of bounds: dropped
            return jnp.zeros(num_thresholds, jnp.int32).at[index].add(1, mode="drop")

        return cls(
            histogram(positive),
            histogram(negative),
            _count(valid & ~in_range),
            _count(valid & ~(positive | negative)),
            num_thresholds,
            curve,
            from_logits,
        )

    @classmethod
    def empty(cls, num_thresholds=200, curve="ROC", from_logits=False):
        zeros = np.zeros(num_thresholds, np.int32)
        return cls(zeros, zeros, np.int32(0), np.int32(0), num_thresholds, curve, from_logits)

    def merge(self, other):
        return AUCState(
            self.positives + other.positives,
            self.negatives + other.negatives,
            self.bad_scores + other.bad_scores,
            self.bad_labels + other.bad_labels,
            self.num_thresholds,
            self.curve,
            self.from_logits,
        )

    def points(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """True and false positive counts at thresholds ``1 - 1/T, ..., 1/T, 0`` (descending), and the thresholds."""
        self._check()
        positives = np.cumsum(np.asarray(self.positives, np.int64)[::-1])
        negatives = np.cumsum(np.asarray(self.negatives, np.int64)[::-1])
        thresholds = np.arange(self.num_thresholds - 1, -1, -1) / self.num_thresholds
        return positives, negatives, thresholds

    def compute(self) -> float:
        true_pos, false_pos, _ = self.points()
        num_pos, num_neg = true_pos[-1], false_pos[-1]
        if self.curve == "ROC":
            if not (num_pos and num_neg):
                return float("nan")  # undefined with one class only
            tpr = np.concatenate([[0.0], true_pos / num_pos])
            fpr = np.concatenate([[0.0], false_pos / num_neg])
            return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))  # trapezoids
        if not num_pos:
            return float("nan")
        # Average precision: sum over thresholds of (R_k - R_{k-1}) * P_k, as scikit-learn's.
        recall = np.concatenate([[0.0], true_pos / num_pos])
        precision = _divide(true_pos, true_pos + false_pos)
        return float(np.sum(np.diff(recall) * precision))

    def _check(self) -> None:
        if self.bad_scores:
            hint = (
                "with from_logits=True the scores are sigmoid(logits): some were NaN. Fix: check the model's output."
                if self.from_logits
                else "Fix: pass probabilities (e.g. jax.nn.sigmoid(logits)), or AUC(..., from_logits=True) for logits."
            )
            raise ValueError(f"{int(self.bad_scores)} valid scores are outside [0, 1]; {hint}")
        if self.bad_labels:
            raise ValueError(
                f"{int(self.bad_labels)} valid labels are neither 0 nor 1; expected binary labels "
                "(bool or 0/1). Fix: binarise them, e.g. `labels == positive_class`."
            )


# -- inputs: what a model_fn writes in Spec(metrics=...) ---------------------------


class Mean(Inputs):
    """Mean of ``values`` over valid rows (all their elements), weighted by ``weights`` if given.

    Result: ``name``. Plain per-example arrays in ``Spec(metrics=...)`` are ``Mean``s.
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


class Accuracy(Inputs):
    """Fraction of valid rows whose predicted class equals the label.

    ``predictions``: class ids shaped like ``labels``, or scores with one more
    (class) axis, reduced by argmax. Result: ``name``.
    """

    def __init__(self, predictions, labels):
        super().__init__(HitsState, predictions, labels)


class TopK(Inputs):
    """Fraction of valid rows whose label is among the ``k`` highest ``scores`` (``(..., num_classes)``).

    Ties at the boundary count as hits, like ``tf.nn.in_top_k``. Result: ``name``.
    """

    def __init__(self, scores, labels, k: int = 5):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"TopK(k={k!r}); expected a positive integer, e.g. TopK(logits, labels, k=5).")
        super().__init__(HitsState, scores, labels, k=k)


class ConfusionMatrix(Inputs):
    """The ``num_classes x num_classes`` matrix of valid (label, prediction) counts, and what follows from it.

    ``predictions``: class ids, or scores with one more (class) axis (argmax).
    Results ``name/accuracy``, ``name/{precision,recall,f1}_{macro,micro}``,
    ``name/mean_per_class_accuracy`` (= ``recall_macro``) and, with
    ``per_class=True``, ``name/{precision,recall,f1}_<c>``. A class with no
    prediction has precision 0, one with no example recall 0, and F1 is 0
    when both are (scikit-learn's ``zero_division=0``, over all
    ``num_classes`` classes). Device memory: ``num_classes**2`` int32.
    """

    def __init__(self, predictions, labels, num_classes: int, per_class: bool = False):
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(
                f"ConfusionMatrix(num_classes={num_classes!r}); expected an integer >= 2, the number of classes."
            )
        super().__init__(ConfusionState, predictions, labels, num_classes=num_classes, per_class=bool(per_class))


class AUC(Inputs):
    """Area under the ROC curve (``curve="ROC"``) or the precision-recall curve (``curve="PR"``,
    average precision as scikit-learn defines it) of binary ``labels`` (bool or 0/1) and ``scores``.

    Scores are binned into ``num_thresholds`` equal bins of [0, 1]; the area is
    exact for the binned scores (within about 1/num_thresholds of the exact
    one). Scores must be probabilities; ``from_logits=True`` applies a sigmoid
    first. A score outside [0, 1] makes ``compute`` raise, naming the count.
    NaN when only one class occurs. Device memory: 2 x ``num_thresholds`` int32.
    """

    def __init__(self, scores, labels, *, num_thresholds: int = 200, curve: str = "ROC", from_logits: bool = False):
        if isinstance(num_thresholds, bool) or not isinstance(num_thresholds, int) or num_thresholds < 2:
            raise ValueError(f"AUC(num_thresholds={num_thresholds!r}); expected an integer >= 2 (default 200).")
        if curve not in ("ROC", "PR"):
            raise ValueError(f"AUC(curve={curve!r}); expected 'ROC' or 'PR'.")
        super().__init__(
            AUCState,
            scores,
            labels,
            num_thresholds=num_thresholds,
            curve=curve,
            from_logits=bool(from_logits),
        )
