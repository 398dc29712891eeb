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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import jax
import numpy as np

from estimax.data import feed
from estimax.data import files as files_lib
from estimax.data.checks import BatchChecker, stack_examples
from estimax.data.source import total_steps
from estimax.errors import InputError, InputKindError

Shard = Callable[[int, int], grain.MapDataset]


class MapSource:
    """A random-access input: the batch of step ``s`` is a pure function of the seed and ``s``.

    Training draws global batches from one permutation of every example per
    epoch, and process ``p`` of ``n`` reads the ``p``-th part of each: the
    global batches do not depend on the number of processes, so a run resumed
    in another shape continues at the next example. Evaluation reads
    ``shard(process_index, process_count)``, the examples a process holds.
    """

    kind = "a random-access input (from_grain of a MapDataset, a file reader or a map-style from_hf)"

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
        return self._size // (host_batch_size * process_count)

    def train_stacks(
        self,
        host_batch_size: int,
        chunk_sizes: Sequence[int],
        *,
        seed: int,
        start_step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ) -> Iterator:
        """Stacks of batches from ``start_step`` on; each epoch a new permutation of every example,
        cut into full global batches (the remainder of the epoch is dropped)."""
        global_batch = host_batch_size * process_count
        if self._size < global_batch:
            raise InputError(
                f"The training set has {self._size} examples, fewer than one batch of {global_batch} "
                "(train_batch_size, over all processes); expected at least one full batch. "
                "Fix: lower train_batch_size."
            )
        # Grain's shuffle gives index i of epoch e (i + e * size) the e-th permutation's i-th example.
        order = _GlobalOrder(self._shard(0, 1).shuffle(seed % 2**32), global_batch, host_batch_size, process_index)
        first = start_step * host_batch_size
        examples = grain.MapDataset.range(first, first + total_steps(chunk_sizes) * host_batch_size).map(order)
        # Only the steps this call trains: Grain's read-ahead stops at the end of training.
        batches = self._read(examples.batch(host_batch_size, drop_remainder=True, batch_fn=stack_examples))
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


class _GlobalOrder:
    """This process's ``k``-th training example: row ``k % host_batch`` of its part of global batch
    ``k // host_batch``, read from one shuffled pass per epoch over every example."""

    def __init__(self, shuffled: grain.MapDataset, global_batch: int, host_batch: int, process_index: int):
        self.shuffled, self.global_batch, self.host_batch = shuffled, global_batch, host_batch
        self.offset = process_index * host_batch
        self.per_epoch = len(shuffled) // global_batch  # full global batches; the rest of an epoch is dropped

    def __call__(self, k: int):
        step, row = divmod(int(k), self.host_batch)
        epoch, batch = divmod(step, self.per_epoch)
        return self.shuffled[epoch * len(self.shuffled) + batch * self.global_batch + self.offset + row]


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

    ``make(process_index, process_count)`` builds the process's pipeline; ``kind`` names the
    input in errors. Each process's position is its own: a checkpoint keeps every process's,
    and a run resumed with another number of processes is refused (``plan.py``).
    """

    def __init__(self, make: Callable[[int, int], grain.IterDataset], *, num_workers: int = 0, kind: str = "a stream"):
        self._make, self.num_workers, self.kind = make, num_workers, kind

    def train_stacks(
        self,
        host_batch_size: int,
        chunk_sizes: Sequence[int],
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


def _stacks(batches: Iterator, chunk_sizes: Sequence[int]) -> Iterator:
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

    Args:
        dataset: a ``grain.MapDataset``, a ``grain.IterDataset``, or a function
            ``(process_index, process_count) -> IterDataset``, as above.
        num_workers: above 0, runs the pipeline in Grain worker processes
            (``mp_prefetch``; the program needs an ``if __name__ == "__main__":`` guard).
        read_options: Grain's read threads (``grain.ReadOptions``).
    """
    if isinstance(dataset, grain.MapDataset):
        return MapSource(lambda i, n: dataset[i::n], len(dataset), num_workers=num_workers, read_options=read_options)
    if isinstance(dataset, grain.IterDataset):

        def make(process_index: int, process_count: int) -> grain.IterDataset:
            if process_count > 1:
                raise InputError(
                    f"from_grain received an IterDataset and there are {process_count} processes: each would "
                    "read all of it. Fix: pass a MapDataset, or a function (process_index, process_count) -> "
                    "IterDataset that reads that process's shard."
                )
            return dataset

        return IterSource(make, num_workers=num_workers, kind="a Grain IterDataset (from_grain)")
    if callable(dataset):
        return IterSource(dataset, num_workers=num_workers, kind="a Grain IterDataset per process (from_grain)")
    raise InputKindError(
        f"from_grain received {type(dataset).__name__}; expected a grain.MapDataset, a grain.IterDataset, "
        "or a function (process_index, process_count) -> grain.IterDataset."
    )
