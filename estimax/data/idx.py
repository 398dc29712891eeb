"""MNIST-style idx files: ``*-images-idx3-ubyte[.gz]`` and ``*-labels-idx1-ubyte[.gz]``.

Both naming styles in circulation are found: ``train-images-idx3-ubyte`` (the
original files) and ``train-images.idx3-ubyte`` (a widely used copy), each
gzipped or not.

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
from estimax.errors import InputError, InputNotFoundError

IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049  # unsigned bytes, 3 and 1 dimensions


def read_idx(path: str | os.PathLike, magic: int) -> np.ndarray:
    """The uint8 array of an idx file whose magic number must be ``magic``."""
    (file,) = files_lib.expand(path)
    data = file.read()
    if len(data) < 4:
        raise InputError(f"{file.name}: {len(data)} bytes; expected an idx header of at least 4 bytes.")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise InputError(
            f"{file.name}: magic number {found}; expected {magic} "
            f"({'images, idx3' if magic == IMAGES_MAGIC else 'labels, idx1'}-ubyte)."
        )
    num_dims = magic & 0xFF
    header = 4 + 4 * num_dims
    if len(data) < header:
        raise InputError(f"{file.name}: {len(data)} bytes; expected a header of {header} bytes.")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(num_dims))
    expected = header + int(np.prod(shape))
    if len(data) != expected:
        raise InputError(
            f"{file.name}: {len(data)} bytes; expected {expected} (a {header}-byte header and "
            f"{' x '.join(map(str, shape))} values as the header says)."
        )
    return np.frombuffer(data, np.uint8, offset=header).reshape(shape)


def names(split: str, kind: str) -> list[str]:
    """The file names ``find`` accepts, in order of preference."""
    suffix = f"idx{3 if kind == 'images' else 1}-ubyte"
    return [f"{split}-{kind}{sep}{suffix}{gz}" for sep in ("-", ".") for gz in ("", ".gz")]


def find(data_dir: str | os.PathLike, split: str, kind: str) -> str:
    """``<data_dir>/<split>-<kind>-idx?-ubyte`` or ``<split>-<kind>.idx?-ubyte``, either one ``.gz`` or not."""
    base = os.fspath(data_dir).rstrip("/")
    present = files_lib.listing(base)
    for name in names(split, kind):
        if name in present:
            return f"{base}/{name}"
    shown = ", ".join(sorted(present)[:20]) + (f" and {len(present) - 20} more" if len(present) > 20 else "")
    raise InputNotFoundError(
        f"No MNIST {split} {kind} in {os.fspath(data_dir)!r}: looked for {', '.join(names(split, kind))}; "
        f"the directory holds {shown or 'no files'}. Fix: --data-dir the directory of the idx files."
    )


def mnist(
    data_dir: str | os.PathLike, split: str = "train", image_shape: tuple[int, int] | None = None
) -> ArrayDataset:
    """MNIST from its idx files: ``{"image": float32 (n, 28, 28) in [0, 1]}`` and int32 labels.

    ``split`` is the file prefix: ``"train"`` or ``"t10k"``. Any fsspec path works.
    ``image_shape``: the ``(height, width)`` the model is built for; files of
    other images are an ``InputError`` naming both (default: any size).
    """
    images_path, labels_path = find(data_dir, split, "images"), find(data_dir, split, "labels")
    images, labels = read_idx(images_path, IMAGES_MAGIC), read_idx(labels_path, LABELS_MAGIC)
    if image_shape is not None and images.shape[1:] != tuple(image_shape):
        raise InputError(
            f"{images_path}: images of {_size(images.shape[1:])}; expected {_size(image_shape)}, the size the model "
            f"is built for (image_shape={tuple(image_shape)}). Fix: use MNIST files of {_size(image_shape)} images, "
            f"or build the model for {_size(images.shape[1:])}."
        )
    if len(images) != len(labels):
        raise InputError(
            f"{labels_path}: {len(labels)} labels; expected {len(images)}, one per image of {images_path}."
        )
    return from_arrays({"image": images.astype(np.float32) / 255.0}, labels.astype(np.int32))


def _size(shape) -> str:
    return "x".join(map(str, shape))
