"""From a user's input to host batches, without stalling the device.

Owns: turning any supported input into host-local batches (checked by
``checks``), stacking ``steps_per_loop`` training batches with the input
position after them, and building the next item on a background thread while
the device runs (timing how long the consumer waits for it). Does not own
shuffling or file formats (the sources do), placing batches on the mesh and
padding them (``plan.py``) nor device loops.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from estimax.data.checks import BatchChecker, check_pair, check_source
from estimax.data.source import Source
from estimax.errors import InputError, InputKindError

__all__ = [
    "BatchChecker", "DeviceBatch", "DeviceChunk", "Prefetch", "Shard", "Stacks", "eval_batches", "rows", "train_stacks",
]  # fmt: skip


class DeviceChunk(NamedTuple):
    """``num_steps`` global batches stacked on a leading axis, on the mesh.

    ``input_state`` is the input position right after this chunk's batches
    were drawn (a small JSON-able value to save with a checkpoint and hand
    back to ``train_stacks(input_state=...)``), or ``None`` where the step
    alone determines the position (random-access sources) or the input
    cannot say (plain iterables).
    """

    stack: Any
    num_steps: int
    input_state: Any = None


class DeviceBatch(NamedTuple):
    """One global evaluation batch with its padding mask, on the mesh."""

    batch: Any
    mask: Any
    num_valid: int  # valid rows of this process
    padded: bool  # whether this process padded it


class Shard(NamedTuple):
    """The part of the input one process reads: process ``process_index`` of ``process_count``."""

    process_index: int
    process_count: int


# -- host batches -------------------------------------------------------------


class Stacks:
    """An iterator of host stacks that knows the input position after the last one drawn."""

    def __init__(self, stacks: Iterator, state: Callable[[], Any] | None = None):
        self._stacks, self._state = stacks, state
        self.input_state = None

    def __iter__(self):
        return self

    def __next__(self):
        stack = next(self._stacks)
        if self._state is not None:
            self.input_state = self._state()
        return stack


def train_stacks(
    source,
    host_batch_size: int,
    chunk_sizes: Sequence[int],
    *,
    seed: int,
    start_step: int,
    input_state: Any = None,
    shard: Shard | None = None,
) -> Stacks:
    """Host stacks ``(num_steps, host_batch, ...)`` of training batches, one per chunk size.

    Sources that can seek and stack (``from_arrays``, Grain ``MapDataset``s,
    files) deliver them from ``start_step`` themselves; streaming sources
    (a Grain ``IterDataset``) resume from ``input_state``, the value a
    ``DeviceChunk`` carried. Plain iterables are checked batch by batch and
    stacked here, and may end early with a shorter stack. ``shard``: which
    process of how many reads (``Shard(process_index, process_count)``); default JAX's.
    """
    check_source(source)
    process_index, process_count = shard or Shard(jax.process_index(), jax.process_count())
    if isinstance(source, Source):
        kwargs = {} if input_state is None else {"input_state": input_state}
        stacks = source.train_stacks(
            host_batch_size,
            chunk_sizes,
            seed=seed,
            start_step=start_step,
            process_index=process_index,
            process_count=process_count,
            **kwargs,
        )
        return stacks if isinstance(stacks, Stacks) else Stacks(stacks)
    if input_state is not None:
        raise InputError(
            f"train_stacks(input_state={input_state!r}) cannot resume a {type(source).__name__}; "
            "expected input_state=None for plain iterables (they restart where the caller left them)."
        )
    return Stacks(_stack(_drop_final_partial(_iterate(source), host_batch_size), chunk_sizes))


def _stack(batches: Iterator, chunk_sizes: Sequence[int]) -> Iterator:
    """Checked batches written straight into one preallocated array per leaf and chunk."""
    check = BatchChecker()
    for size in chunk_sizes:
        buffers, treedef, count = None, None, 0
        for batch in itertools.islice(batches, size):
            leaves, treedef = check.flatten(batch)
            if buffers is None:  # fresh buffers: the previous stack may still be in transfer
                buffers = [np.empty((size, *x.shape), x.dtype) for x in leaves]
            for buffer, leaf in zip(buffers, leaves, strict=True):
                buffer[count] = leaf
            count += 1
        if buffers is not None:  # at least one batch was drawn
            yield jax.tree.unflatten(treedef, [b[:count] for b in buffers])
        if count < size:
            return


def eval_batches(source, host_batch_size: int, *, shard: Shard | None = None) -> Iterator:
    """Every host batch of evaluation input once; the last ones may be short or empty.

    Sources of known size yield the same number of batches on every process
    (the most any process needs): a process with fewer examples ends with
    short or empty batches, padded and fully masked by ``plan.InputPlan.eval_batches``,
    so that every process runs the same steps and each example counts once.
    Plain iterables must yield the same number of batches on every process.
    ``shard``: which process of how many reads (``Shard(process_index, process_count)``); default JAX's.
    """
    check_source(source)
    if isinstance(source, Source):
        process_index, process_count = shard or Shard(jax.process_index(), jax.process_count())
        return source.eval_batches(host_batch_size, process_index=process_index, process_count=process_count)
    return _iterate(source)


def pad_batches(batches: Iterator, num_batches: int, empty: Callable[[], Any]) -> Iterator:
    """``batches`` followed by empty batches (0 rows, the same arrays) up to ``num_batches``.

    ``empty()`` gives the empty batch when this process had no batch at all.
    """
    count, last = 0, None
    for last in batches:
        count += 1
        yield last
    if count < num_batches:
        zero = jax.tree.map(lambda x: x[:0], last) if last is not None else empty()
        for _ in range(num_batches - count):
            yield zero


def _iterate(source) -> Iterator:
    if not isinstance(source, Iterable):
        raise InputKindError(
            f"Input {type(source).__name__} is not supported; expected estimax.data.from_arrays(...) "
            "or an iterable of (features, labels) host batches."
        )
    for item in source:
        check_pair(item)
        yield item


def _drop_final_partial(batches: Iterator, size: int) -> Iterator:
    """Training batches must be full; a short last batch is dropped (drop_remainder)."""
    for i, batch in enumerate(batches):
        count = rows(batch)
        if count == size:
            yield batch
        elif count < size and next(batches, None) is None:
            return
        else:
            raise InputError(
                f"Training input batch {i} has {count} rows; expected the host batch size {size} "
                "(train_batch_size / process count). Only the last batch may be shorter, and it is dropped."
            )


def rows(batch) -> int:
    """The number of examples of a ``(features, labels)`` batch."""
    leaves = jax.tree.leaves(batch[0])
    if not leaves:
        raise InputError("Input batch has no feature arrays; expected features with one row per example.")
    shape = getattr(leaves[0], "shape", None)
    return (np.shape(leaves[0]) if shape is None else shape)[0]


# -- prefetch ------------------------------------------------------------------


class Prefetch:
    """Runs an iterator on a background thread, ``depth`` items ahead of the consumer.

    The next stack is built and transferred while the device runs the current
    loop. Errors raised by the producer are re-raised by ``next()``. ``get``
    also says how long the device sat idle waiting for an item.
    """

    _DONE = object()

    def __init__(self, iterator: Iterator, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(iterator,), daemon=True, name="estimax-prefetch")
        self._thread.start()

    def _run(self, iterator):
        try:
            for item in iterator:
                if not self._put(item):
                    return
        except BaseException as error:  # forwarded to the consumer
            self._put(error)
            return
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:  # ends worker processes and threads of the source (Grain)
                close()
        self._put(self._DONE)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def get(self, after=None) -> tuple | None:
        """``(the next item, seconds waited for it)``, or ``None`` at the end.

        ``after``: the outputs of the work just dispatched. When the next item is not
        ready, they are waited for first: nothing can be dispatched before the input
        arrives, so only the time the device then sits idle counts as waiting.
        """
        if self._done:
            return None
        if after is not None and self._queue.empty():
            jax.block_until_ready(after)  # host sync: the device finishes before the wait is timed
        start = time.perf_counter()
        item = self._queue.get()
        waited = time.perf_counter() - start
        if item is self._DONE or isinstance(item, BaseException):
            self._done = True
        if isinstance(item, BaseException):
            raise item
        return None if item is self._DONE else (item, waited)

    def __next__(self):
        fetched = self.get()
        if fetched is None:
            raise StopIteration
        return fetched[0]

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
