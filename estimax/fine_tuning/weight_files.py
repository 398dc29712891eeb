"""Weight files written by other libraries, read as arrays by name.

Owns recognising a weights file or directory (by its name, then its first bytes) and reading it
with its own library: safetensors (Hugging Face; a file, or a directory of shards), a Keras 3
``.weights.h5`` file (h5py), a Flax msgpack file (``flax.serialization``), another project's Orbax
PyTree checkpoint (a checkpoint directory, or a CheckpointManager's directory or step), a ``.npz``
file and a directory of ``.npy`` files. Shapes and dtypes are known when a file is opened; values
are read only for the names asked (safetensors and HDF5 lazily, from the file).

Names are the file's own: safetensors keys as written (``encoder.layer.0.attention.self.query.weight``);
``/``-joined tree paths for msgpack and Orbax (``params/Dense_0/kernel``); for Keras, the layer names
from the model down and the variable's index in its layer (``dense_1/0`` for a Dense layer's kernel,
``dense_1/1`` for its bias), as the file keeps no variable names. Does not own estimax's own
checkpoints (``checkpoint.py``) nor which parameter takes which array (``run/warm_start.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import os
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from estimax import storage
from estimax.errors import CheckpointError, MissingLibraryError


class ArraySpec(NamedTuple):
    """The shape and dtype of one array of a file."""

    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class WeightFile:
    """The arrays of one weights file or directory: ``specs`` by name, values by ``read(names)``."""

    path: str
    format: str
    specs: Mapping[str, ArraySpec]
    reader: Callable[[list[str]], dict[str, np.ndarray]]

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """The arrays named (names of ``specs``), read from the file."""
        return self.reader(list(names)) if names else {}


FORMATS = "a .safetensors, .weights.h5 or .keras (Keras 3), .msgpack (Flax) or .npz file"
"""What a weights file may be, as errors name it."""

_SUFFIXES = {".safetensors": "safetensors", ".h5": "keras", ".hdf5": "keras", ".keras": "keras archive"}
_SUFFIXES |= {".msgpack": "msgpack", ".npz": "npz"}
_KERAS_WEIGHTS = "model.weights.h5"  # the weights inside a .keras archive (a zip)
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # PyTorch's and others' pickles: loading one runs code
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_ZIP_MAGIC = b"PK\x03\x04"
_ORBAX_TREE = "_METADATA"  # what an Orbax PyTree checkpoint directory holds beside its arrays
_ESTIMAX_ITEMS = {"state", "meta"}  # the items of an estimax checkpoint step


def open_weights(path: str) -> WeightFile | None:
    """``path`` (resolved) opened by its format's reader; ``None`` for a directory that is no weights
    directory (an estimax run's, which ``checkpoint.py`` reads). An unknown file is a ``CheckpointError``."""
    if storage.isdir(path):
        return _open_directory(path)
    if not storage.exists(path):
        return None
    name = storage.name(path).lower()
    if name.endswith(_PICKLES):
        raise _pickle(path)
    suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
    kind = _SUFFIXES[suffix] if suffix else _sniff(path)
    readers = {"safetensors": _safetensors, "keras": _keras_h5, "keras archive": _keras_archive}
    return (readers | {"msgpack": _msgpack, "npz": _npz})[kind](path)


def _pickle(path: str) -> CheckpointError:
    return CheckpointError(
        f"WarmStart: {path} is a pickle (PyTorch's torch.save writes them); estimax does not unpickle, "
        f"as loading one runs code. Expected {FORMATS}. Fix: save the weights as safetensors, e.g. "
        "safetensors.torch.save_file(model.state_dict(), 'model.safetensors')."
    )


def _sniff(path: str) -> str:
    """The format of a file without a known suffix, from its first bytes."""
    with _opened(path) as f:
        head = f.read(16)
    if head.startswith(_HDF5_MAGIC):
        return "keras"
    if head.startswith(_ZIP_MAGIC):
        with _opened(path) as f, zipfile.ZipFile(f) as archive:
            return "keras archive" if _KERAS_WEIGHTS in archive.namelist() else "npz"
    if len(head) > 8 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") > 0:
        return "safetensors"  # an 8-byte header length, then the JSON header
    if head[:1] and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF)):
        return "msgpack"  # a msgpack map: Flax writes a state dict
    raise CheckpointError(
        f"WarmStart: {path} is a file of an unknown format (it starts with {head[:8]!r}). Expected {FORMATS}, "
        "a directory of .npy or .safetensors files, an Orbax checkpoint directory, or an estimax run's "
        "model_dir. Fix: name the file with its format's suffix, or convert it to safetensors."
    )


def _opened(path: str):
    if storage.is_url(path):
        fs, inner = storage.filesystem(path)
        return fs.open(inner, "rb")
    return open(path, "rb")


def _local_or_bytes(path: str):
    """A local path as it is; a URL's content as a file object (the readers take either)."""
    return io.BytesIO(storage.read_bytes(path)) if storage.is_url(path) else path


def _library(module: str, what: str, path: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingLibraryError(
            f"WarmStart({path!r}) reads {what} with {module.split('.')[0]}, which is not installed. "
            "Fix: pip install 'estimax[weights]'."
        ) from None


def _spec(array) -> ArraySpec:
    return ArraySpec(tuple(int(d) for d in np.shape(array)), np.dtype(array.dtype))


def from_arrays(path: str, format_: str, arrays: Mapping[str, np.ndarray]) -> WeightFile:
    """A ``WeightFile`` of arrays already in memory."""
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    return WeightFile(
        path, format_, {k: _spec(v) for k, v in arrays.items()}, lambda names: {n: arrays[n] for n in names}
    )


# safetensors


def _safetensors(path: str) -> WeightFile:
    return _safetensors_shards(path, [path])


def _safetensors_shards(path: str, files: list[str]) -> WeightFile:
    """One file, or the shards of a directory (``model-00001-of-00002.safetensors``, ...), as one."""
    safetensors = _library("safetensors", "safetensors files", path)
    if any(storage.is_url(f) for f in files):
        numpy_api = _library("safetensors.numpy", "safetensors files", path)
        arrays = {}
        for f in files:
            arrays.update(numpy_api.load(storage.read_bytes(f)))
        return from_arrays(path, "safetensors", arrays)
    specs, where = {}, {}
    for f in files:
        with safetensors.safe_open(f, framework="np") as opened:
            for key in opened.keys():
                piece = opened.get_slice(key)
                specs[key] = ArraySpec(tuple(piece.get_shape()), _safetensors_dtype(piece.get_dtype()))
                where[key] = f

    def read(names):
        out = {}
        for f in sorted({where[n] for n in names}):
            with safetensors.safe_open(f, framework="np") as opened:
                out.update({n: opened.get_tensor(n) for n in names if where[n] == f})
        return out

    return WeightFile(path, "safetensors", specs, read)


def _safetensors_dtype(code: str) -> np.dtype:
    """numpy's dtype of a safetensors dtype code (``F32``, ``BF16``, ``I64``, ``F8_E4M3``, ...)."""
    import ml_dtypes

    special = {"BOOL": np.bool_, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}
    special["F8_E5M2"] = ml_dtypes.float8_e5m2
    if code in special:
        return np.dtype(special[code])
    return np.dtype({"F": "f", "I": "i", "U": "u", "C": "c"}[code[0]] + str(int(code[1:]) // 8))


# Keras 3 .weights.h5


def _keras_h5(path: str) -> WeightFile:
    return _keras_weights(path, "keras .weights.h5", lambda: _local_or_bytes(path))


def _keras_archive(path: str) -> WeightFile:
    """A ``.keras`` file (``model.save``): a zip holding the weights as ``model.weights.h5``."""
    with _opened(path) as f, zipfile.ZipFile(f) as archive:
        if _KERAS_WEIGHTS not in archive.namelist():
            raise CheckpointError(
                f"WarmStart: {path} is a zip without {_KERAS_WEIGHTS}; expected a .keras file that Keras 3's "
                "model.save wrote. Fix: model.save('model.keras'), or model.save_weights('model.weights.h5')."
            )
        weights = archive.read(_KERAS_WEIGHTS)
    return _keras_weights(path, "keras archive", lambda: io.BytesIO(weights))


def _keras_weights(path: str, format_: str, source: Callable) -> WeightFile:
    """Keras 3 writes each layer's variables as datasets ``<attribute path>/vars/<index>`` whose
    ``vars`` group carries the layer's ``name``; the arrays are named by those names from the
    model down, then the index (a file of another layout: each dataset by its own HDF5 path).
    ``source()``: what ``h5py.File`` opens (a path or a file object)."""
    h5py = _library("h5py", "HDF5 files", path)
    with h5py.File(source(), "r") as f:
        found = []
        f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
        specs_by_path = {p: ArraySpec(tuple(f[p].shape), _h5_dtype(f[p])) for p in found}
        names = {p: _keras_name(f, p) for p in found}
    if len(set(names.values())) < len(names):  # one name in two places: the HDF5 paths, which are unique
        names = {p: p for p in found}
    paths = {name: p for p, name in names.items()}

    def read(wanted):
        with h5py.File(source(), "r") as f:
            return {n: _h5_array(f[paths[n]]) for n in wanted}

    return WeightFile(path, format_, {names[p]: spec for p, spec in specs_by_path.items()}, read)


def _keras_name(f, h5_path: str) -> str:
    """``body/0`` of ``layers/dense/vars/0`` whose ``vars`` group is named ``body``: the name of every
    layer group above the dataset (the model's own, at the root, left out), then the index."""
    parts = h5_path.split("/")
    if len(parts) < 3 or parts[-2] != "vars" or not parts[-1].isdigit():
        return h5_path
    layers = []
    for depth in range(1, len(parts) - 1):
        group = "/".join(parts[:depth])
        own = f.get(group + "/vars")
        if own is not None:
            layers.append(str(own.attrs.get("name", parts[depth - 1])))
    return "/".join([*layers, parts[-1]])


def _h5_dtype(dataset) -> np.dtype:
    if dataset.attrs.get("dtype") == "bfloat16":  # Keras stores bfloat16 as 2 opaque bytes and says so
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dataset.dtype)


def _h5_array(dataset) -> np.ndarray:
    array = np.asarray(dataset[()])
    return array.view(_h5_dtype(dataset)) if array.dtype.kind == "V" else array


# Flax msgpack and .npz


def _msgpack(path: str) -> WeightFile:
    from flax import serialization

    tree = serialization.msgpack_restore(storage.read_bytes(path))
    return from_arrays(path, "flax msgpack", _flat(tree))


def _flat(tree) -> dict[str, np.ndarray]:
    """``{a/b/c: array}`` of the numeric leaves of a nested dict (and list) state."""
    arrays = {name: np.asarray(leaf) for name, leaf in _leaves(tree).items()}
    return {name: a for name, a in arrays.items() if a.dtype.kind in "biufcV"}  # bfloat16 is of kind V


def _leaves(tree, prefix: str = "") -> dict:
    """``{a/b/c: leaf}`` of a nested dict (and list) tree; an NNX variable's ``/value`` left out, as
    estimax names parameters."""
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree) if isinstance(tree, list | tuple) else None
    if items is None:
        return {prefix.removesuffix("/value"): tree}
    out = {}
    for key, value in items:
        out.update(_leaves(value, f"{prefix}/{key}" if prefix else str(key)))
    return out


def _npz(path: str) -> WeightFile:
    with np.load(_local_or_bytes(path), allow_pickle=False) as arrays:
        return from_arrays(path, "npz", {k.removesuffix("/value"): arrays[k] for k in arrays.files})


# Directories


def _open_directory(path: str) -> WeightFile | None:
    names = storage.listdir(path)
    if _ORBAX_TREE in names:
        return _orbax(path)
    shards = [storage.join(path, n) for n in names if n.endswith(".safetensors")]
    if shards:
        return _safetensors_shards(path, shards)
    if "checkpoints" in names:
        return None  # an estimax model_dir
    pickles = [n for n in names if n.lower().endswith(_PICKLES)]
    if pickles and not any(n.isdigit() for n in names):
        raise _pickle(storage.join(path, pickles[0]))  # e.g. a model directory with pytorch_model.bin only
    if not storage.is_url(path) and any(f.endswith(".npy") for _, _, files in os.walk(path) for f in files):
        return _npy_directory(path)
    step = _orbax_step(path, names)
    return _orbax_item(step) if step else None


def _npy_directory(path: str) -> WeightFile:
    arrays = {}
    for root, _, files in os.walk(path):
        for f in files:
            if f.endswith(".npy"):
                name = os.path.relpath(os.path.join(root, f), path)[: -len(".npy")].replace(os.sep, "/")
                arrays[name] = np.load(os.path.join(root, f), allow_pickle=False, mmap_mode="r")
    return WeightFile(
        path,
        "npy directory",
        {k: _spec(v) for k, v in arrays.items()},
        lambda names: {n: np.asarray(arrays[n]) for n in names},
    )


def _orbax_step(path: str, names: list[str]) -> str | None:
    """The step directory of another project's CheckpointManager at ``path`` (its directory: the
    latest step; or one step), or ``None`` when it is none, or estimax's own."""
    steps = sorted((int(n) for n in names if n.isdigit()), reverse=True)
    if steps:
        path, names = storage.join(path, str(steps[0])), storage.listdir(storage.join(path, str(steps[0])))
    items = [n for n in names if _ORBAX_TREE in storage.listdir(storage.join(path, n))]
    if not items or _ESTIMAX_ITEMS <= set(names):
        return None
    return path


def _orbax_item(step: str) -> WeightFile:
    items = [n for n in storage.listdir(step) if _ORBAX_TREE in storage.listdir(storage.join(step, n))]
    if len(items) > 1:
        raise CheckpointError(
            f"WarmStart: the Orbax checkpoint step {step} holds {len(items)} items ({', '.join(items)}); "
            f"expected one. Fix: name the item's directory, e.g. WarmStart({storage.join(step, items[0])!r})."
        )
    return _orbax(storage.join(step, items[0]))


def _orbax(path: str) -> WeightFile:
    """A PyTree checkpoint restored as numpy arrays from its own metadata (no target structure)."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    handler, directory = ocp.PyTreeCheckpointHandler(), epath.Path(path)
    metadata = handler.metadata(directory)
    tree = getattr(metadata, "tree", metadata)
    specs = {
        name: ArraySpec(tuple(leaf.shape), np.dtype(leaf.dtype))
        for name, leaf in _leaves(tree).items()
        if _restore_type(leaf) is np.ndarray
    }
    restored: dict[str, np.ndarray] = {}

    def read(names):
        if not restored:  # once, whole: Orbax restores a tree
            args = jax.tree.map(lambda leaf: ocp.RestoreArgs(restore_type=_restore_type(leaf)), tree)
            restored.update(_flat(handler.restore(directory, args=ocp.args.PyTreeRestore(restore_args=args))))
        return {n: restored[n] for n in names}

    return WeightFile(path, "orbax", specs, read)


def _restore_type(leaf) -> type | None:
    """numpy for an array's or a number's metadata; ``None`` (Orbax's own choice) for another leaf."""
    numeric = getattr(leaf, "shape", None) is not None and getattr(leaf, "dtype", None) is not None
    return np.ndarray if numeric else None
