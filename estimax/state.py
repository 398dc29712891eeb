"""TrainState: the one pytree that a training step maps to its successor.

Everything the continuation of a run depends on lives here, so that saving
it is saving the run.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class TrainState(NamedTuple):
    """Attributes:
    step: int32 scalar, the number of training steps taken.
    params: trained parameters (an ``nnx.State`` of ``nnx.Param``).
    opt_state: the optimizer's state.
    model_state: non-trained model variables (batch statistics, ...).
    rng: raw key data of the run's base key; step ``s`` uses ``fold_in(rng, s)``.
    average: an exponential moving average of ``params`` (``averaging.py``), or ``None``
      where the run keeps none (``RunConfig(ema_decay=None)``).
    """

    step: Any
    params: Any
    opt_state: Any
    model_state: Any
    rng: Any
    average: Any = None


def leaf_names(tree) -> list[str]:
    """``/``-joined paths of the leaves of a parameter tree, e.g. ``conv1/kernel``, in leaf order."""
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    return [jax.tree_util.keystr(p, simple=True, separator="/").removesuffix("/value") for p in paths]


def has_deleted_arrays(tree) -> bool:
    """Whether a leaf of ``tree`` is a ``jax.Array`` that was donated or deleted (it cannot be read)."""
    return any(leaf.is_deleted() for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array))
