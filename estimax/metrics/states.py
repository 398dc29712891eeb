"""The built-in metric states of values: sums, means, extremes, moments.

Each is a ``Metric`` of integer counts (int32 on the device, int64 on the
host) or float sums, built from one batch with the padding mask by selection
(``where``), never by multiplication. ``merge`` runs on jax and numpy arrays
alike; ``compute`` on the host in float64. Also owns the helpers every state
shares (the mask over a value's axes, a division by zero counts). The states
of classification (hits, a confusion matrix, AUC histograms) are
``classification``'s; the inputs a model_fn returns are ``inputs``'s.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from estimax.metrics.protocol import Metric, array_module, count_true, static


def mask_like(mask: jax.Array, x: jax.Array) -> jax.Array:
    """The per-example mask broadcast over the trailing axes of ``x``."""
    return jnp.broadcast_to(jnp.reshape(mask, mask.shape + (1,) * (jnp.ndim(x) - 1)), jnp.shape(x))


def divide(a, b):
    """``a / b`` in float64, 0 where ``b`` is 0 (scikit-learn's ``zero_division=0``)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape), where=b != 0)


def _nonfinite_rows(values, mask) -> jax.Array:
    """Valid rows (examples) with a NaN or Inf value."""
    finite = jnp.isfinite(values).reshape(values.shape[0], -1)
    return count_true(mask & ~jnp.all(finite, axis=1))


def _nonfinite_note(nonfinite, rows) -> str:
    return f"{int(nonfinite)} of {int(rows)} examples have NaN or Inf values" if nonfinite else ""


class MeanState(Metric):
    """The state of ``Mean``: the (weighted) total and count of the valid values, the valid rows, and
    how many of them were NaN or Inf; merged by adding, the mean is ``total / count``."""

    total: jax.Array
    count: jax.Array  # int32 without weights, the sum of weights with them
    rows: jax.Array  # valid examples
    nonfinite: jax.Array  # valid examples with a NaN or Inf value: named when the mean is not finite

    @classmethod
    def from_batch(cls, values, weights=None, *, mask):
        values = jnp.asarray(values, jnp.float32)
        rows = count_true(mask)
        if values.ndim == 0:  # a batch-level scalar: only where nothing is padded (checked by the engine)
            nonfinite = jnp.where(jnp.isfinite(values), 0, rows)
            return cls(values * rows, rows, rows, nonfinite)
        bad = _nonfinite_rows(values, mask)
        valid = mask_like(mask, values)
        if weights is None:
            # where(), not multiply: a NaN on a padded row must not leak into the sum.
            return cls(jnp.sum(jnp.where(valid, values, 0.0)), count_true(valid), rows, bad)
        weights = jnp.broadcast_to(jnp.asarray(weights, jnp.float32), values.shape)
        total = jnp.sum(jnp.where(valid, values * weights, 0.0))
        return cls(total, jnp.sum(jnp.where(valid, weights, 0.0)), rows, bad)

    @classmethod
    def empty(cls):
        return cls(np.float32(0), np.int32(0), np.int32(0), np.int32(0))

    def merge(self, other):
        return MeanState(
            self.total + other.total, self.count + other.count, self.rows + other.rows, self.nonfinite + other.nonfinite
        )

    def compute(self) -> float:
        count = float(self.count)
        return float(self.total) / count if count else float("nan")

    def nan_note(self) -> str:
        return _nonfinite_note(self.nonfinite, self.rows)


class SumState(Metric):
    """The state of ``Sum``: the total of the valid values (integers stay integers); merged by adding."""

    total: jax.Array

    @classmethod
    def from_batch(cls, values, *, mask):
        values = jnp.asarray(values)
        exact = jnp.issubdtype(values.dtype, jnp.integer) or values.dtype == jnp.bool_
        values = values.astype(jnp.int32 if exact else jnp.float32)  # counts stay integers
        return cls(jnp.sum(jnp.where(mask_like(mask, values), values, 0)))

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
    """The state of ``Min``: the smallest valid value so far (the dtype's largest value when there is
    none yet) and the input's dtype name; merged with ``min``."""

    value: jax.Array
    dtype: str = static()

    @classmethod
    def from_batch(cls, values, *, mask):
        values = _extreme_input(values)
        identity = _identity(values.dtype.name, largest=True)
        return cls(jnp.min(jnp.where(mask_like(mask, values), values, identity)), values.dtype.name)

    @classmethod
    def empty(cls, dtype):
        return cls(_identity(dtype, largest=True), dtype)

    def merge(self, other):
        return MinState(array_module(self.value).minimum(self.value, other.value), self.dtype)

    def compute(self) -> float:
        return float(self.value)


class MaxState(Metric):
    """The state of ``Max``: the largest valid value so far (the dtype's smallest value when there is
    none yet) and the input's dtype name; merged with ``max``."""

    value: jax.Array
    dtype: str = static()

    @classmethod
    def from_batch(cls, values, *, mask):
        values = _extreme_input(values)
        identity = _identity(values.dtype.name, largest=False)
        return cls(jnp.max(jnp.where(mask_like(mask, values), values, identity)), values.dtype.name)

    @classmethod
    def empty(cls, dtype):
        return cls(_identity(dtype, largest=False), dtype)

    def merge(self, other):
        return MaxState(array_module(self.value).maximum(self.value, other.value), self.dtype)

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
        valid = mask_like(mask, values)
        count = count_true(valid)
        mean = jnp.sum(jnp.where(valid, values, 0.0)) / jnp.maximum(count, 1)
        m2 = jnp.sum(jnp.where(valid, jnp.square(values - mean), 0.0))
        return cls(count, mean, m2)

    @classmethod
    def empty(cls):
        return cls(np.int32(0), np.float32(0), np.float32(0))

    def merge(self, other):
        xp = array_module(self.mean)
        count = self.count + other.count
        share = xp.where(count > 0, other.count / xp.maximum(count, 1), 0.0)
        delta = other.mean - self.mean
        mean = self.mean + delta * share
        m2 = self.m2 + other.m2 + xp.square(delta) * self.count * share
        return MomentsState(count, mean.astype(self.mean.dtype), m2.astype(self.m2.dtype))

    def compute(self) -> float:
        count = float(self.count)
        return math.sqrt(max(float(self.m2) / count, 0.0)) if count else float("nan")
