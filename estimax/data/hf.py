"""Hugging Face ``datasets`` as inputs: a map-style ``Dataset`` or a streaming ``IterableDataset``.

Owns choosing the columns that make an example's features and labels,
reading rows as numpy (``with_format("numpy")``), the map-style dataset as a
Grain random-access source (then ``from_grain`` owns shards, epochs and
shuffling), and the streaming one as a Grain ``IterDataset`` whose position
is the dataset's own ``state_dict()``: split per process (and per Grain
worker) by ``datasets.distributed.split_dataset_by_node``. ``datasets`` is an
optional dependency (``estimax[hf]``), imported only here and only when
called. Does not own tokenizing or padding: ``dataset.map`` does that.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import grain

from estimax.data.grain import IterSource, MapSource, from_grain
from estimax.errors import ConfigError, InputError, InputKindError, MissingLibraryError

Columns = str | Sequence[str] | None


def _datasets():
    try:
        import datasets
    except ImportError:
        raise MissingLibraryError(
            "from_hf needs the Hugging Face datasets library, which is not installed. Fix: pip install 'estimax[hf]'."
        ) from None
    return datasets


class Example:
    """A row ``{column: value}`` as ``(features, labels)``: features a dict of the feature columns;
    labels the label column's value, a dict of several label columns, or ``None``."""

    def __init__(self, features: list[str], label: Columns):
        self.features, self.label = features, label
        self.columns = features + _names(label)  # every column an example reads

    def __call__(self, row: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        missing = [c for c in self.columns if c not in row]
        if missing:
            raise InputError(
                f"from_hf: a row has no column {missing[0]!r}; expected the columns {self.columns} "
                f"(the row has {sorted(row)}). Fix: name columns every row has."
            )
        features = {c: row[c] for c in self.features}
        if self.label is None:
            return features, None
        if isinstance(self.label, str):
            return features, row[self.label]
        return features, {c: row[c] for c in self.label}


def _names(columns: Columns) -> list[str]:
    if columns is None:
        return []
    return [columns] if isinstance(columns, str) else list(columns)


def _example(dataset, features: Columns, label: Columns) -> Example:
    """The columns of the examples, checked against the dataset's (when it knows them)."""
    present = dataset.column_names  # None for a stream whose features are not declared
    labels = _names(label)
    if features is None:
        if present is None:
            raise ConfigError(
                "from_hf(features=None) on a dataset whose columns are unknown (a stream without declared "
                "features); expected the feature columns. Fix: from_hf(dataset, features=['x', ...], label=...)."
            )
        chosen = [c for c in present if c not in labels]
    else:
        chosen = _names(features)
    if not chosen:
        raise ConfigError(
            f"from_hf(features={features!r}) selects no column; expected at least one feature column "
            f"(the dataset has {present})."
        )
    for argument, names in (("features", chosen), ("label", labels)):
        missing = [c for c in names if present is not None and c not in present]
        if missing:
            raise ConfigError(
                f"from_hf({argument}={features if argument == 'features' else label!r}): the dataset has no "
                f"column {missing[0]!r}; its columns are {present}. Fix: name one of them, or add it with "
                "dataset.map(...)."
            )
    return Example(chosen, label)


class Rows:
    """The rows of a map-style ``datasets.Dataset`` as examples: a Grain ``RandomAccessDataSource``."""

    def __init__(self, dataset, example: Example):
        self._dataset = dataset.select_columns(example.columns).with_format("numpy")
        self._example = example

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int):
        return self._example(self._dataset[int(index)])


def _copy(dataset):
    """A copy of a stream, for one iterator: the position lives in the dataset object.

    Not its Hub filesystem cache, which every dataset of the process shares
    and other threads write to (Grain makes its workers' iterators on
    several threads); the copy refers to that cache again when it is built.
    """
    from huggingface_hub import HfFileSystem

    return copy.deepcopy(dataset, {id(HfFileSystem._cache): HfFileSystem._cache})


class Stream(grain.IterDataset):
    """A streaming ``datasets.IterableDataset`` as a Grain ``IterDataset`` of examples.

    Grain worker processes each read a slice of it (``set_slice``: another
    ``split_dataset_by_node`` on top of the process's).
    """

    def __init__(self, dataset, example: Example):
        super().__init__()
        self._dataset, self._example = dataset, example

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        del sequential_slice  # the dataset decides: whole files where they divide evenly, else rows
        from datasets.distributed import split_dataset_by_node

        self._dataset = split_dataset_by_node(self._dataset, rank=sl.start or 0, world_size=sl.step or 1)

    def __iter__(self) -> StreamIterator:
        return StreamIterator(_copy(self._dataset).with_format("numpy"), self._example)

    def __str__(self) -> str:
        return f"Stream({self._dataset})"


class StreamIterator(grain.DatasetIterator):
    """Rows of the stream in order; its state is the dataset's ``state_dict()`` (a JSON-able dict)."""

    def __init__(self, dataset, example: Example):
        super().__init__()
        self._dataset, self._example = dataset, example
        self._rows: Any = None  # the pass over the dataset, once started

    def __next__(self):
        if self._rows is None:
            self._rows = iter(self._dataset)
        return self._example(next(self._rows))

    def get_state(self) -> dict[str, Any]:
        return self._dataset.state_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        self._dataset.load_state_dict(state)
        self._close_rows()  # the next row comes from a fresh pass that starts at ``state``

    def close(self) -> None:
        self._close_rows()
        super().close()

    def _close_rows(self) -> None:
        if self._rows is not None:  # closes the dataset's open files now, not at interpreter exit
            self._rows.close()
            self._rows = None


def from_hf(
    dataset,
    features: Columns = None,
    *,
    label: Columns = None,
    num_workers: int = 0,
    read_options: grain.ReadOptions | None = None,
) -> MapSource | IterSource:
    """An input from a Hugging Face dataset (``pip install 'estimax[hf]'``).

    Values come as numpy (``with_format("numpy")``); text must be tokenized
    first (``dataset.map``), and variable-length columns padded.

    - a ``datasets.Dataset`` (map-style): random access, exactly like a Grain
      ``MapDataset``: process ``i`` of ``n`` reads rows ``i::n``, training
      reshuffles each epoch from the run's seed and resumes from the step,
      ``train(epochs=...)`` works.
    - a ``datasets.IterableDataset`` (streaming, ``load_dataset(...,
      streaming=True)``): each process reads its part
      (``split_dataset_by_node``: whole files when they divide evenly, else
      every ``n``-th row), in the dataset's order; its position
      (``state_dict()``) is saved with each checkpoint, so a resumed run
      continues with the row after the last one trained on.

    Args:
        dataset: a ``datasets.Dataset`` or ``datasets.IterableDataset``, as above.
        features: the column, or list of columns, of the features (a dict by
            column name); by default every column but the labels.
        label: the label column (or a list of them: a dict), or ``None`` for prediction.
        num_workers: above 0, reads in Grain worker processes (for a stream, each
            worker reads a part of the process's).
        read_options: Grain's read threads (map-style).
    """
    datasets = _datasets()
    if isinstance(dataset, datasets.DatasetDict | datasets.IterableDatasetDict):
        splits = list(dataset)
        raise ConfigError(
            f"from_hf received a {type(dataset).__name__} of the splits {splits}; expected one split. "
            f"Fix: from_hf(dataset[{splits[0]!r}], ...)."
        )
    if isinstance(dataset, datasets.Dataset):
        rows = Rows(dataset, _example(dataset, features, label))
        return from_grain(grain.MapDataset.source(rows), num_workers=num_workers, read_options=read_options)
    if isinstance(dataset, datasets.IterableDataset):
        example = _example(dataset, features, label)

        def shard(process_index: int, process_count: int) -> grain.IterDataset:
            from datasets.distributed import split_dataset_by_node

            mine = dataset
            if process_count > 1:
                mine = split_dataset_by_node(dataset, rank=process_index, world_size=process_count)
            return Stream(mine, example)

        return IterSource(shard, num_workers=num_workers, kind="a streaming Hugging Face dataset (from_hf)")
    raise InputKindError(
        f"from_hf received {type(dataset).__name__}; expected a datasets.Dataset or datasets.IterableDataset "
        "(e.g. datasets.load_dataset('parquet', data_files=..., split='train'))."
    )
