"""Warm start: a new run's parameters initialised from another run's arrays.

Owns selecting parameters by path (``include``/``exclude`` regexes, ``rename``),
checking shapes, and replacing the selected leaves of a freshly initialised
state. Parameter paths are ``/``-joined, e.g. ``conv1/kernel`` or
``head/bias``. Sources: another estimax run (its model_dir, checkpoints
directory or one step directory), a ``.npz`` file, or a directory of ``.npy``
files (``conv1/kernel.npy``), with paths as keys.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import numpy as np

from estimax import averaging, storage
from estimax import checkpoint as checkpoint_lib
from estimax.errors import CheckpointError
from estimax.state import leaf_names

logger = logging.getLogger("estimax")


class Plan(NamedTuple):
    """What a warm start does: ``loaded`` (target <- source), ``skipped`` source arrays,
    and target parameters ``initialised`` from scratch."""

    loaded: list[tuple[str, str]]
    skipped: list[str]
    initialised: list[str]

    def __str__(self) -> str:
        lines = [
            f"warm start: {len(self.loaded)} loaded, {len(self.skipped)} skipped, "
            f"{len(self.initialised)} left at initialisation"
        ]
        lines += [f"  load  {t}" + ("" if t == s else f"  <- {s}") for t, s in self.loaded]
        lines += [f"  skip  {s}" for s in self.skipped]
        lines += [f"  init  {t}" for t in self.initialised]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """Initialise parameters from ``path`` when a run starts without a checkpoint of its own.

    Attributes:
      path: another run's model_dir / checkpoint directory / step directory, a
        ``.npz`` file, or a directory of ``.npy`` files.
      include: regexes; a parameter is a candidate when its path fully matches one.
      exclude: regexes; a candidate whose path fully matches one stays at initialisation.
      rename: ``{regex: replacement}`` from a parameter's path to its path in the
        source (``re.sub``), e.g. ``{"classifier/(.*)": r"head/\\1"}``.
      optimizer_state: also load the optimizer state (same optimizer and
        parameter structure required). Off by default: fine-tuning usually
        starts a fresh optimizer.
    """

    path: str | os.PathLike
    include: Sequence[str] = (".*",)
    exclude: Sequence[str] = ()
    rename: Mapping[str, str] = dataclasses.field(default_factory=dict)
    optimizer_state: bool = False

    def plan(self, target_params) -> Plan:
        """What ``apply`` would load, skip and leave at initialisation (a dry run)."""
        return self._plan(_flatten(target_params), self._source()[0])

    def apply(self, state):
        """``state`` (a TrainState) with the selected parameters replaced from the source."""
        source, raw = self._source()
        plan = self._plan(_flatten(state.params), source)
        logger.info("%s", plan)
        chosen = dict(plan.loaded)

        def load(name, leaf):
            if name not in chosen:
                return leaf
            return jax.device_put(np.asarray(source[chosen[name]]).astype(leaf.dtype), leaf.sharding)

        leaves, treedef = jax.tree.flatten(state.params)
        params = jax.tree.unflatten(
            treedef, [load(n, x) for n, x in zip(leaf_names(state.params), leaves, strict=True)]
        )
        opt_state = state.opt_state
        if self.optimizer_state:
            if raw is None:
                raise CheckpointError(
                    f"WarmStart(optimizer_state=True): {self.path} holds arrays only, no optimizer "
                    "state; expected another estimax run's checkpoint."
                )
            leaves = jax.tree.leaves(raw["opt_state"])
            target = jax.tree.leaves(opt_state)
            if [np.shape(x) for x in leaves] != [np.shape(x) for x in target]:
                raise CheckpointError(
                    "WarmStart(optimizer_state=True): the source optimizer state has another "
                    "structure; expected the same optimizer over the same parameters."
                )
            opt_state = jax.tree.unflatten(
                jax.tree.structure(opt_state),
                [
                    jax.device_put(np.asarray(s).astype(t.dtype), t.sharding)
                    for s, t in zip(leaves, target, strict=True)
                ],
            )
        return averaging.restarted(state._replace(params=params, opt_state=opt_state))  # the average starts here

    def _plan(self, target: dict[str, tuple], source: dict[str, np.ndarray]) -> Plan:
        loaded, initialised, used = [], [], set()
        for name, shape in target.items():
            selected = any(re.fullmatch(p, name) for p in self.include) and not any(
                re.fullmatch(p, name) for p in self.exclude
            )
            source_name = name
            for pattern, replacement in self.rename.items():
                source_name = re.sub(pattern, replacement, source_name)
            if not selected or source_name not in source:
                initialised.append(name)
                continue
            if tuple(np.shape(source[source_name])) != tuple(shape):
                raise CheckpointError(
                    f"WarmStart: parameter {name} has shape {tuple(shape)} but {source_name} in {self.path} has "
                    f"shape {tuple(np.shape(source[source_name]))}. Fix: exclude it, e.g. "
                    f"WarmStart(..., exclude=[{re.escape(name.rsplit('/', 1)[0])!r} + '/.*'])."
                )
            loaded.append((name, source_name))
            used.add(source_name)
        return Plan(loaded, sorted(set(source) - used), initialised)

    def _source(self) -> tuple[dict[str, np.ndarray], dict | None]:
        """(parameters by path, the whole raw checkpoint or None) of ``path``."""
        path = storage.resolve(self.path)
        if path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as arrays:
                return {k.removesuffix("/value"): arrays[k] for k in arrays.files}, None
        local_arrays = not storage.is_url(path) and os.path.isdir(path) and _has_npy(path)
        if local_arrays and not os.path.isdir(os.path.join(path, checkpoint_lib.CHECKPOINTS)):
            arrays = {}
            for root, _, files in os.walk(path):
                for f in files:
                    if f.endswith(".npy"):
                        name = os.path.relpath(os.path.join(root, f), path)[: -len(".npy")].replace(os.sep, "/")
                        arrays[name] = np.load(os.path.join(root, f), allow_pickle=False)
            return arrays, None
        checkpointer, step = checkpoint_lib.locate(path)
        raw = checkpointer.restore_raw(step)
        return _flatten(raw["params"], arrays=True), raw


def _has_npy(path: str) -> bool:
    return any(f.endswith(".npy") for _, _, files in os.walk(path) for f in files)


def _flatten(tree, arrays: bool = False) -> dict:
    """``{path: shape}`` (or ``{path: array}``) of every leaf of a parameter tree."""
    leaves = jax.tree.leaves(tree)
    return {n: (np.asarray(x) if arrays else np.shape(x)) for n, x in zip(leaf_names(tree), leaves, strict=True)}
