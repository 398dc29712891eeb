"""Warm start: a new run's parameters initialised from another run's or another library's arrays.

Owns selecting parameters by path (``include``/``exclude`` regexes), naming each one's array in
the source (``rename``), turning it (``transpose``), checking shapes and dtypes, the plan that
says all of it before anything trains, and replacing the selected leaves of a freshly
initialised state. Parameter paths are ``/``-joined, e.g. ``conv1/kernel`` or ``head/bias``.
Sources: another estimax run (its model_dir, checkpoints directory or one step directory), or a
weights file or directory that ``weight_files.py`` reads (safetensors, Keras ``.weights.h5``,
Flax msgpack, another project's Orbax checkpoint, ``.npz``, ``.npy`` files). Does not own reading
those files (``fine_tuning/weight_files.py``) nor estimax's checkpoints (``checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import logging
import os
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

import jax
import numpy as np

from estimax import storage
from estimax.errors import CheckpointError, ConfigTypeError
from estimax.fine_tuning import averaging, weight_files
from estimax.run import checkpoint as checkpoint_lib
from estimax.state import leaf_names

logger = logging.getLogger("estimax")


class WarmStartPlan(NamedTuple):
    """What a warm start does: ``loaded`` (target <- source), ``skipped`` source arrays, target
    parameters ``initialised`` from scratch, ``notes`` on loaded ones (a transposition, a cast),
    ``problems`` (one line each, naming the parameter: a wrong shape, a renamed array the source
    lacks, a cast that loses information) and the ``source`` (its path and format)."""

    loaded: list[tuple[str, str]]
    skipped: list[str]
    initialised: list[str]
    notes: Mapping[str, str] = MappingProxyType({})
    problems: tuple[str, ...] = ()
    source: str = ""

    def __str__(self) -> str:
        header = (
            f"warm start{f' from {self.source}' if self.source else ''}: {len(self.loaded)} loaded, "
            f"{len(self.skipped)} skipped, {len(self.initialised)} left at initialisation"
        )
        lines = [header + (f", {len(self.problems)} cannot load" if self.problems else "")]
        for t, s in self.loaded:
            note = self.notes.get(t)
            lines.append(f"  load  {t}" + ("" if t == s else f"  <- {s}") + (f"  ({note})" if note else ""))
        lines += [f"  skip  {s}" for s in self.skipped]
        lines += [f"  init  {t}" for t in self.initialised]
        lines += [f"  error {p}" for p in self.problems]
        return "\n".join(lines)

    def check(self) -> None:
        """Raises a ``CheckpointError`` with one line per problem, if there is any."""
        if self.problems:
            raise CheckpointError(
                f"WarmStart from {self.source}: {len(self.problems)} parameter(s) cannot load:\n"
                + "\n".join(self.problems)
            )


@dataclasses.dataclass(frozen=True)
class WarmStart:
    """Initialise parameters from ``path`` when a run starts without a checkpoint of its own.

    Attributes:
      path: another run's model_dir / checkpoint directory / step directory; a ``.safetensors``
        file (or a directory of them), a Keras 3 ``.weights.h5`` or ``.keras`` file, a Flax ``.msgpack`` file,
        another project's Orbax checkpoint directory, a ``.npz`` file or a directory of ``.npy``
        files. Its arrays keep the file's own names (``WarmStart(path).plan(...)`` lists them).
      include: regexes; a parameter is a candidate when its path fully matches one.
      exclude: regexes; a candidate whose path fully matches one stays at initialisation.
      rename: ``{regex: replacement}`` from a parameter's path to its name in the source, each
        applied in order with ``re.sub`` (groups allowed), e.g. ``{"classifier/(.*)": r"head/\\1"}``
        or ``{r"^layers/(\\d+)/kernel$": r"encoder.layer.\\1.weight"}``. A renamed parameter
        whose name the source lacks is an error.
      optimizer_state: also load the optimizer state (same optimizer and
        parameter structure required). Off by default: fine-tuning usually
        starts a fresh optimizer.
      transpose: regexes of parameter paths whose source arrays are transposed (axes
        reversed: a PyTorch ``Linear`` weight, (out, in), into a Flax kernel, (in, out)), or
        ``{regex: axes}`` for another order (a PyTorch convolution's (out, in, h, w) into
        Flax's (h, w, in, out): ``(2, 3, 1, 0)``).
    """

    path: str | os.PathLike
    include: Sequence[str] = (".*",)
    exclude: Sequence[str] = ()
    rename: Mapping[str, str] = dataclasses.field(default_factory=dict)
    optimizer_state: bool = False
    transpose: Sequence[str] | Mapping[str, Sequence[int]] = ()

    def __post_init__(self):
        for field in ("include", "exclude", "transpose"):
            if isinstance(getattr(self, field), str):
                raise ConfigTypeError(
                    f"WarmStart({field}={getattr(self, field)!r}): a string; expected a list of regexes. "
                    f"Fix: {field}=[{getattr(self, field)!r}]."
                )
        if not isinstance(self.rename, Mapping):
            raise ConfigTypeError(
                f"WarmStart(rename={self.rename!r}): a {type(self.rename).__name__}; expected a dict "
                "{regex: replacement}, e.g. rename={'body/kernel': 'encoder.weight'}."
            )

    def plan(self, target_params) -> WarmStartPlan:
        """What ``apply`` would load, skip and leave at initialisation, and what cannot load (a dry run:
        only the source's shapes and dtypes are read where its format allows)."""
        return self._plan(_targets(target_params), self._source()[0])

    def apply(self, state):
        """``state`` (a TrainState) with the selected parameters replaced from the source."""
        source, raw = self._source()
        plan = self._plan(_targets(state.params), source)
        logger.info("%s", plan)
        plan.check()
        chosen = dict(plan.loaded)
        arrays = source.read(sorted(set(chosen.values())))

        def load(name, leaf):
            if name not in chosen:
                return leaf
            array = np.asarray(arrays[chosen[name]])
            axes = self._axes(name, array.ndim)
            array = array if axes is None else np.transpose(array, axes)
            return jax.device_put(array.astype(leaf.dtype), leaf.sharding)

        leaves, treedef = jax.tree.flatten(state.params)
        params = jax.tree.unflatten(
            treedef, [load(n, x) for n, x in zip(leaf_names(state.params), leaves, strict=True)]
        )
        opt_state = state.opt_state
        if self.optimizer_state:
            opt_state = self._optimizer_state(raw, opt_state)
        return averaging.restarted(state._replace(params=params, opt_state=opt_state))  # the average starts here

    def _optimizer_state(self, raw, opt_state):
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
        return jax.tree.unflatten(
            jax.tree.structure(opt_state),
            [jax.device_put(np.asarray(s).astype(t.dtype), t.sharding) for s, t in zip(leaves, target, strict=True)],
        )

    def _plan(self, targets: dict[str, weight_files.ArraySpec], source: weight_files.WeightFile) -> WarmStartPlan:
        loaded, initialised, problems, notes, used = [], [], [], {}, set()
        for name, target in targets.items():
            selected = any(re.fullmatch(p, name) for p in self.include) and not any(
                re.fullmatch(p, name) for p in self.exclude
            )
            source_name, rule = self._source_name(name)
            if selected and rule is not None and source_name not in source.specs:
                problems.append(_missing(name, source_name, rule, source))
                continue
            if not selected or source_name not in source.specs:
                initialised.append(name)
                continue
            used.add(source_name)
            problem, note = self._check(name, target, source_name, source.specs[source_name])
            if problem:
                problems.append(problem)
                continue
            loaded.append((name, source_name))
            if note:
                notes[name] = note
        skipped = sorted(set(source.specs) - used)
        return WarmStartPlan(loaded, skipped, initialised, notes, tuple(problems), f"{source.path} ({source.format})")

    def _source_name(self, name: str) -> tuple[str, str | None]:
        """The name of ``name``'s array in the source, and the last rename rule that changed it (or None)."""
        rule = None
        for pattern, replacement in self.rename.items():
            if re.search(pattern, name):
                name, rule = re.sub(pattern, replacement, name), pattern
        return name, rule

    def _axes(self, name: str, ndim: int) -> tuple[int, ...] | None:
        """The axes ``transpose`` names for ``name``'s source array (``None``: as it is)."""
        if isinstance(self.transpose, Mapping):
            return next((tuple(a) for p, a in self.transpose.items() if re.fullmatch(p, name)), None)
        return tuple(reversed(range(ndim))) if any(re.fullmatch(p, name) for p in self.transpose) else None

    def _check(self, name, target, source_name, spec) -> tuple[str | None, str | None]:
        """(a problem line, or a note) of loading ``source_name`` (``spec``) into ``name`` (``target``)."""
        shape, notes = spec.shape, []
        axes = self._axes(name, len(shape))
        if axes is not None:
            if sorted(axes) != list(range(len(shape))):
                return (
                    f"parameter {name}: transpose axes {axes} do not order the {len(shape)} axes of "
                    f"{source_name} (shape {shape}). Fix: give a permutation of {tuple(range(len(shape)))}.",
                    None,
                )
            shape = tuple(shape[a] for a in axes)
            notes.append("transposed")
        if shape != tuple(target.shape) and axes is not None and tuple(spec.shape) == tuple(target.shape):
            return (
                f"parameter {name} has shape {tuple(target.shape)}, as {source_name} in the file has, but transpose "
                f"turns it into {shape}. Fix: leave {name} out of WarmStart(transpose=...).",
                None,
            )
        if shape != tuple(target.shape):
            return _wrong_shape(name, target.shape, source_name, spec.shape, axes is None), None
        if spec.dtype != target.dtype:
            if not np.can_cast(spec.dtype, target.dtype, "same_kind"):
                return (
                    f"parameter {name} is {target.dtype} but {source_name} in the file is {spec.dtype}: "
                    f"a cast {spec.dtype} -> {target.dtype} loses information. Fix: exclude it, e.g. "
                    f"exclude=[{re.escape(name)!r}], or convert the array in the file.",
                    None,
                )
            exact = np.can_cast(spec.dtype, target.dtype, "safe")
            notes.append(f"{spec.dtype} -> {target.dtype}" + ("" if exact else ", inexact"))
        return None, "; ".join(notes) or None

    def _source(self) -> tuple[weight_files.WeightFile, dict | None]:
        """(the source's arrays by name, the whole raw checkpoint of an estimax run or None)."""
        path = storage.resolve(self.path)
        opened = weight_files.open_weights(path)
        if opened is not None:
            return opened, None
        checkpointer, step = checkpoint_lib.locate(path)
        raw = checkpointer.restore_raw(step)
        arrays = {
            n: np.asarray(x) for n, x in zip(leaf_names(raw["params"]), jax.tree.leaves(raw["params"]), strict=True)
        }
        return weight_files.from_arrays(path, "estimax checkpoint", arrays), raw


def _targets(tree) -> dict[str, weight_files.ArraySpec]:
    """The shape and dtype of every leaf of a parameter tree (arrays or ``ShapeDtypeStruct``s), by path."""
    leaves = jax.tree.leaves(tree)
    return {
        n: weight_files.ArraySpec(tuple(np.shape(x)), np.dtype(x.dtype))
        for n, x in zip(leaf_names(tree), leaves, strict=True)
    }


def _missing(name: str, source_name: str, rule: str, source) -> str:
    close = difflib.get_close_matches(source_name, list(source.specs), n=3)
    hint = f" (close: {', '.join(close)})" if close else ""
    return (
        f"parameter {name} is renamed to {source_name} by rename[{rule!r}], which the file does not hold{hint}. "
        f"Fix: correct the rule, or exclude it, e.g. exclude=[{re.escape(name)!r}]."
    )


def _wrong_shape(name: str, shape, source_name: str, source_shape, can_transpose: bool) -> str:
    line = f"parameter {name} has shape {tuple(shape)} but {source_name} in the file has shape {tuple(source_shape)}"
    axes = _transposition(tuple(source_shape), tuple(shape)) if can_transpose else None
    if axes is None:
        prefix = name.rsplit("/", 1)[0]
        return f"{line}. Fix: exclude it, e.g. exclude=[{re.escape(prefix) + '/.*'!r}]."
    if axes == tuple(reversed(range(len(axes)))):
        return f"{line}: transposed? Fix: WarmStart(..., transpose=[{re.escape(name)!r}])."
    return f"{line}: transposed? Fix: WarmStart(..., transpose={{{re.escape(name)!r}: {axes}}})."


def _transposition(source: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, ...] | None:
    """Axes that order ``source``'s dimensions as ``target``'s (reversed ones first), if any do."""
    if len(source) != len(target) or not 2 <= len(source) <= 6 or sorted(source) != sorted(target):
        return None
    reverse = tuple(reversed(range(len(source))))
    for axes in itertools.chain([reverse], itertools.permutations(range(len(source)))):
        if tuple(source[a] for a in axes) == target:
            return axes
    return None
