"""What a model_fn returns, checked while it is traced: a ``Spec`` whose loss, metrics,
predictions and eval outputs have one row per example, and results with distinct names.

Owns those checks and their messages (``SpecError``, ``ConfigError``), which run inside the
trace of the step (``step.py``), before anything is compiled. Does not own the model_fn's own
errors on the input (``diagnose.py``) nor the checks of hooks and metric names a call asks for
(``validation.py``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from estimax import metrics as metrics_lib
from estimax.errors import ConfigError, SpecError
from estimax.spec import PREDICT, TRAIN, Mode, Spec


def check_spec(spec: Any, mode: Mode, batch_size: int) -> Spec:
    """Raises a ``SpecError`` naming what a model_fn returned that cannot work."""
    if not isinstance(spec, Spec):
        raise SpecError(
            f"model_fn returned {type(spec).__name__} in {mode} mode; expected estimax.Spec, "
            "e.g. `return ex.Spec(loss=per_example_loss, metrics={...})`."
        )
    if mode == TRAIN and spec.loss is None:
        raise SpecError(
            "model_fn returned Spec(loss=None) in TRAIN mode; training needs a loss: "
            "`return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels))`."
        )
    if mode == PREDICT:
        if spec.predictions is None:
            raise SpecError(
                "model_fn returned Spec(predictions=None) in PREDICT mode; expected an array or "
                "a dict of arrays with the batch as leading axis, e.g. "
                "`if mode == ex.PREDICT: return ex.Spec(predictions={'class': logits.argmax(-1)})`."
            )
        for path, leaf in jax.tree_util.tree_leaves_with_path(spec.predictions):
            shape = jnp.shape(leaf)
            if not shape or shape[0] != batch_size:
                raise SpecError(
                    f"model_fn prediction {_name(path)} has shape {shape}; expected the batch "
                    f"({batch_size}) as leading axis, one row per example."
                )
        return spec
    named = {"loss": spec.loss} if spec.loss is not None else {}
    if spec.metrics is not None and not isinstance(spec.metrics, dict):
        raise SpecError(f"Spec(metrics=...) is {type(spec.metrics).__name__}; expected a dict name -> values.")
    for key, value in (spec.metrics or {}).items():
        if isinstance(value, metrics_lib.Metric):
            raise SpecError(
                f"Spec(metrics={{{key!r}: {type(value).__name__}(...)}}) is a metric state; expected its inputs "
                f"of this batch, which the engine masks: `{type(value).__name__}.of(...)`."
            )
        if metrics_lib.is_metric_inputs(value):
            _check_rows(f"metrics[{key!r}] ({value.metric.__name__}) input", value, batch_size, mode)
        else:
            named[f"metrics[{key!r}]"] = value
    for name, value in named.items():
        shape = jnp.shape(value)
        if shape not in ((), (batch_size,)):
            raise SpecError(
                f"model_fn {name} has shape {shape} in {mode} mode; expected per-example values "
                f"of shape ({batch_size},) or a scalar. Fix: reduce the other axes, e.g. "
                "`.mean(axis=-1)` or `.sum(axis=-1)`, and keep the batch axis."
            )
    check_metric_names(spec.metrics or {}, mode, batch_size)  # once the shapes are known to fit
    if spec.eval_outputs is not None:
        if not isinstance(spec.eval_outputs, dict):
            raise SpecError(
                f"Spec(eval_outputs=...) is {type(spec.eval_outputs).__name__}; expected a dict name -> "
                "per-example arrays."
            )
        _check_rows("eval_outputs", spec.eval_outputs, batch_size, mode)
    return spec


# Names the engine reports beside the metrics: in every evaluation, and in training's outputs and logs.
RESERVED_EVAL = ("loss", metrics_lib.NUM_EXAMPLES, "ema_decay")
RESERVED_TRAIN = (
    "loss",
    "grad_norm",
    "finite_grads",
    "learning_rate",
    "skipped_update_fraction",
    "steps_per_sec",
    "examples_per_sec",
    "input_wait_fraction",
    metrics_lib.LOSS_LABELS,
)


def check_metric_names(metrics: dict, mode: Mode, batch_size: int) -> None:
    """Raises a ``ConfigError`` naming both of two results with one name: a metric and a name the engine
    reports (``loss``, ``num_examples``, ...), or two metrics (``prf/accuracy`` beside a ``ConfusionMatrix``
    named ``prf``, which reports ``prf/accuracy``)."""
    reserved = RESERVED_TRAIN if mode == TRAIN else RESERVED_EVAL
    owner = {name: f"the engine's own {name!r}" for name in reserved}
    for key, value in metrics.items():
        names = metrics_lib.result_names({key: value}, batch_size) if metrics_lib.is_metric_inputs(value) else [key]
        what = f"metric {key!r}" + (f" ({type(value).__name__})" if metrics_lib.is_metric_inputs(value) else "")
        for name in names:
            if name in owner:
                raise ConfigError(
                    f"Spec(metrics=...) in {mode} mode reports {name!r} twice: {owner[name]} and {what}; expected "
                    "distinct names (one would silently replace the other). Fix: rename the metric."
                )
            owner[name] = what if name == key else f"{what}'s field {name!r}"


def _check_rows(what: str, tree, batch_size: int, mode: Mode) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shape = jnp.shape(leaf)
        if not shape or shape[0] != batch_size:
            raise SpecError(
                f"model_fn {what} {jax.tree_util.keystr(path)} has shape {shape} in {mode} mode; expected the "
                f"batch ({batch_size}) as leading axis, one row per example."
            )


def _name(path) -> str:
    return "".join(str(p) for p in path) or "predictions"
