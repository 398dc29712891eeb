"""The built-in metric states of classification: hits, a confusion matrix, AUC histograms.

Each is a ``Metric`` of integer counts (int32 on the device, int64 on the
host), built from one batch with the padding mask by selection (``where``,
dropped scatter indices), never by multiplication. ``merge`` runs on jax and
numpy arrays alike; ``compute`` on the host in float64. Invalid valid-row
inputs (scores outside [0, 1], class ids outside the classes) are counted in
the state and make ``compute`` raise; labels outside the classes are kept as a
``LabelRange`` (how many, the first few values), which training reads after
every loop. How predictions become class ids, and the label range, are
``labels``'s; the states of values (sums, means, extremes) ``states``'s. Owns
no inputs (``inputs``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from estimax.errors import InputError
from estimax.metrics.labels import LabelRange, check_class_ids, check_labels, label_range, predicted_ids
from estimax.metrics.protocol import Metric, count_true, static
from estimax.metrics.states import divide, mask_like


class HitsState(Metric):
    """Hits among counted examples (accuracy, top-k accuracy); labels outside the classes and invalid
    binary scores are counted apart, and make ``compute`` raise."""

    hits: jax.Array
    count: jax.Array
    labels: LabelRange
    bad_scores: jax.Array
    num_classes: int | None = static(None)  # of the scores; None for class ids (labels then unchecked)

    @classmethod
    def empty(cls, num_classes=None):
        return cls(np.int32(0), np.int32(0), LabelRange.empty(), np.int32(0), num_classes)

    @classmethod
    def from_batch(cls, predictions, labels, *, mask, k=None, threshold=None, from_logits=False):
        labels = jnp.asarray(labels)
        valid = mask_like(mask, labels)
        if k is None:  # accuracy: predicted ids (argmax of scores, thresholded binary scores) equal to the labels
            ids, invalid, num_classes = predicted_ids(predictions, labels, threshold=threshold, from_logits=from_logits)
            hits = ids == labels
        else:
            check_class_ids("labels", labels)
            scores = jnp.asarray(predictions, jnp.float32)
            num_classes = scores.shape[-1]
            safe = jnp.where((labels >= 0) & (labels < num_classes), labels, 0)
            label_score = jnp.take_along_axis(scores, safe[..., None], axis=-1)[..., 0]
            # In the top k when fewer than k classes score strictly higher (ties count as hits, like tf.nn.in_top_k).
            hits, invalid = jnp.sum(scores > label_score[..., None], axis=-1) < k, jnp.zeros(labels.shape, bool)
        outside = label_range(labels, valid, num_classes)
        in_range = (labels >= 0) & (labels < num_classes) if num_classes is not None else True
        hits, rows = count_true(valid & hits & in_range), count_true(valid)
        return cls(hits, rows, outside, count_true(valid & invalid), num_classes)

    def merge(self, other):
        return HitsState(
            self.hits + other.hits,
            self.count + other.count,
            self.labels.merge(other.labels),
            self.bad_scores + other.bad_scores,
            self.num_classes,
        )

    def compute(self) -> float:
        check_labels(self)
        _check_scores(self.bad_scores)
        return float(divide(self.hits, self.count)) if self.count else float("nan")


def _check_scores(bad_scores) -> None:
    if bad_scores:
        raise InputError(
            f"{int(bad_scores)} valid binary scores are outside [0, 1] or NaN; expected probabilities (or "
            "logits with from_logits=True). Fix: pass jax.nn.sigmoid(logits), or from_logits=True."
        )


class ConfusionState(Metric):
    """``matrix[true, predicted]`` counts (scikit-learn's orientation) of valid rows; labels outside the
    classes, predicted ids outside them and invalid binary scores are counted apart."""

    matrix: jax.Array
    out_of_range: jax.Array  # valid rows whose predicted id is outside the classes
    labels: LabelRange
    bad_scores: jax.Array
    num_classes: int = static()
    per_class: bool = static(False)

    @classmethod
    def from_batch(cls, predictions, labels, *, mask, num_classes, per_class=False, threshold=None, from_logits=False):
        labels = jnp.asarray(labels)
        predictions, invalid, _ = predicted_ids(
            predictions, labels, num_classes=num_classes, threshold=threshold, from_logits=from_logits
        )
        labels = labels.astype(jnp.int32)
        valid = mask_like(mask, labels)
        labels_in = (labels >= 0) & (labels < num_classes)
        predictions_in = (predictions >= 0) & (predictions < num_classes)
        counted = valid & labels_in & predictions_in & ~invalid
        cells = jnp.where(counted, labels * num_classes + predictions, num_classes * num_classes)
        counts = jnp.zeros(num_classes * num_classes, jnp.int32).at[cells.ravel()].add(1, mode="drop")
        return cls(
            counts.reshape(num_classes, num_classes),
            count_true(valid & ~predictions_in),
            label_range(labels, valid, num_classes),
            count_true(valid & invalid),
            num_classes,
            per_class,
        )

    @classmethod
    def empty(cls, num_classes, per_class=False):
        zero = np.int32(0)
        matrix = np.zeros((num_classes, num_classes), np.int32)
        return cls(matrix, zero, LabelRange.empty(), zero, num_classes, per_class)

    def merge(self, other):
        return ConfusionState(
            self.matrix + other.matrix,
            self.out_of_range + other.out_of_range,
            self.labels.merge(other.labels),
            self.bad_scores + other.bad_scores,
            self.num_classes,
            self.per_class,
        )

    def compute(self) -> dict[str, float]:
        check_labels(self)
        _check_scores(self.bad_scores)
        if self.out_of_range:
            raise InputError(
                f"{int(self.out_of_range)} valid predicted class ids are outside [0, {self.num_classes}); "
                f"expected class ids 0..{self.num_classes - 1}. Fix: set num_classes to the number of classes."
            )
        matrix = np.asarray(self.matrix, np.float64)
        true_positives, predicted, actual = np.diag(matrix), matrix.sum(axis=0), matrix.sum(axis=1)
        precision, recall = divide(true_positives, predicted), divide(true_positives, actual)
        f1 = divide(2 * true_positives, predicted + actual)
        micro = float(divide(true_positives.sum(), matrix.sum()))  # single-label: micro P = R = F1 = accuracy
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
    labels: LabelRange  # valid rows whose label is not 0 or 1
    num_thresholds: int = static(200)
    curve: str = static("ROC")
    from_logits: bool = static(False)

    @classmethod
    def from_batch(cls, scores, labels, *, mask, num_thresholds=200, curve="ROC", from_logits=False):
        scores = jnp.asarray(scores, jnp.float32)
        if from_logits:
            scores = jax.nn.sigmoid(scores)
        labels = jnp.broadcast_to(jnp.asarray(labels), scores.shape)
        valid = mask_like(mask, scores)
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
            count_true(valid & ~in_range),
            LabelRange.from_labels(labels, valid & ~(positive | negative)),
            num_thresholds,
            curve,
            from_logits,
        )

    @classmethod
    def empty(cls, num_thresholds=200, curve="ROC", from_logits=False):
        zeros = np.zeros(num_thresholds, np.int32)
        return cls(zeros, zeros, np.int32(0), LabelRange.empty(), num_thresholds, curve, from_logits)

    def merge(self, other):
        return AUCState(
            self.positives + other.positives,
            self.negatives + other.negatives,
            self.bad_scores + other.bad_scores,
            self.labels.merge(other.labels),
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
        precision = divide(true_pos, true_pos + false_pos)
        return float(np.sum(np.diff(recall) * precision))

    def _check(self) -> None:
        if self.bad_scores:
            hint = (
                "with from_logits=True the scores are sigmoid(logits): some were NaN. Fix: check the model's output."
                if self.from_logits
                else "Fix: pass probabilities (e.g. jax.nn.sigmoid(logits)), or AUC(..., from_logits=True) for logits."
            )
            raise InputError(f"{int(self.bad_scores)} valid scores are outside [0, 1]; {hint}")
        if self.labels.count:
            raise InputError(
                f"{int(self.labels.count)} valid labels are neither 0 nor 1 (values "
                f"{', '.join(map(str, self.labels.values()))}); expected binary labels (bool or 0/1). "
                "Fix: binarise them, e.g. `labels == positive_class`."
            )
