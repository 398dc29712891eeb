"""``estimax predict --input FILE``: a file of new examples as the input of ``predict``.

The format follows the extension: ``.npz`` (one array per feature, named like
the task's features), ``.npy`` (the one feature), ``.parquet``, ``.json``,
``.jsonl`` and ``.csv`` (one column per feature, through Hugging Face
``datasets``: ``pip install 'estimax[hf]'``; a CSV column holds one number per
example, so a feature with more per example needs another format). A file it
cannot read, one without examples and one of other than numbers are one line. The task's own predict input
gives the features' names, shapes and dtypes the file must have. Owns reading
the file into an input; does not own predicting (``commands.py``).
"""

from __future__ import annotations

import os
import zipfile
from typing import TYPE_CHECKING

from estimax import storage
from estimax.errors import ConfigError, InputError, MissingLibraryError, one_line

if TYPE_CHECKING:
    import numpy as np

ARRAY_FORMATS = (".npz", ".npy")
TABLE_FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
FORMATS = (*ARRAY_FORMATS, *TABLE_FORMATS)


def check(path: str) -> None:
    """A ``ConfigError`` for a file of no known format, or a local file that is not there (no import)."""
    extension = os.path.splitext(path)[1].lower()
    if extension not in FORMATS:
        raise ConfigError(
            f"--input {path}: no reader for {extension or 'a file without an extension'!r}; expected one of "
            f"{', '.join(FORMATS)}. Fix: write the examples as .npz (numpy.savez(FILE, name=array, ...)) or Parquet."
        )
    if not storage.is_url(path) and not os.path.isfile(storage.expand(path)):
        raise ConfigError(f"--input {path}: no such file; expected a file of examples to predict.")


def read(path: str, like):
    """The examples of ``path`` as an input whose features match ``like`` (one example's features
    from the task's predict input: an array or a dict of arrays)."""
    from estimax import data

    check(path)
    extension = os.path.splitext(path)[1].lower()
    names = sorted(like) if isinstance(like, dict) else None
    if extension in TABLE_FORMATS:
        dataset = _table(path, TABLE_FORMATS[extension])
        _check_rows(path, dataset.num_rows)
        if extension == ".csv":
            _check_scalars(path, like)
        columns = names or dataset.column_names
        missing = sorted(set(columns) - set(dataset.column_names))
        if missing or (names is None and len(columns) != 1):
            raise InputError(
                f"--input {path}: its columns are {dataset.column_names}; expected "
                + (f"the task's features {names}" if names else "one column, the task's features")
                + ". Fix: name the columns like the features."
            )
        return data.from_hf(dataset, features=names if names else columns[0])
    arrays = _arrays(path, extension)
    for name, array in arrays.items():
        _check_numbers(path, name or "its array", array)
        _check_rows(path, len(array) if array.ndim else 0)
    if names is None:
        if len(arrays) != 1:
            raise InputError(
                f"--input {path}: holds the arrays {sorted(arrays)}; expected one, the task's features. "
                "Fix: save only the features."
            )
        return data.from_arrays(_fit(path, next(iter(arrays.values())), like, "the features"))
    if extension == ".npy" and len(names) == 1:
        arrays = {names[0]: arrays[""]}
    if sorted(arrays) != names:
        raise InputError(
            f"--input {path}: holds the arrays {sorted(arrays)}; expected the task's features {names}. "
            f"Fix: numpy.savez(FILE, {', '.join(f'{n}=...' for n in names)})."
        )
    return data.from_arrays({name: _fit(path, arrays[name], like[name], name) for name in names})


def _arrays(path: str, extension: str) -> dict:
    """The arrays of a ``.npz`` by name, or a ``.npy``'s array under ``""``."""
    import numpy as np

    fs, inner = storage.filesystem(storage.expand(path))
    try:
        if extension == ".npy" and not storage.is_url(path):  # mapped: memory does not grow with the file
            return {"": np.load(storage.expand(path), mmap_mode="r")}
        with fs.open(inner, "rb") as file:
            loaded = np.load(file)
            return dict(loaded) if extension == ".npz" else {"": loaded}
    except (EOFError, ValueError, OSError, zipfile.BadZipFile) as error:
        raise InputError(
            f"--input {path}: not a readable {extension} file ({type(error).__name__}: {error}); expected one that "
            f"numpy.{'savez' if extension == '.npz' else 'save'} wrote. Fix: write it again."
        ) from None


def _check_rows(path: str, rows: int) -> None:
    if rows == 0:
        raise InputError(f"--input {path}: holds no examples; expected at least one. Fix: pass a file of examples.")


def _check_numbers(path: str, name: str, array: np.ndarray) -> None:
    import numpy as np

    if not (array.dtype == bool or np.issubdtype(array.dtype, np.number)):
        raise InputError(
            f"--input {path}: {name} has dtype {array.dtype}; expected numbers, like the task's features. "
            "Fix: encode the examples as numbers before saving them."
        )


def _check_scalars(path: str, like) -> None:
    """A CSV column holds one number per example: a feature with more per example needs another format."""
    import numpy as np

    features = like if isinstance(like, dict) else {"the features": like}
    vectors = {name: np.shape(x)[1:] for name, x in features.items() if np.ndim(x) > 1}
    if vectors:
        shapes = ", ".join(f"{name} {shape}" for name, shape in sorted(vectors.items()))
        raise InputError(
            f"--input {path}: a CSV column holds one number per example, and the task's features hold more "
            f"({shapes} per example); expected a format that holds arrays. Fix: write them as .npz, .parquet or "
            ".jsonl (a list per example)."
        )


def _fit(path: str, array: np.ndarray, example, name: str) -> np.ndarray:
    """``array`` (one row per example) in the dtype of the task's ``example``, whose shape it must have."""
    import numpy as np

    example = np.asarray(example)
    if array.shape[1:] != example.shape[1:]:
        raise InputError(
            f"--input {path}: {name} has rows of shape {array.shape[1:]}; expected {example.shape[1:]} "
            "(the task's predict input). Fix: reshape the examples."
        )
    return array.astype(example.dtype, copy=False)


def _table(path: str, kind: str):
    try:
        import datasets
    except ImportError:
        raise MissingLibraryError(
            f"--input {path}: reading {kind} needs Hugging Face datasets, which is not installed. "
            "Fix: pip install 'estimax[hf]', or write the examples as .npz."
        ) from None
    reader = {"parquet": datasets.Dataset.from_parquet, "json": datasets.Dataset.from_json}.get(
        kind, datasets.Dataset.from_csv
    )
    datasets.disable_progress_bars()  # the command says how many examples it predicted
    try:
        return reader(storage.expand(path))
    except Exception as error:  # noqa: BLE001 - datasets' and its readers' own kinds, for a file it cannot read
        cause = error.__cause__ or error
        raise InputError(
            f"--input {path}: not a readable {kind} file ({one_line(cause)}); "
            f"expected one example per {'line' if kind == 'json' else 'row'} with a column per feature. "
            "Fix: correct the file, or write the examples as .npz."
        ) from None
