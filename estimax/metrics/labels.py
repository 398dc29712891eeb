"""Labels and class ids: how predictions become class ids, the labels outside a metric's classes,
and the checks after every training loop.

``predicted_ids`` turns scores (argmax over a class axis, or a threshold on
binary scores) or ids into class ids, refusing float ids; ``LabelRange`` is
the state of the valid labels outside the classes (how many, the first few
values). The compiled step counts, per step, the valid labels outside the classes of
every metric that knows them (``LabelRange`` of ``Accuracy``/``TopK`` over
scores, ``ConfusionMatrix``, ``AUC``) and keeps the integer labels of the
examples whose per-example loss is not finite (``loss_labels``): an integer
label outside the logits makes optax's ``*_with_integer_labels`` losses NaN.
This module turns those per-step arrays into one-line errors and notes. Owns
no other metric state (``states``) and no decision to stop training (``training``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from estimax.errors import InputError
from estimax.metrics.protocol import Metric, array_module, count_true

FIRST_LABELS = 4  # out-of-range label values a LabelRange keeps, to name them
LOSS_LABELS = "loss_labels"
"""The key of a training output: the count and the first labels of the examples whose loss was not finite."""


def check_class_ids(what: str, ids) -> None:
    """Raises unless ``ids`` (labels or predicted ids) are integers or bools: floats are never truncated."""
    dtype = jnp.result_type(ids)
    if not (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_):
        raise InputError(
            f"{what} are {dtype} of shape {jnp.shape(ids)}; expected integer class ids (or bools), which are "
            f"never truncated from floats. Fix: convert them, e.g. `{what.split()[-1]}.astype(jnp.int32)`."
        )


def predicted_ids(predictions, labels, *, num_classes=None, threshold=None, from_logits=False):
    """``(class ids, invalid scores, number of classes or None)`` of ``predictions`` for ``labels``.

    * scores with one more (class) axis than the labels: argmax over it; a class
      axis of size 1 holds binary scores;
    * floats shaped like the labels: binary scores, class 1 where above ``threshold``
      (0.5 for probabilities, 0 with ``from_logits``); probabilities outside [0, 1]
      and NaN are invalid;
    * integers or bools shaped like the labels: class ids.
    """
    predictions, labels = jnp.asarray(predictions), jnp.asarray(labels)
    check_class_ids("labels", labels)
    floating = jnp.issubdtype(predictions.dtype, jnp.floating)
    if predictions.ndim == labels.ndim + 1 and predictions.shape[-1] == 1 and floating:
        predictions = predictions[..., 0]  # one score per example: binary
    if predictions.ndim == labels.ndim + 1:
        classes = predictions.shape[-1]
        if num_classes is not None and classes != num_classes:
            raise InputError(
                f"predictions have {classes} classes (shape {predictions.shape}) but num_classes={num_classes}; "
                f"expected scores of shape {labels.shape + (num_classes,)}. Fix: set num_classes={classes}, "
                "or check the model's output."
            )
        return jnp.argmax(predictions, axis=-1).astype(jnp.int32), jnp.zeros(labels.shape, bool), classes
    if predictions.shape != labels.shape:
        raise InputError(
            f"predictions of shape {predictions.shape} do not fit labels of shape {labels.shape}; expected class "
            f"ids of shape {labels.shape}, binary scores of shape {labels.shape}, or scores with a class axis "
            f"{labels.shape + ('num_classes',)}."
        )
    if not floating:
        check_class_ids("predictions", predictions)
        return predictions.astype(jnp.int32), jnp.zeros(labels.shape, bool), num_classes
    if num_classes not in (None, 2):
        raise InputError(
            f"predictions are {predictions.dtype} of shape {predictions.shape} with num_classes={num_classes}; "
            "floats shaped like the labels are binary scores, and class ids are never truncated from floats. "
            f"Fix: pass integer class ids, or the scores with a class axis {labels.shape + (num_classes,)}."
        )
    if threshold is None:
        threshold = 0.0 if from_logits else 0.5
    invalid = jnp.isnan(predictions) if from_logits else ~((predictions >= 0) & (predictions <= 1))
    return (predictions > threshold).astype(jnp.int32), invalid, 2


_NO_LABEL = np.iinfo(np.int32).max  # an empty slot of LabelRange.smallest


def _smallest_distinct(values):
    """The ``FIRST_LABELS`` smallest distinct ``values``, padded with ``_NO_LABEL`` (device or host)."""
    if isinstance(values, np.ndarray):
        distinct = np.unique(values)[:FIRST_LABELS]
        return np.pad(distinct, (0, FIRST_LABELS - len(distinct)), constant_values=_NO_LABEL).astype(values.dtype)
    return jnp.unique(values, size=FIRST_LABELS, fill_value=_NO_LABEL)


class LabelRange(Metric):
    """Valid labels outside the classes: how many, and the smallest ``FIRST_LABELS`` distinct values
    among them (a set, so that merging stays commutative)."""

    count: jax.Array
    smallest: jax.Array

    @classmethod
    def from_labels(cls, labels, outside):
        labels, outside = jnp.ravel(labels).astype(jnp.int32), jnp.ravel(outside)
        return cls(count_true(outside), _smallest_distinct(jnp.where(outside, labels, _NO_LABEL)))

    @classmethod
    def empty(cls):
        return cls(np.int32(0), np.full(FIRST_LABELS, _NO_LABEL, np.int32))

    def merge(self, other):
        xp = array_module(self.smallest)
        return LabelRange(self.count + other.count, _smallest_distinct(xp.concatenate([self.smallest, other.smallest])))

    def values(self) -> list[int]:
        return [int(v) for v in np.asarray(self.smallest) if v != _NO_LABEL]

    def message(self, num_classes: int, examples: str = "valid labels") -> str:
        """One line naming the labels outside ``0..num_classes-1``, or ``""`` if there are none."""
        if not self.count:
            return ""
        values = self.values()
        more = ", ..." if len(values) == FIRST_LABELS else ""
        return (
            f"{int(self.count)} {examples} are outside the classes 0..{num_classes - 1} (values "
            f"{', '.join(map(str, values))}{more}); expected "
            f"class ids 0..{num_classes - 1}. Fix: check the labels of the input, or the number of classes."
        )

    def compute(self) -> dict[str, float]:
        return {}


def label_range(labels, valid, num_classes) -> LabelRange:
    """The ``LabelRange`` of a batch: its valid labels outside ``0..num_classes-1`` (none without classes)."""
    labels = jnp.asarray(labels)
    if num_classes is None or labels.dtype == jnp.bool_:
        return LabelRange.from_labels(labels, jnp.zeros(labels.shape, bool))
    return LabelRange.from_labels(labels, valid & ((labels < 0) | (labels >= num_classes)))


def check_labels(state) -> None:
    """Raises ``InputError`` when a state (with ``labels`` and ``num_classes``) saw labels outside its classes."""
    message = state.labels.message(state.num_classes)
    if message:
        raise InputError(message)


def loss_labels(loss, labels):
    """``[count, first FIRST_LABELS labels]`` (int32) of the examples whose per-example loss is not finite,
    for integer labels of shape ``(batch,)``; ``None`` where the loss or labels have another form."""
    labels = labels if hasattr(labels, "dtype") else None
    if labels is None or not jnp.issubdtype(labels.dtype, jnp.integer) or jnp.ndim(labels) != 1:
        return None
    if jnp.shape(loss) != jnp.shape(labels):
        return None
    bad = ~jnp.isfinite(loss)
    (index,) = jnp.nonzero(bad, size=FIRST_LABELS, fill_value=0)
    first = jnp.where(jnp.arange(FIRST_LABELS) < jnp.sum(bad), labels[index].astype(jnp.int32), 0)
    return jnp.concatenate([jnp.sum(bad, dtype=jnp.int32)[None], first])


def check_training(outputs: dict, step_before: int) -> None:
    """Raises ``InputError`` naming the first step of a loop whose labels fell outside a metric's classes."""
    for name, state in outputs.items():
        labels = getattr(state, "labels", None)
        if not (isinstance(state, Metric) and isinstance(labels, LabelRange)):
            continue
        counts = np.asarray(labels.count)
        if not counts.any():
            continue
        i = int(np.argmax(counts > 0))
        step = LabelRange(counts[i], np.asarray(labels.smallest)[i])
        num_classes = getattr(state, "num_classes", None) or 2
        raise InputError(
            f"Training step {step_before + i + 1}, metric {name!r} ({type(state).__name__}): "
            + step.message(num_classes, "labels of the batch")
        )


def nonfinite_note(outputs: dict, i: int) -> str:
    """Names the labels of the examples whose loss was not finite at step ``i`` of a loop, or ``""``."""
    row = outputs.get(LOSS_LABELS)
    if row is None or not row[i][0]:
        return ""
    if np.isinf(outputs["loss"][i]):  # out-of-range labels make those losses NaN; an overflow, inf
        return (
            "The loss is infinite: an overflow (logits or activations too large), not a label outside the "
            "model's classes, which makes optax's *_with_integer_labels losses NaN. "
        )
    count, first = int(row[i][0]), [int(v) for v in row[i][1 : 1 + min(int(row[i][0]), FIRST_LABELS)]]
    return (
        f"The loss is not finite on {count} examples, whose labels are {', '.join(map(str, first))}"
        + (", ..." if count > FIRST_LABELS else "")
        + ": a label outside the model's classes makes optax's *_with_integer_labels losses NaN. "
    )
