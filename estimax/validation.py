"""Checks that run before the first training step, so that no step is trained in vain.

Owns the up-front checks of a ``train``/``train_and_evaluate`` call that do
not need a compiled step: hooks that are not ``Hook``s, and the metric names
that ``Best`` and early stopping refer to, derived from the abstract
evaluation outputs (``jax.eval_shape`` of the model_fn in EVAL mode on the
shapes of the first evaluation batch: nothing is evaluated). Batch sizes are
checked by ``data/plan.py``, writability by ``lock.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import jax
import numpy as np

from estimax.config import Best
from estimax.data.source import Source
from estimax.hooks import EarlyStopping, Hook


def check_hooks(hooks) -> list[Hook]:
    """``hooks`` as a list, or a ``TypeError`` naming the one that is not an ``estimax.hooks.Hook``."""
    if isinstance(hooks, Hook):
        raise TypeError(
            f"hooks={hooks!r} is one Hook; expected a list of them. Fix: hooks=[{type(hooks).__name__}(...)]."
        )
    hooks = list(hooks)
    for i, hook in enumerate(hooks):
        if not isinstance(hook, Hook):
            raise TypeError(
                f"hooks[{i}] is {type(hook).__name__} ({hook!r}); expected an estimax.hooks.Hook. Fix: subclass "
                "Hook and override begin/after_loop/after_eval/end (a plain function is not called)."
            )
    return hooks


def metric_names(names) -> list[str]:
    """The names an evaluation reports: ``names`` (``metrics.result_names`` of ``Core.eval_values``'s
    abstract outputs) and ``num_examples``."""
    return sorted({*names, "num_examples"})


def metrics_used(hooks: Sequence[Hook], best: Best | None) -> dict[str, str]:
    """``{metric: who uses it}`` of the eval metrics that ``best`` and early stopping read."""
    used = {best.metric: f"Best(metric={best.metric!r})"} if best is not None else {}
    for hook in hooks:
        if isinstance(hook, EarlyStopping) and hook.split == "eval":
            used.setdefault(hook.metric, f"EarlyStopping(metric={hook.metric!r})")
    return used


def check_metric_names(used: dict[str, str], names: list[str]) -> None:
    unknown = {m: who for m, who in used.items() if m not in names}
    if unknown:
        who = ", ".join(unknown.values())
        raise ValueError(
            f"{who}: not among the evaluation's metrics {names}; expected one of them (the loss and the "
            "names of Spec(metrics=...) in EVAL mode). Fix: correct the name."
        )


def first_eval_batch(source, host_batch_size: int):
    """The first host batch of an input that can be read again without side effects
    (``from_arrays``, Grain and file sources), else ``None``."""
    if not isinstance(source, Source):
        return None
    batches = source.eval_batches(host_batch_size, process_index=0, process_count=1)
    return next(iter(batches), None)


def abstract_batch(batch, global_batch_size: int):
    """``ShapeDtypeStruct``s of a host batch with the global batch as leading axis."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((global_batch_size, *np.shape(x)[1:]), np.asarray(x).dtype), batch
    )


def devices(num_devices: int | None) -> list:
    devices = jax.devices()
    if num_devices is not None and num_devices > len(devices):
        raise ValueError(
            f"RunConfig(num_devices={num_devices}) exceeds the {len(devices)} devices available; "
            f"expected at most {len(devices)}."
        )
    return devices[:num_devices]


def check_model_fn(model_fn) -> None:
    if not callable(model_fn):
        raise TypeError(
            f"Estimator(model_fn={model_fn!r}) is not callable; expected "
            "`def model_fn(model, features, labels, mode, params) -> ex.Spec`."
        )
    try:
        inspect.signature(model_fn).bind(None, None, None, None, None)
    except TypeError:
        raise TypeError(
            f"Estimator(model_fn=...) has signature {inspect.signature(model_fn)}; expected "
            "`model_fn(model, features, labels, mode, params)`: five positional arguments."
        ) from None
    except ValueError:  # builtins without a signature: accept
        pass


def check_eval_metrics_exist(core, abstract_state, mesh, batch_size: int, inputs, used: dict[str, str]) -> None:
    """Raises unless every metric in ``used`` is among the evaluation's outputs, traced abstractly on
    the first batch of the first of ``inputs`` that can be read again (the evaluation input, else the
    training input); nothing is compiled or evaluated. The trace also checks the model_fn's EVAL-mode
    Spec (metric names that collide, shapes), so that a mistake there stops before the first training
    step. Plain iterables are checked at the first evaluation instead."""
    from estimax import metrics as metrics_lib

    host_batch = batch_size // jax.process_count()
    batch = next((b for b in (first_eval_batch(i, host_batch) for i in inputs) if b is not None), None)
    if batch is None:
        return
    with jax.set_mesh(mesh):  # modules that declare shardings need a mesh to trace
        values, _ = jax.eval_shape(core.eval_values, abstract_state, abstract_batch(batch, batch_size))
    check_metric_names(used, metric_names(metrics_lib.result_names(values, batch_size)))
