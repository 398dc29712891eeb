"""MNIST-style idx files: ``*-images-idx3-ubyte[.gz]`` and ``*-labels-idx1-ubyte[.gz]``.

Owns reading and validating idx files (magic number, dimensions against the
file length, equal image and label counts) into arrays, and the ``mnist``
source built on ``from_arrays``. Errors name the file, the value found and
the value expected.
"""

from __future__ import annotations

import os

import numpy as np

from estimax.data import files as files_lib
from estimax.data.arrays import ArrayDataset, from_arrays

IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049  # unsigned bytes, 3 and 1 dimensions


def read_idx(path: str | os.PathLike, magic: int) -> np.ndarray:
    """The uint8 array of an idx file whose magic number must be ``magic``."""
    (file,) = files_lib.expand(path)
    with file.open() as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"{file.name}: {len(data)} bytes; expected an idx header of at least 4 bytes.")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise ValueError(
            f"{file.name}: magic number {found}; expected {magic} "
            f"({'images, idx3' if magic == IMAGES_MAGIC else 'labels, idx1'}-ubyte)."
        )
    num_dims = magic & 0xFF
    header = 4 + 4 * num_dims
    if len(data) < header:
        raise ValueError(f"{file.name}: {len(data)} bytes; expected a header of {header} bytes.")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(num_dims))
    expected = header + int(np.prod(shape))
    if len(data) != expected:
        raise ValueError(
            f"{file.name}: {len(data)} bytes; expected {expected} (a {header}-byte header and "
            f"{' x '.join(map(str, shape))} values as the header says)."
        )
    return np.frombuffer(data, np.uint8, offset=header).reshape(shape)


def find(data_dir: str | os.PathLike, split: str, kind: str) -> str:
    """``<data_dir>/<split>-<kind>-idx?-ubyte`` or the same ``.gz``."""
    name = f"{split}-{kind}-idx{3 if kind == 'images' else 1}-ubyte"
    base = os.fspath(data_dir).rstrip("/")
    for candidate in (f"{base}/{name}", f"{base}/{name}.gz"):
        try:
            return files_lib.expand(candidate)[0].name
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"No {name} or {name}.gz in {os.fspath(data_dir)!r}; expected the MNIST idx files there.")


def mnist(data_dir: str | os.PathLike, split: str = "train") -> ArrayDataset:
    """MNIST from its idx files: ``{"image": float32 (n, 28, 28) in [0, 1]}`` and int32 labels.

    ``split`` is the file prefix: ``"train"`` or ``"t10k"``. Any fsspec path works.
    """
    images_path, labels_path = find(data_dir, split, "images"), find(data_dir, split, "labels")
    images, labels = read_idx(images_path, IMAGES_MAGIC), read_idx(labels_path, LABELS_MAGIC)
    if len(images) != len(labels):
        raise ValueError(
            f"{labels_path}: {len(labels)} labels; expected {len(images)}, one per image of {images_path}."
        )
    return from_arrays({"image": images.astype(np.float32) / 255.0}, labels.astype(np.int32))
