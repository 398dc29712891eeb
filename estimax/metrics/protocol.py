"""The metric protocol: a state of sufficient statistics, and the inputs a model_fn returns.

A metric *state* subclasses ``Metric`` (a frozen dataclass pytree; fields
marked ``static()`` are hashable aux data): built from one batch and the
padding mask (``from_batch``), merged associatively and commutatively
(``merge``, whose identity is ``empty``), turned into numbers on the host in
float64 (``compute``). ``Inputs`` are one batch's arrays and config, which
the engine turns into a state with the mask. Also owns the host-side helpers
of the engine: empty states, int64/float64 host copies, merges over steps and
flat result names. Owns no built-in metric (``states``, ``inputs``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import numpy as np

from estimax.errors import ConfigTypeError, EstimaxError, MissingMethodError, SpecError

logger = logging.getLogger("estimax")

NUM_EXAMPLES = "num_examples"
"""The key of the count of valid examples that every evaluation reports."""


# -- array helpers of the states -----------------------------------------------


def array_module(x):
    """numpy for host arrays, jax.numpy otherwise: ``merge`` runs on both."""
    return np if isinstance(x, np.ndarray | np.generic) else jax.numpy


def count_true(mask) -> jax.Array:
    """The number of true entries of ``mask``, in int32 (a state's count on the device)."""
    return jax.numpy.sum(mask, dtype=jax.numpy.int32)


# -- the protocol ---------------------------------------------------------------


def static(default: Any = dataclasses.MISSING):
    """A static config field of a ``Metric`` (hashable aux data, e.g. ``num_classes``)."""
    return dataclasses.field(default=default, metadata={"static": True})


def _missing(cls: type, method: str) -> MissingMethodError:
    return MissingMethodError(
        f"Metric {cls.__name__} does not define {method}; expected a Metric to define from_batch, empty, merge "
        f"and compute. Fix: define {cls.__name__}.{method} (the metrics guide shows a whole metric)."
    )


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
      operators (or numpy for numpy arrays), not ``jnp`` only;
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
        raise _missing(cls, "from_batch")

    @classmethod
    def empty(cls, **config):
        raise _missing(cls, "empty")

    def merge(self, other):
        raise _missing(type(self), "merge")

    def compute(self) -> float | dict[str, float]:
        raise _missing(type(self), "compute")


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
                raise ConfigTypeError(
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


# -- what the engine does with states ----------------------------------------------


def is_metric_inputs(value) -> bool:
    """Whether a ``Spec.metrics`` value is a mergeable metric's inputs (``Inputs``), not plain values to average."""
    return isinstance(value, Inputs)


def config_of(state: Metric) -> dict:
    """The static config fields of a state."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.metadata.get("static")}


def empty_like(state: Metric) -> Metric:
    """The identity of ``state``'s merge, as host arrays of its shapes and dtypes (``state`` may be abstract)."""
    empty = jax.device_get(type(state).empty(**config_of(state)))  # explicit: a user's empty() may use jnp
    try:
        return jax.tree.map(lambda e, s: np.broadcast_to(np.asarray(e, s.dtype), s.shape).copy(), empty, state)
    except (ValueError, TypeError) as error:
        raise SpecError(
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
    """``state.compute()`` under flat names: ``name`` or ``"name/field"``; errors name the metric. A
    result that is not finite because of NaN/Inf inputs is logged as a warning naming the metric and
    how many examples had them (a state's ``nan_note()``); the result is kept."""
    try:
        value = state.compute()
    except ValueError as error:  # an estimax error keeps its class (InputError: the labels or scores)
        kind = type(error) if isinstance(error, EstimaxError) else ValueError
        raise kind(f"Metric {name!r} ({type(state).__name__}): {error}") from error
    if isinstance(value, dict):
        values = {f"{name}/{field}": float(v) for field, v in value.items()}
    else:
        values = {name: float(value)}
    note = state.nan_note() if hasattr(state, "nan_note") else ""
    numbers = np.asarray(list(values.values()), np.float64)
    if note and not np.isfinite(numbers).all():
        kind = "NaN" if np.isnan(numbers).any() else "infinite"
        logger.warning("Metric %r is %s: %s (the result is kept).", name, kind, note)
    return values
