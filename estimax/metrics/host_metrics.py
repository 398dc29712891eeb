"""Metrics computed on the host (``host_metrics``), exact for anything.

Owns bringing ``Spec(eval_outputs=...)`` arrays of each evaluation batch to
the host (valid rows only, every process's rows on every process, in input
order: shards ``i::n``, as ``from_arrays`` and Grain ``MapDataset`` inputs
have), and checking the user's function and what it returns. Costs
O(examples) host memory. Does not own the device metrics (``metrics``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from estimax.errors import ConfigError, ConfigTypeError


class OutputRows:
    """Collects the valid rows of every batch's outputs; ``rows()`` concatenates them.

    Each batch is read when the next one has been dispatched, so that reading
    does not leave the device idle.
    """

    def __init__(self):
        self._pending, self._parts = None, []

    def add(self, outputs: dict, num_valid: int) -> None:
        if self._pending is not None:
            self._parts.append(_valid_rows(*self._pending))
        self._pending = (outputs, num_valid)

    def rows(self) -> dict[str, np.ndarray]:
        if self._pending is not None:
            self._parts.append(_valid_rows(*self._pending))
            self._pending = None
        if not self._parts:
            return {}
        return jax.tree.map(lambda *parts: np.concatenate(parts), *self._parts)


def _valid_rows(outputs: dict, num_valid: int) -> dict[str, np.ndarray]:
    """One global batch's valid rows in input order, on every process."""
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.asarray(x)[:num_valid], jax.device_get(outputs))  # host sync
    from jax.experimental import multihost_utils

    # host sync: a collective of every process; the global batch is the processes' host batches in order
    gathered = multihost_utils.process_allgather(outputs, tiled=True)
    valid = np.asarray(multihost_utils.process_allgather(np.int32(num_valid)))
    count = len(valid)
    host_batch = len(jax.tree.leaves(gathered)[0]) // count
    # Local row r of process p is example r * count + p of the batch.
    order = [p * host_batch + r for r in range(host_batch) for p in range(count) if r < valid[p]]
    return jax.tree.map(lambda x: np.asarray(x)[order], gathered)


def results(host_metrics: Callable, outputs: dict, taken: dict) -> dict[str, float]:
    """``host_metrics(outputs)`` as floats; names already ``taken`` by the device metrics are refused."""
    values = host_metrics(outputs)
    if not isinstance(values, dict):
        raise ConfigTypeError(
            f"host_metrics returned {type(values).__name__}; expected a dict name -> float, "
            "e.g. `{'auc': sklearn.metrics.roc_auc_score(o['labels'], o['scores'])}`."
        )
    clashes = sorted(set(values) & set(taken))
    if clashes:
        raise ConfigError(
            f"host_metrics returned {clashes}, which the model_fn's metrics already name; expected new names."
        )
    return {name: float(value) for name, value in values.items()}


def check(host_metrics) -> None:
    if host_metrics is not None and not callable(host_metrics):
        raise ConfigTypeError(
            f"host_metrics={host_metrics!r} is not callable; expected `fn(outputs) -> dict[str, float]`, "
            "where outputs holds the Spec(eval_outputs=...) arrays of every example."
        )
