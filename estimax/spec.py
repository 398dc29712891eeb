"""The model_fn contract: the three modes and the ``Spec`` a model_fn returns.

Owns only the vocabulary shared by user code and the engine; checking a
returned Spec against the batch lives in ``step.py``, where shapes are known.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple


class Mode(enum.StrEnum):
    """What the engine is asking the model_fn for."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "predict"


TRAIN = Mode.TRAIN
"""Training: ``Spec.loss`` is required; dropout and batch norm are in train behaviour."""
EVAL = Mode.EVAL
"""Evaluation: ``Spec.loss`` and ``Spec.metrics`` are averaged over every valid example once."""
PREDICT = Mode.PREDICT
"""Prediction: ``Spec.predictions`` is required; labels are ``None`` when the input has none."""


class Spec(NamedTuple):
    """What a model_fn returns.

    Attributes:
      loss: required in TRAIN, optional in EVAL. Either per-example values with
        the batch as leading axis (shape ``(batch,)``), which the engine averages
        over the valid examples only, or a scalar, accepted only where no
        padding can occur (training, or an evaluation batch that is full).
      predictions: required in PREDICT. An array or a dict of arrays, each with
        the batch as leading axis.
      metrics: optional dict of name -> per-example values ``(batch,)`` (bool
        or numeric) or scalars, averaged like ``loss``, or the inputs of a
        mergeable metric (``estimax.metrics``: ``AUC(scores, labels)``,
        ``ConfusionMatrix(...)``, ``TopK(...)``, ``MyMetric.of(...)``), which
        the engine turns into states with the padding mask.
      eval_outputs: optional dict of name -> per-example arrays (batch as
        leading axis) brought to the host in EVAL mode, valid rows only, in
        input order, for the Estimator's ``host_metrics``.
    """

    loss: Any = None
    predictions: Any = None
    metrics: dict[str, Any] | None = None
    eval_outputs: dict[str, Any] | None = None
