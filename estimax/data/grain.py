"""Grain datasets as inputs: a user's ``MapDataset`` or ``IterDataset`` of examples.

Owns building each process's training and evaluation pipelines from Grain's
own transformations: the per-process shard (slicing), the per-epoch shuffle
(Grain reshuffles each epoch from the seed), batching with ``drop_remainder``
inside each epoch, repeat, optional worker processes (``mp_prefetch``), and a
streaming pipeline's position through Grain's ``get_state``/``set_state``.
Elements are ``(features, labels)`` examples; ``checks.stack_examples`` batches
them. ``file_source`` shards the records of files over processes for the file
formats; it does not own any format (``idx``, ``tfrecord``, ``arrayrecord``) nor
devices (``feed``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import grain
import jax
import numpy as np

from estimax.data import feed
from estimax.data import files as files_lib
from estimax.data.checks import BatchChecker, stack_examples

Shard = Callable[[int, int], grain.MapDataset]


class MapSource:
    """A random-access input: the batch of step ``s`` is a pure function of the seed and ``s``.

    ``shard(process_index, process_count)`` gives the examples a process
    reads; every process trains on as many examples per epoch as the smallest
    shard holds, so that all take the same number of steps.
    """

    def __init__(self, shard: Shard, size: int, *, num_workers: int = 0, read_options=None):
        self._shard, self._size = shard, size
        self.num_workers, self.read_options = num_workers, read_options
        self._shard_sizes: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return self._size

    def shard_sizes(self, process_count: int) -> tuple[int, ...]:
        """Examples of each process's shard (every process can tell every other's)."""
        if process_count not in self._shard_sizes:
            self._shard_sizes[process_count] = tuple(len(self._shard(q, process_count)) for q in range(process_count))
        return self._shard_sizes[process_count]

    def steps_per_epoch(self, host_batch_size: int, process_count: int = 1) -> int:
        return min(self.shard_sizes(process_count)) // host_batch_size

    def train_stacks(
        self,
        host_batch_size: int,
        chunk_sizes: list[int],
        *,
        seed: int,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator:
        """Stacks of batches from ``start_step`` on; each epoch a new permutation of this
        process's shard, cut into full batches (the remainder of the epoch is dropped)."""
        per_process = min(self.shard_sizes(process_count))
        if per_process < host_batch_size:
            raise ValueError(
                f"The training set has {per_process} examples per process, fewer than one batch of "
                f"{host_batch_size}; expected at least one full batch. Fix: lower train_batch_size."
            )
        epoch = self._shard(process_index, process_count)[:per_process].shuffle(seed % 2**32)
        steps = epoch.batch(host_batch_size, drop_remainder=True, batch_fn=stack_examples).repeat()
        # Only the steps this call trains: Grain's read-ahead stops at the end of training.
        batches = self._read(steps[start_step : start_step + sum(chunk_sizes)])
        return _stacks(batches, chunk_sizes)

    def eval_batches(self, host_batch_size: int, *, process_index: int = 0, process_count: int = 1) -> Iterator:
        """This process's examples once, in order, then empty batches up to the count the
        largest shard needs (every process runs the same evaluation steps)."""
        num_batches = -(-max(self.shard_sizes(process_count)) // host_batch_size)
        shard = self._shard(process_index, process_count)
        batches = self._read(shard.batch(host_batch_size, batch_fn=stack_examples)) if len(shard) else iter(())
        return feed.pad_batches(batches, num_batches, self._empty_batch)

    def _empty_batch(self):
        first = stack_examples([self._shard(0, 1)[0]])
        return jax.tree.map(lambda x: x[:0], first)

    def _read(self, dataset: grain.MapDataset) -> Iterator:
        return iter(_with_workers(dataset.to_iter_dataset(self.read_options), self.num_workers))


def file_source(
    files: list[files_lib.File],
    records: Callable[[list[files_lib.File]], Any],
    parse: Callable[[Any], Any],
    *,
    num_workers: int = 0,
    read_options: grain.ReadOptions | None = None,
) -> MapSource:
    """A random-access input over the records of ``files``, each turned into an example by ``parse``.

    ``records(some_files)`` is a Grain ``RandomAccessDataSource`` of the
    records of those files, in order. With at least as many files as
    processes, process ``i`` of ``n`` reads files ``i::n`` (no process opens
    another's files); otherwise records ``i::n`` of all files.
    """

    def shard(process_index: int, process_count: int) -> grain.MapDataset:
        mine = files_lib.for_process(files, process_index, process_count)
        if mine is None:
            return grain.MapDataset.source(records(files))[process_index::process_count].map(parse)
        return grain.MapDataset.source(records(mine)).map(parse)

    return MapSource(shard, len(shard(0, 1)), num_workers=num_workers, read_options=read_options)


class IterSource:
    """A streaming input: read in order, its position is Grain's iterator state.

    ``make(process_index, process_count)`` builds the process's pipeline.
    """

    def __init__(self, make: Callable[[int, int], grain.IterDataset], *, num_workers: int = 0):
        self._make, self.num_workers = make, num_workers

    def train_stacks(
        self,
        host_batch_size: int,
        chunk_sizes: list[int],
        *,
        seed: int,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        input_state: Any = None,
    ) -> feed.Stacks:
        """Stacks from the start of the pipeline, or from ``input_state``; the iterator's
        state is read after each stack. ``seed`` and ``start_step`` are not used: the
        pipeline owns its order, and its state (not the step) its position."""
        del seed, start_step
        dataset = self._make(process_index, process_count)
        batched = dataset.batch(host_batch_size, drop_remainder=True, batch_fn=stack_examples)
        iterator = iter(_with_workers(batched, self.num_workers))
        if input_state is not None:
            iterator.set_state(input_state)
        return feed.Stacks(_stacks(iterator, chunk_sizes), iterator.get_state)

    def eval_batches(self, host_batch_size: int, *, process_index: int = 0, process_count: int = 1) -> Iterator:
        dataset = self._make(process_index, process_count)
        return iter(_with_workers(dataset.batch(host_batch_size, batch_fn=stack_examples), self.num_workers))


def _stacks(batches: Iterator, chunk_sizes: list[int]) -> Iterator:
    check = BatchChecker()
    try:
        for size in chunk_sizes:
            host = [check(b) for b in itertools.islice(batches, size)]
            if host:
                yield jax.tree.map(lambda *xs: np.stack(xs), *host)
            if len(host) < size:
                return
    finally:
        close = getattr(batches, "close", None)
        if close is not None:  # mp_prefetch workers
            close()


def _with_workers(dataset: grain.IterDataset, num_workers: int) -> grain.IterDataset:
    if not num_workers:
        return dataset
    from absl import flags

    if not flags.FLAGS.is_parsed():  # Grain reads absl flags; outside absl.app.run nobody parsed them
        flags.FLAGS.mark_as_parsed()
    return dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))


def from_grain(dataset, *, num_workers: int = 0, read_options: grain.ReadOptions | None = None):
    """An input from a Grain dataset whose elements are ``(features, labels)`` examples.

    - a ``grain.MapDataset`` (random access): process ``i`` of ``n`` reads
      examples ``i::n``; training shuffles each epoch from the run's seed and
      seeks by step, so resuming needs only the step; ``train(epochs=...)``
      works; evaluation reads each example once.
    - a ``grain.IterDataset`` (streaming), or a function
      ``(process_index, process_count) -> IterDataset`` that reads the
      process's shard: read in order; its position is exposed as each
      ``DeviceChunk``'s ``input_state`` for checkpoints.

    ``num_workers > 0`` runs the pipeline in Grain worker processes
    (``mp_prefetch``; the program needs an ``if __name__ == "__main__":`` guard).
    """
    if isinstance(dataset, grain.MapDataset):
        return MapSource(lambda i, n: dataset[i::n], len(dataset), num_workers=num_workers, read_options=read_options)
    if isinstance(dataset, grain.IterDataset):

        def make(process_index: int, process_count: int) -> grain.IterDataset:
            if process_count > 1:
                raise ValueError(
                    f"from_grain received an IterDataset and there are {process_count} processes: each would "
                    "read all of it. Fix: pass a MapDataset, or a function (process_index, process_count) -> "
                    "IterDataset that reads that process's shard."
                )
            return dataset

        return IterSource(make, num_workers=num_workers)
    if callable(dataset):
        return IterSource(dataset, num_workers=num_workers)
    raise TypeError(
        f"from_grain received {type(dataset).__name__}; expected a grain.MapDataset, a grain.IterDataset, "
        "or a function (process_index, process_count) -> grain.IterDataset."
    )
