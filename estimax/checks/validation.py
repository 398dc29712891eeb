"""Checks that run before a call does any work, so that no step is trained (or evaluated) in vain.

Owns the up-front checks that do not need a compiled step: the model_fn's
signature, hooks that are not ``Hook``s, and ``ModeChecks``, which traces the
model_fn abstractly in each mode a call will use (``jax.make_jaxpr`` on the
shapes of the first batch of the call's input: nothing is compiled,
allocated or evaluated): TRAIN for ``train`` (under ``compute_dtype``, also
whether the model's matrix work runs in it: ``precision.check_matmuls``),
also EVAL for ``train_and_evaluate`` (scalars where the input may pad a
batch; the metric names that ``Best`` and early stopping refer to), EVAL for
``evaluate``, PREDICT for ``predict``; each mode and batch shape once per
Estimator. ``computation`` traces the training step's fingerprint on the
global batch ``train`` saw (``fingerprint.py``), which the run records.
Batch sizes are checked by ``data/plan.py``, writability by ``lock.py``, a
model_fn's errors are retold by ``diagnose.py``.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from estimax import eval_sets, fingerprint, precision
from estimax import metrics as metrics_lib
from estimax.data import checks
from estimax.data.source import SizedSource, Source
from estimax.errors import ConfigError, ConfigTypeError, SpecError
from estimax.hooks import EarlyStopping, Hook
from estimax.metrics import host_metrics as host_metrics_lib
from estimax.spec import EVAL, PREDICT, TRAIN


def check_hooks(hooks) -> list[Hook]:
    """``hooks`` as a list, or a ``ConfigTypeError`` naming the one that is not an ``estimax.hooks.Hook``."""
    if isinstance(hooks, Hook):
        raise ConfigTypeError(
            f"hooks={hooks!r} is one Hook; expected a list of them. Fix: hooks=[{type(hooks).__name__}(...)]."
        )
    hooks = list(hooks)
    for i, hook in enumerate(hooks):
        if not isinstance(hook, Hook):
            raise ConfigTypeError(
                f"hooks[{i}] is {type(hook).__name__} ({hook!r}); expected an estimax.hooks.Hook. Fix: subclass "
                "Hook and override begin/after_loop/after_eval/end (a plain function is not called)."
            )
    return hooks


def metric_names(names) -> list[str]:
    """The names an evaluation reports: ``names`` (``metrics.result_names`` of ``Core.eval_values``'s
    abstract outputs) and ``num_examples``."""
    return sorted({*names, "num_examples"})


def metrics_used(hooks: Sequence[Hook], best_metric: str | None) -> dict[str, str]:
    """``{metric: who uses it}`` of the eval metrics that ``Best(metric=best_metric)`` and early stopping read."""
    used = {best_metric: f"Best(metric={best_metric!r})"} if best_metric is not None else {}
    for hook in hooks:
        if isinstance(hook, EarlyStopping) and eval_sets.is_eval_split(hook.split):
            used.setdefault(hook.metric, f"EarlyStopping(metric={hook.metric!r})")
    return used


def check_watched_splits(hooks: Sequence[Hook], splits: list[str]) -> None:
    """Refuses an ``EarlyStopping`` that watches a split no evaluation of the call records (it would
    never stop): ``splits`` are the evaluation's, ``eval`` or ``eval_<name>`` per set."""
    for hook in hooks:
        if isinstance(hook, EarlyStopping) and hook.split not in splits:
            raise ConfigError(
                f"EarlyStopping(split={hook.split!r}) watches no evaluation of this call, whose evaluations are "
                f"recorded as {splits}; expected one of them. Fix: EarlyStopping(..., split={splits[0]!r}) "
                "(a set named 'val' is the split 'eval_val')."
            )


def check_metric_names(used: dict[str, str], names: list[str]) -> None:
    unknown = {m: who for m, who in used.items() if m not in names}
    if unknown:
        who = ", ".join(unknown.values())
        raise ConfigError(
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


def check_arguments(model_fn, optimizer, host_metrics) -> None:
    """``Estimator(model_fn=..., optimizer=..., host_metrics=...)`` of the kinds they must be."""
    check_model_fn(model_fn)
    host_metrics_lib.check(host_metrics)
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise ConfigTypeError(
            f"Estimator(optimizer={optimizer!r}) is not an optax GradientTransformation; "
            "expected e.g. `optax.sgd(0.05)` or `optax.adam(1e-3)`."
        )


def check_model_fn(model_fn) -> None:
    if not callable(model_fn):
        raise ConfigTypeError(
            f"Estimator(model_fn={model_fn!r}) is not callable; expected "
            "`def model_fn(model, features, labels, mode, params) -> ex.Spec`."
        )
    try:
        inspect.signature(model_fn).bind(None, None, None, None, None)
    except TypeError:
        raise ConfigTypeError(
            f"Estimator(model_fn=...) has signature {inspect.signature(model_fn)}; expected "
            "`model_fn(model, features, labels, mode, params)`: five positional arguments."
        ) from None
    except ValueError:  # builtins without a signature: accept
        pass


class ModeChecks:
    """Traces a model_fn abstractly in the modes a call will use, before that call does any work.

    Each trace is a ``jax.make_jaxpr`` on the shapes of the first batch of the call's own input,
    with the global batch of that mode (``plan.global_batch``): nothing is compiled, allocated or
    evaluated. What the model_fn raises is retold by ``diagnose.py`` (a ``ModelFnError``); what it
    returns is checked by ``checks/spec.py``. Each method returns the input to use from then on:
    an iterator whose first batch was read has it put back.
    """

    def __init__(self, core, abstract_state, plan):
        self.core, self.abstract_state, self.plan = core, abstract_state, plan
        self._traced: dict = {}  # (mode, batch shapes) -> what tracing gave: each is traced once
        self._computations: dict = {}  # an encoded train batch -> the training step's fingerprint on it
        self._train_batch = None  # the encoded global batch of the last input train() checked

    def _trace(self, mode: str, fn, batch, batch_size: int, inspect=None):
        """``fn``'s abstract outputs on ``batch``; ``inspect(jaxpr)`` reads the program when it is first traced."""
        abstract = abstract_batch(batch, batch_size)
        key = (mode, jax.tree.structure(abstract), tuple(jax.tree.leaves(abstract)))
        if key not in self._traced:
            with jax.set_mesh(self.plan.layout.mesh):  # modules that declare shardings need a mesh to trace
                jaxpr, self._traced[key] = jax.make_jaxpr(fn, return_shape=True)(self.abstract_state, abstract)
            if inspect is not None:
                inspect(jaxpr)
        return self._traced[key]

    def of_mode(self, mode: str, input):
        """The check of ``mode`` (``ex.TRAIN``, ``ex.EVAL``, ``ex.PREDICT``) on ``input`` (``Estimator.check``)."""
        by_mode = {TRAIN: self.train, EVAL: self.evaluate, PREDICT: self.predict}
        if mode not in by_mode:
            raise ConfigError(f"Estimator.check(mode={mode!r}); expected ex.TRAIN, ex.EVAL or ex.PREDICT.")
        return by_mode[mode](input)

    def train(self, input):
        """TRAIN mode, on micro-batches where gradients are accumulated; under ``compute_dtype``,
        whether the model's matrix work runs in it."""
        batch, input = peek(input)
        self._train_batch = None  # unknown for an input whose first batch cannot be read ahead
        if batch is not None:
            micro_batch_size = self.plan.global_batch(TRAIN) // self.core.grad_accum_steps
            dtype = self.core.compute_dtype
            self._trace(
                TRAIN,
                lambda s, b: self.core.call(s.params, s, b, TRAIN, micro_batch_size)[0].loss,
                batch,
                micro_batch_size,
                inspect=None if dtype is None else lambda jaxpr: precision.check_matmuls(jaxpr, dtype),
            )
            self._train_batch = fingerprint.encode_batch(abstract_batch(batch, self.plan.global_batch(TRAIN)))
        return input

    def computation(self) -> fingerprint.Computation | None:
        """The fingerprint of the training step on the last input ``train`` checked, traced when first
        asked for (a run without model_dir records none)."""
        return None if self._train_batch is None else self.computation_on(self._train_batch)

    def computation_on(self, encoded) -> fingerprint.Computation | None:
        """The fingerprint of the training step on a batch ``fingerprint.encode_batch`` wrote (a run's
        record); ``None`` for a batch of another kind or one the step cannot take."""
        key = repr(encoded)
        if key not in self._computations:
            mesh = self.plan.layout.mesh
            self._computations[key] = fingerprint.trace_recorded(self.core, self.abstract_state, mesh, encoded)
        return self._computations[key]

    def evaluate(self, input, used: dict[str, str] | None = None):
        """EVAL mode: values that padding would corrupt (scalars) where the input may pad a batch,
        and the metric names in ``used`` (``metrics_used``) among the evaluation's results."""
        batch, input = peek(input)
        if batch is None:
            return input
        batch_size = self.plan.global_batch(EVAL)
        values, _ = self._trace(EVAL, self.core.eval_values, batch, batch_size)
        scalars = sorted(k for k, v in values.items() if not metrics_lib.is_metric_inputs(v) and not v.shape)
        why = padding(input, batch_size)
        if scalars and why is not None:
            raise SpecError(
                f"model_fn returned scalar {scalars} in eval mode (one value for the whole batch, e.g. a "
                f"`.mean()`), and {why}: a scalar cannot leave the padding out. Expected per-example values of "
                f"shape ({batch_size},). Fix: return the per-example loss and metrics (drop the `.mean()`); "
                "training and evaluation average them, with the padding masked."
            )
        if used:
            check_metric_names(used, metric_names(metrics_lib.result_names(values, batch_size)))
        return input

    def predict(self, input):
        """PREDICT mode, with the labels the input has (none, mostly)."""
        batch, input = peek(input)
        if batch is not None:
            self._trace(PREDICT, self.core.predict_step, batch, self.plan.global_batch(PREDICT))
        return input


def peek(input) -> tuple:
    """``(the first batch of input or None, the input to use from now on)``.

    A ``Source`` is read again from its start (its first example only); a plain iterator gives its
    first batch, which is put back in front; another iterable is iterated once more. ``None`` where
    there is no (features, labels) batch to read: the input's own checks say why when it is used.
    """
    checks.check_source(input)
    if isinstance(input, Source):
        first = first_eval_batch(input, 1)
    elif isinstance(input, Iterable):
        batches = iter(input)
        first = next(batches, None)
        if batches is input and first is not None:
            input = itertools.chain([first], batches)
    else:
        return None, input
    if not (isinstance(first, tuple) and len(first) == 2):
        return None, input
    checks.describe(first)  # text or ragged arrays: the input's own error, not a tracing one
    return first, input


def padding(input, batch_size: int) -> str | None:
    """Why evaluating ``input`` in global batches of ``batch_size`` may pad a batch; ``None``: it cannot."""
    if not isinstance(input, SizedSource):
        return f"an input of unknown length ({type(input).__name__}) may end in a short batch, padded"
    if len(input) % batch_size:
        rest = len(input) % batch_size
        return f"its {len(input)} examples in batches of {batch_size} end in a batch that is padded ({rest} valid rows)"
    if jax.process_count() > 1:
        return f"its shards over {jax.process_count()} processes may end in padded batches"
    return None
