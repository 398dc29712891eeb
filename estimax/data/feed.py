"""From a user's input to arrays on the mesh, without stalling the device.

Owns: turning any supported input into host-local batches, checking every
batch against the first (structure, shapes, dtypes), padding the final
evaluation batch with a mask, stacking ``steps_per_loop`` training batches,
and building the next stack on a background thread while the device runs.
Does not own shuffling or file formats (the sources do) nor device loops.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from estimax import mesh as mesh_lib


class DeviceChunk(NamedTuple):
    """``num_steps`` global batches stacked on a leading axis, on the mesh."""

    stack: Any
    num_steps: int


class DeviceBatch(NamedTuple):
    """One global evaluation batch with its padding mask, on the mesh."""

    batch: Any
    mask: Any
    num_valid: int  # valid rows of this process
    padded: bool  # whether this process padded it


# -- host batches -------------------------------------------------------------


def train_stacks(source, host_batch_size: int, chunk_sizes: list[int], *, seed: int, start_step: int) -> Iterator:
    """Host stacks ``(num_steps, host_batch, ...)`` of training batches, one per chunk size.

    Sources that can seek and stack (``from_arrays``) deliver them from
    ``start_step`` in one gather each; plain iterables are checked batch by
    batch and stacked here, and may end early with a shorter stack.
    """
    if hasattr(source, "train_stacks"):
        return source.train_stacks(
            host_batch_size,
            chunk_sizes,
            seed=seed,
            start_step=start_step,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
    return _stack(_drop_final_partial(_iterate(source), host_batch_size), chunk_sizes)


def _stack(batches: Iterator, chunk_sizes: list[int]) -> Iterator:
    check = BatchChecker()
    for size in chunk_sizes:
        host = [check(b) for b in _take(batches, size)]
        if host:
            yield jax.tree.map(lambda *xs: np.stack(xs), *host)
        if len(host) < size:
            return


def eval_batches(source, host_batch_size: int) -> Iterator:
    """Every host batch of evaluation input once; the last one may be short."""
    if hasattr(source, "eval_batches"):
        return source.eval_batches(
            host_batch_size, process_index=jax.process_index(), process_count=jax.process_count()
        )
    return _iterate(source)


def _iterate(source) -> Iterator:
    if not isinstance(source, Iterable):
        raise TypeError(
            f"Input {type(source).__name__} is not supported; expected estimax.data.from_arrays(...) "
            "or an iterable of (features, labels) host batches."
        )
    for item in source:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                f"Input yielded {type(item).__name__}; expected a (features, labels) tuple "
                "(labels may be None for prediction)."
            )
        yield item


def _drop_final_partial(batches: Iterator, size: int) -> Iterator:
    """Training batches must be full; a short last batch is dropped (drop_remainder)."""
    for i, batch in enumerate(batches):
        rows = _rows(batch)
        if rows == size:
            yield batch
        elif rows < size and next(batches, None) is None:
            return
        else:
            raise ValueError(
                f"Training input batch {i} has {rows} rows; expected the host batch size {size} "
                "(train_batch_size / process count). Only the last batch may be shorter, and it is dropped."
            )


def _rows(batch) -> int:
    leaves = jax.tree.leaves(batch[0])
    if not leaves:
        raise ValueError("Input batch has no feature arrays; expected features with one row per example.")
    return np.shape(leaves[0])[0]


class BatchChecker:
    """Checks that every batch matches the first: same features, shapes and numeric dtypes.

    The first batch is described in full; later ones are compared by a cheap
    signature and described only when it differs (this runs once per batch).
    """

    def __init__(self):
        self._signature = None
        self._expected = None
        self._count = 0

    def __call__(self, batch) -> Any:
        leaves, treedef = jax.tree.flatten(batch)
        leaves = [np.asarray(x) for x in leaves]
        signature = (treedef, tuple((x.shape[1:], x.dtype) for x in leaves), {x.shape[:1] for x in leaves})
        if signature != self._signature:
            batch = jax.tree.unflatten(treedef, leaves)
            found = _describe(batch)
            if self._expected is None:
                self._expected, self._signature = found, signature
            elif found != self._expected:
                raise ValueError(f"Input batch {self._count}: {_difference(self._expected, found)}")
        self._count += 1
        return jax.tree.unflatten(treedef, leaves)


def _describe(batch) -> dict[str, tuple]:
    described, rows = {}, None
    for part, tree in zip(("features", "labels"), batch, strict=True):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            name = part + jax.tree_util.keystr(path)
            if leaf.dtype.kind not in "biuf":
                raise ValueError(
                    f"Input {name} has dtype {leaf.dtype}; expected numbers (bool, int, float). "
                    "Fix: encode text or objects as numeric arrays before feeding them."
                )
            if leaf.ndim == 0:
                raise ValueError(f"Input {name} is a scalar; expected one row per example.")
            if rows is not None and leaf.shape[0] != rows:
                raise ValueError(
                    f"Input {name} has {leaf.shape[0]} rows; expected {rows} like the "
                    "other arrays of the batch (one row per example)."
                )
            rows = leaf.shape[0]
            described[name] = (leaf.shape[1:], leaf.dtype)
    return described


def _difference(expected: dict, found: dict) -> str:
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or extra:
        return (
            f"received arrays {sorted(found)}; expected {sorted(expected)} as in the first batch "
            f"(missing: {missing or 'none'}, unexpected: {extra or 'none'})."
        )
    name = next(k for k in expected if expected[k] != found[k])
    (shape, dtype), (want_shape, want_dtype) = found[name], expected[name]
    return (
        f"{name} has per-example shape {shape} and dtype {dtype}; expected {want_shape} {want_dtype} "
        "as in the first batch. Every batch must have the same shapes and dtypes."
    )


# -- host -> device -----------------------------------------------------------


def train_chunks(stacks: Iterator, mesh, global_batch_size: int) -> Iterator[DeviceChunk]:
    """Host stacks of training batches as global arrays on the mesh."""
    sharding = mesh_lib.batch_sharding(mesh, stacked=True)
    for stack in stacks:
        num_steps = jax.tree.leaves(stack)[0].shape[0]
        yield DeviceChunk(mesh_lib.to_global(stack, sharding, global_batch_size), num_steps)


def eval_device_batches(batches: Iterator, mesh, global_batch_size: int) -> Iterator[DeviceBatch]:
    """Global evaluation batches with a mask; the short last batch is padded with zeros."""
    check, sharding = BatchChecker(), mesh_lib.batch_sharding(mesh)
    host_size = global_batch_size // jax.process_count()
    for batch in batches:
        batch = check(batch)
        rows = _rows(batch)
        if rows > host_size:
            raise ValueError(
                f"Input batch has {rows} rows; expected at most the host batch size "
                f"{host_size} (eval/predict batch size / process count)."
            )
        padded = jax.tree.map(lambda x, n=host_size - rows: np.pad(x, [(0, n)] + [(0, 0)] * (x.ndim - 1)), batch)
        mask = np.arange(host_size) < rows
        on_mesh = mesh_lib.to_global((padded, mask), sharding, global_batch_size)
        yield DeviceBatch(on_mesh[0], on_mesh[1], rows, rows < host_size)


def _take(iterator: Iterator, n: int) -> list:
    out = []
    for item in iterator:
        out.append(item)
        if len(out) == n:
            break
    return out


class Prefetch:
    """Runs an iterator on a background thread, ``depth`` items ahead of the consumer.

    The next stack is built and transferred while the device runs the current
    loop. Errors raised by the producer are re-raised by ``next()``.
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

    def __next__(self):
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is self._DONE or isinstance(item, BaseException):
            self._done = True
        if isinstance(item, BaseException):
            raise item
        if item is self._DONE:
            raise StopIteration
        return item

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
