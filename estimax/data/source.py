"""The input contract: what ``from_arrays``, ``from_grain``, the file and Hugging Face sources are.

A ``Source`` delivers training stacks and evaluation batches itself (it can
seek, shard per process and resume); a ``SizedSource`` also knows its length,
so epochs can be counted and evaluation padded to the same number of batches
on every process. Anything else that is iterable is a plain iterable of
``(features, labels)`` host batches, checked and stacked by ``feed.py``.
Owns the declaration and ``ChunkSizes``, the steps of each device loop a source is
asked for; each source implements it, and ``feed.py`` uses it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable


class ChunkSizes(Sequence[int]):
    """The steps of each device loop from step ``start`` to ``target``: ``per_loop`` each, the last
    one what is left. Computed when read: a run to a distant ``max_steps`` (one that trains until it
    is stopped) holds no list of its loops. ``steps`` is their sum."""

    def __init__(self, start: int, target: int, per_loop: int):
        self._starts, self._target, self._per_loop = range(start, target, per_loop), target, per_loop
        self.steps = max(0, target - start)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return min(self._per_loop, self._target - self._starts[index])

    def __repr__(self) -> str:
        return f"ChunkSizes({self._starts.start}, {self._target}, {self._per_loop})"


def total_steps(chunk_sizes: Sequence[int]) -> int:
    """The steps of all the loops ``chunk_sizes`` names."""
    return chunk_sizes.steps if isinstance(chunk_sizes, ChunkSizes) else sum(chunk_sizes)


@runtime_checkable
class Source(Protocol):
    """An input that stacks, shards and resumes itself."""

    def train_stacks(
        self,
        host_batch_size: int,
        chunk_sizes: Sequence[int],
        *,
        seed: int,
        start_step: int,
        process_index: int,
        process_count: int,
    ) -> Iterator[Any]:
        """One stack of ``chunk_sizes[i]`` host batches per device loop, from ``start_step``. A streaming
        source may also take ``input_state=``, the position a checkpoint saved."""
        ...

    def eval_batches(self, host_batch_size: int, *, process_index: int, process_count: int) -> Iterator[Any]:
        """Every example of this process's shard once, in host batches (the last ones short or empty)."""
        ...


@runtime_checkable
class SizedSource(Source, Protocol):
    """A ``Source`` of known length: epochs can be counted."""

    def __len__(self) -> int: ...

    def steps_per_epoch(self, host_batch_size: int, process_count: int = 1) -> int:
        """Full global batches per epoch (the rest of an epoch is dropped)."""
        ...
