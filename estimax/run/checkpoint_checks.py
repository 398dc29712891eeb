"""What tells a checkpoint is whole and fits the run: checksums, structure, identity, and a full disk.

Owns the checksum of every array (computed on the device at save time, and
again after a restore), the check of a checkpoint's array structure against the
state a run expects (read from Orbax's metadata before any array is), and the
one line of a save that failed on a full disk (or of a damaged step). Does not own saving or restoring
(``checkpoint.py``), what a checkpoint's meta records (``checkpoint_meta.py``),
nor moving a damaged step aside (``checkpoint_repair.py``).
"""

from __future__ import annotations

import contextlib
import errno
import re

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from estimax import storage
from estimax.errors import CheckpointError


def checksums(tree) -> dict[str, jax.Array]:
    """A position-weighted sum of the bits of every array, by path (computed on the device)."""
    return {jax.tree_util.keystr(path): _checksum(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _checksum(x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


def saved_shapes(directory: str, step: int) -> dict[str, tuple] | None:
    """``{path: shape}`` of the arrays of ``step`` in ``directory`` from Orbax's metadata (read before any
    array is); ``None`` where it is missing, damaged, or reads as an empty tree (the restore reports that)."""
    try:
        saved = ocp.StandardCheckpointer().metadata(storage.join(directory, str(step), "state"))
        leaves = jax.tree_util.tree_leaves_with_path(getattr(saved, "item_metadata", saved))
        return {_path_name(p): tuple(x.shape) for p, x in leaves} or None
    except Exception:
        return None


def check_structure(abstract_state, directory: str, step: int, saved: dict[str, tuple] | None) -> None:
    """Raises ``CheckpointError`` naming the arrays that differ between ``abstract_state`` and
    ``saved``, the checkpoint's (``saved_shapes``); unreadable metadata is left to the restore."""
    if not saved:
        return
    expected = {_path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(abstract_state)}
    if saved == expected:
        return
    added, removed = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    reshaped = [
        f"{k} {expected[k]} now, {saved[k]} saved"
        for k in sorted(expected.keys() & saved.keys())
        if expected[k] != saved[k]
    ]
    parts = [
        f"{label}: {_listed(names)}"
        for label, names in (("added", added), ("removed", removed), ("other shape", reshaped))
        if names
    ]
    raise CheckpointError(
        f"Checkpoint step {step} of {directory} was saved by another model or optimizer; arrays "
        f"{'; '.join(parts)}. Expected the model and optimizer that wrote this model_dir. Fix: restore them, "
        "or train in another model_dir starting from this one with "
        f"WarmStart({storage.parent(directory)!r}) (it loads the parameters that still match)."
    )


def _path_name(path) -> str:
    """``params/l1/kernel``: a leaf's path, the same for the state and Orbax's saved tree."""
    parts = [getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))) for k in path]
    return "/".join(str(p) for p in parts).removesuffix("/value")


def _listed(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


@contextlib.contextmanager
def disk_errors(directory: str):
    """A full disk or a file-size limit while saving into ``directory`` becomes one line naming it
    and the last good checkpoint."""
    try:
        yield
    except Exception as error:
        reason = _disk_full(error)
        if reason is None:
            raise
        good = []
        with contextlib.suppress(OSError):  # the finished step directories (not the temporary ones)
            good = sorted(int(n) for n in storage.listdir(directory) if n.isdigit())
        last = (
            f"the last good checkpoint is step {good[-1]} ({storage.join(directory, str(good[-1]))})"
            if good
            else "no checkpoint was written yet"
        )
        raise CheckpointError(
            f"A checkpoint save in {directory} failed: {reason}; {last}. Fix: free space there (or raise "
            "the quota), then run the same command again" + (" to resume from it." if good else ".")
        ) from None


_DISK_FULL = {
    errno.ENOSPC: "No space left on device",
    errno.EDQUOT: "Disk quota exceeded",
    errno.EFBIG: "File too large",
}


def _disk_full(error: BaseException | None) -> str | None:
    """The reason, when ``error`` (or an error it came from) says the disk or a file limit is full."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in _DISK_FULL:
            return _DISK_FULL[error.errno]
        reason = next((r for r in _DISK_FULL.values() if r in str(error)), None)
        if reason:
            return reason
        error = error.__cause__ or error.__context__
    return None


def first_line(error: Exception, most: int = 240) -> str:
    """The first line of an error, without tensorstore's spec dumps, at most ``most`` characters."""
    text = str(error).strip().splitlines()
    text = re.sub(r" ?\[tensorstore_spec(\[\d+\])?='.*?'\]", "", text[0] if text else "")
    text = text if len(text) <= most else text[: most - 3] + "..."
    return f"{type(error).__name__}: {text}"
