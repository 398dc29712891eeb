"""In-memory examples: arrays or dicts of arrays that share a leading axis.

Training batches are random-access by step (batch ``s`` is a pure function of
the seed and ``s``), so a resumed run continues exactly where it stopped from
the step alone. Each epoch is a fresh permutation; the remainder of an epoch
that does not fill a batch is dropped, so every example is seen at most once
per epoch. Evaluation batches run in order and keep the final partial batch. In
training each process reads its part of every global batch (the global
batches do not depend on the process count); in evaluation and prediction,
rows ``process_index::process_count``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from estimax.errors import InputError


class ArrayDataset:
    """Examples held as numpy arrays; see ``from_arrays``."""

    def __init__(self, features: Any, labels: Any = None):
        self.features = jax.tree.map(np.asarray, features)
        self.labels = None if labels is None else jax.tree.map(np.asarray, labels)
        sizes = {}
        for part, tree in (("features", self.features), ("labels", self.labels)):
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
                if leaf.ndim == 0:
                    raise InputError(
                        f"from_arrays: {part}{jax.tree_util.keystr(path)} is a scalar; "
                        "expected an array with one row per example."
                    )
                sizes[f"{part}{jax.tree_util.keystr(path)}"] = leaf.shape[0]
        if not sizes:
            raise InputError("from_arrays: received no arrays; expected features with one row per example.")
        if len(set(sizes.values())) != 1:
            raise InputError(
                f"from_arrays: arrays differ in their number of examples: {sizes}; "
                "expected one leading size shared by features and labels."
            )
        self._size = next(iter(sizes.values()))

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int):
        """Example ``index`` as ``(features, labels)``: a Grain ``RandomAccessDataSource``,
        so ``grain.MapDataset.source(from_arrays(...))`` composes Grain transforms on arrays."""
        return self._take(index)

    def _take(self, index: int | np.ndarray):
        """(features, labels) of the rows ``index``; a 2-D index gives stacked batches."""
        return jax.tree.map(lambda x: x[index], (self.features, self.labels))

    def _shard(self, process_index: int, process_count: int) -> np.ndarray:
        return np.arange(process_index, self._size, process_count)

    def steps_per_epoch(self, host_batch_size: int, process_count: int = 1) -> int:
        return self._size // (host_batch_size * process_count)

    def train_batches(
        self, host_batch_size: int, *, seed: int, start_step: int = 0, process_index: int = 0, process_count: int = 1
    ) -> Iterator:
        """Endless shuffled batches from step ``start_step`` on, reshuffled every epoch."""
        for rows in self._train_rows(host_batch_size, seed, start_step, process_index, process_count):
            yield self._take(rows)

    def train_stacks(
        self,
        host_batch_size: int,
        chunk_sizes: Iterable[int],
        *,
        seed: int,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator:
        """The same batches as ``train_batches``, ``size`` steps at a time for each of
        ``chunk_sizes``, stacked ``(size, batch, ...)`` by a single gather."""
        steps = self._train_rows(host_batch_size, seed, start_step, process_index, process_count)
        for size in chunk_sizes:
            yield self._take(np.stack(list(itertools.islice(steps, size))))

    def _train_rows(self, host_batch_size, seed, start_step, process_index, process_count) -> Iterator[np.ndarray]:
        """Row indices of this process's part of each training batch from ``start_step`` on.

        Each epoch permutes all examples with the seed; global batch ``s`` is
        the ``s``-th slice of it and process ``p`` takes the ``p``-th part of
        that slice. The global batches are the same whatever the process count
        (the arrays are on every host, so any process can read any row).
        """
        global_batch = host_batch_size * process_count
        per_epoch = self._size // global_batch
        if per_epoch == 0:
            raise InputError(
                f"The training set has {self._size} examples, fewer than one batch of {global_batch} "
                "(train_batch_size, over all processes); expected at least one full batch. Fix: lower train_batch_size."
            )
        first_epoch, first = divmod(start_step, per_epoch)
        for epoch in itertools.count(first_epoch):
            order = np.random.default_rng([seed, epoch]).permutation(self._size)
            for i in range(first, per_epoch):
                start = i * global_batch + process_index * host_batch_size
                yield order[start : start + host_batch_size]
            first = 0

    def eval_batches(self, host_batch_size: int, *, process_index: int = 0, process_count: int = 1) -> Iterator:
        """Every example of this process once, in order; the last batches may be short or
        empty, so that every process yields as many batches as the largest shard needs."""
        rows = self._shard(process_index, process_count)
        largest = -(-self._size // process_count)
        for i in range(0, -(-largest // host_batch_size) * host_batch_size, host_batch_size):
            yield self._take(rows[i : i + host_batch_size])


def from_arrays(features: Any, labels: Any = None) -> ArrayDataset:
    """An input from numpy arrays (or dicts/pytrees of them) with one row per example.

    Training shuffles with the run's seed and repeats; evaluation and
    prediction visit every example once.

    Args:
        features: an array, or a dict/pytree of arrays, one row per example.
        labels: the same, or ``None`` (prediction).
    """
    return ArrayDataset(features, labels)
