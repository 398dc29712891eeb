"""Input checks: every batch like the first, every example of a batch like the first.

Owns the error messages for bad input (a missing or unexpected array, another
shape or dtype, non-numeric data, rows that disagree) and the checked stacking
of examples into a batch used by the Grain sources. Raises before or at the
first step; touches nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from estimax.errors import InputError, InputKindError


class BatchChecker:
    """Checks that every batch matches the first: same features, shapes and numeric dtypes.

    The first batch is described in full; a later one costs a comparison of its
    tree structure and of each array's shape and dtype with the batch before it,
    and is described only when those differ (this runs once per batch).
    """

    def __init__(self):
        self._signature = None
        self._expected = None
        self._count = 0
        self._last = None  # (treedef, ((shape, dtype), ...)) of the previous batch, rows included

    def __call__(self, batch) -> Any:
        leaves, treedef = self.flatten(batch)
        return jax.tree.unflatten(treedef, leaves)

    def flatten(self, batch) -> tuple[list[np.ndarray], Any]:
        """``(leaves, treedef)`` of a checked batch, as numpy arrays."""
        leaves, treedef = jax.tree.flatten(batch)
        if self._last is not None and self._last[0] == treedef and _same_arrays(leaves, self._last[1]):
            self._count += 1
            return leaves, treedef
        leaves = [np.asarray(x) for x in leaves]
        signature = (treedef, tuple((x.shape[1:], x.dtype) for x in leaves), {x.shape[:1] for x in leaves})
        if signature != self._signature:
            found = describe(jax.tree.unflatten(treedef, leaves))
            if self._expected is None:
                self._expected, self._signature = found, signature
            elif found != self._expected:
                raise InputError(f"Input batch {self._count}: {difference(self._expected, found, 'the first batch')}")
        self._last = (treedef, tuple((x.shape, x.dtype) for x in leaves))
        self._count += 1
        return leaves, treedef


def _same_arrays(leaves: list, signature: tuple) -> bool:
    """Whether ``leaves`` are numpy arrays of exactly these shapes and dtypes."""
    return len(leaves) == len(signature) and all(
        type(x) is np.ndarray and x.shape == shape and x.dtype == dtype
        for x, (shape, dtype) in zip(leaves, signature, strict=True)
    )


# Datasets of other libraries, recognised by the module of their class (never imported here).
_FOREIGN = {
    "torch": (
        "a PyTorch {name}",
        "iterate it as numpy, e.g. `((x.numpy(), y.numpy()) for x, y in loader)` (a plain iterable of "
        "(features, labels) batches), or better ex.data.from_arrays(features, labels) on its arrays",
    ),
    "tensorflow": (
        "a TensorFlow {name}",
        "pass `dataset.as_numpy_iterator()` of (features, labels) batches, or read TFRecord files "
        "directly with ex.data.tfrecord(...)",
    ),
    "datasets": (
        "a Hugging Face {name}",
        "pass ex.data.from_hf(dataset, features=['x', ...], label='label') (pip install 'estimax[hf]')",
    ),
}


def check_source(source) -> None:
    """An ``InputKindError`` for a dataset of another library passed as it is, with the conversion; an
    ``InputError`` for a Grain ``MapDataset`` of single examples passed without ``from_grain``."""
    module = type(source).__module__.split(".")[0]
    if module == "grain" and _is_map_dataset_of_examples(source):
        raise InputError(
            f"Input is a Grain {type(source).__name__} of single examples, which estimax would read as if each "
            "were a batch; expected batches, or a dataset wrapped by ex.data.from_grain. Fix: "
            "ex.data.from_grain(dataset): it batches, shuffles each epoch from the run's seed and resumes."
        )
    if module in _FOREIGN:
        what, fix = _FOREIGN[module]
        raise InputKindError(
            f"Input is {what.format(name=type(source).__name__)}, which estimax does not read as it is; expected "
            f"estimax.data.from_arrays(...), from_grain(...), a file source or an iterable of numpy "
            f"(features, labels) batches. Fix: {fix}."
        )


def _is_map_dataset_of_examples(source) -> bool:
    """Whether ``source`` is a ``grain.MapDataset`` whose first element is one example, not a batch:
    it has a scalar, or arrays whose first dimensions differ."""
    import grain

    if not isinstance(source, grain.MapDataset) or len(source) == 0:
        return False
    leaves = [np.asarray(x) for x in jax.tree.leaves(source[0])]
    return any(x.ndim == 0 for x in leaves) or len({x.shape[0] for x in leaves}) > 1


def check_pair(item, what: str = "Input") -> None:
    if not (isinstance(item, tuple) and len(item) == 2):
        raise InputKindError(
            f"{what} yielded {type(item).__name__}; expected a (features, labels) tuple "
            "(labels may be None for prediction)."
        )


def stack_examples(examples: Sequence) -> tuple:
    """Stacks ``(features, labels)`` examples into one batch, checking each against the first.

    The ``batch_fn`` of the Grain sources: a bad example is named by its
    position in the batch and by the array that differs.
    """
    check_pair(examples[0], "The dataset")
    leaves0, treedef = jax.tree.flatten(examples[0])
    leaves0 = [np.asarray(x) for x in leaves0]
    signature = [(x.shape, x.dtype) for x in leaves0]
    columns = [[x] for x in leaves0]
    for i, example in enumerate(examples[1:], 1):
        check_pair(example, "The dataset")
        leaves, other = jax.tree.flatten(example)
        leaves = [np.asarray(x) for x in leaves]
        same_tree = other == treedef  # type: ignore[operator]  # jaxlib's stub of PyTreeDef declares no ==
        if not same_tree or [(x.shape, x.dtype) for x in leaves] != signature:
            expected = describe(_as_rows(jax.tree.unflatten(treedef, leaves0)))
            found = describe(_as_rows(example), check=False)
            raise InputError(f"Example {i} of a batch: {difference(expected, found, 'the first example')}")
        for column, x in zip(columns, leaves, strict=True):
            column.append(x)
    return jax.tree.unflatten(treedef, [np.stack(c) for c in columns])


def _as_rows(example):
    """One example as a batch of one row, so that it can be described like a batch."""
    return jax.tree.map(lambda x: np.asarray(x)[None], example)


def describe(batch, check: bool = True) -> dict[str, tuple]:
    """name -> (per-example shape, dtype) of a ``(features, labels)`` batch."""
    described, rows = {}, None
    for part, tree in zip(("features", "labels"), batch, strict=True):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            leaf = np.asarray(leaf)
            name = part + jax.tree_util.keystr(path)
            if check and not (leaf.dtype == bool or jax.numpy.issubdtype(leaf.dtype, jax.numpy.number)):
                raise InputError(
                    f"Input {name} has dtype {leaf.dtype}; expected numbers (bool, int, float: bfloat16 and "
                    "float8 too). "
                    "Fix: encode text or objects as numeric arrays before feeding them."
                )
            if leaf.ndim == 0:
                raise InputError(
                    f"Input {name} is a scalar; expected one row per example. Fix: feed batches, e.g. "
                    "ex.data.from_grain(dataset) for a Grain dataset of single examples."
                )
            if check and rows is not None and leaf.shape[0] != rows:
                raise InputError(
                    f"Input {name} has {leaf.shape[0]} rows; expected {rows} like the "
                    "other arrays of the batch (one row per example)."
                )
            rows = leaf.shape[0]
            described[name] = (leaf.shape[1:], leaf.dtype)
    return described


def difference(expected: dict, found: dict, reference: str) -> str:
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or extra:
        return (
            f"received arrays {sorted(found)}; expected {sorted(expected)} as in {reference} "
            f"(missing: {missing or 'none'}, unexpected: {extra or 'none'})."
        )
    name = next(k for k in expected if expected[k] != found[k])
    (shape, dtype), (want_shape, want_dtype) = found[name], expected[name]
    return (
        f"{name} has per-example shape {shape} and dtype {dtype}; expected {want_shape} {want_dtype} "
        f"as in {reference}. Every batch must have the same shapes and dtypes."
    )
