"""Masked, mergeable averages: how per-example values become exact metrics.

A metric is a ``Mean(total, count)`` pair of sums; sums from any number of
batches, shards and hosts merge by addition, and padded examples carry a
``False`` mask and contribute nothing. Owns no I/O and no device placement.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Mean(NamedTuple):
    total: jax.Array
    count: jax.Array

    @classmethod
    def from_values(cls, values: jax.Array, mask: jax.Array) -> Mean:
        """Sums of per-example ``values`` ``(batch,)`` or a batch-level scalar over valid rows."""
        valid = jnp.sum(mask, dtype=jnp.int32)
        values = jnp.asarray(values, jnp.float32)
        if values.ndim == 0:
            return cls(values * valid, valid)
        # where(), not multiply: a NaN on a padded row must not leak into the sum.
        return cls(jnp.sum(jnp.where(mask, values, 0.0)), valid)

    def merge(self, other: Mean) -> Mean:
        return Mean(self.total + other.total, self.count + other.count)

    def compute(self) -> float:
        count = int(np.asarray(self.count))
        return float(np.asarray(self.total)) / count if count else float("nan")


def zeros(names) -> dict[str, Mean]:
    """Empty sums on the host, for an explicit ``device_put``."""
    return {n: Mean(np.zeros((), np.float32), np.zeros((), np.int32)) for n in names}
