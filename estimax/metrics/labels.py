"""Labels checked after every training loop: what the compiled step counted, named on the host.

The compiled step counts, per step, the valid labels outside the classes of
every metric that knows them (``LabelRange`` of ``Accuracy``/``TopK`` over
scores, ``ConfusionMatrix``, ``AUC``) and keeps the integer labels of the
examples whose per-example loss is not finite (``loss_labels``): an integer
label outside the logits makes optax's ``*_with_integer_labels`` losses NaN.
This module turns those per-step arrays into one-line errors and notes. Owns
no state (``states``) and no decision to stop training (``training``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from estimax.errors import InputError
from estimax.metrics.protocol import Metric
from estimax.metrics.states import FIRST_LABELS, LabelRange

LOSS_LABELS = "loss_labels"
"""The key of a training output: the count and the first labels of the examples whose loss was not finite."""


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
    count, first = int(row[i][0]), [int(v) for v in row[i][1 : 1 + min(int(row[i][0]), FIRST_LABELS)]]
    return (
        f"The loss is not finite on {count} examples, whose labels are {', '.join(map(str, first))}"
        + (", ..." if count > FIRST_LABELS else "")
        + ": a label outside the model's classes makes optax's *_with_integer_labels losses NaN. "
    )
