"""Named evaluation sets: what an evaluation input may be, each set's name, and where its records go.

An evaluation input is one input, whose records are the split ``eval`` as they always were, or a
mapping of set names to inputs (``{"val": ..., "test": ...}``), each evaluated exactly on its own
and recorded as the split ``eval_<name>``: TensorBoard's run of that name (TF's
``EvalSpec(name=...)`` wrote ``eval_<name>`` too), ``metrics.jsonl`` records that also carry
``"set": name``, and console lines that start with it.

Owns checking a mapping and its names, the split of a name (and back), which set decides a
``Best``, and the shape of what is returned (one flat dict for one input, a dict per set for a
mapping). Does not own evaluating (``evaluator.py``) nor writing (``writers.py``). Imports no JAX.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from estimax.errors import ConfigError, ConfigTypeError

EVAL = "eval"
"""The split of a single, unnamed evaluation input."""

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a folder name on every filesystem and store


def named(eval_input, what: str = "eval_input") -> dict[str | None, object]:
    """``{name: input}`` of a mapping of sets, or ``{None: eval_input}`` for one input, checked."""
    if not isinstance(eval_input, Mapping):
        return {None: eval_input}
    if not eval_input:
        raise ConfigError(
            f"{what}={{}} is an empty mapping; expected one input, or a mapping of set names to inputs. "
            "Fix: pass e.g. {'val': val_input, 'test': test_input}, or the one input itself."
        )
    for name, value in eval_input.items():
        check_name(name, what)
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            raise ConfigTypeError(
                f"{what} maps {name!r} to an array of shape {tuple(value.shape)}; a mapping is read as named "
                "evaluation sets {name: input}. Fix: one input is ex.data.from_arrays(features, labels); "
                "several are {'val': ex.data.from_arrays(...), 'test': ...}."
            )
    return dict(eval_input)


def check_name(name, what: str = "eval_input") -> None:
    """Raises unless ``name`` is a set name: text that is also a folder name (no ``/``)."""
    if not isinstance(name, str):
        raise ConfigTypeError(
            f"{what} has the set name {name!r} ({type(name).__name__}); expected text, such as 'val' or 'test'. "
            "Fix: key each evaluation set by a string."
        )
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"{what} has the set name {name!r}; expected letters, digits, '_', '-' or '.' (not first), which name "
            "its TensorBoard tags and its records. Fix: e.g. 'val', 'test_2024' or 'wiki.en'."
        )


def split_of(name: str | None) -> str:
    """The split a set's records are written under: ``eval`` for the unnamed input, else ``eval_<name>``."""
    return EVAL if name is None else f"{EVAL}_{name}"


def set_of(split: str) -> str | None:
    """The set name of an evaluation split (``eval_val`` -> ``val``); ``None`` for any other split."""
    return split[len(EVAL) + 1 :] if split.startswith(EVAL + "_") else None


def is_eval_split(split: str) -> bool:
    return split == EVAL or set_of(split) is not None


def deciding(best, sets: Mapping[str | None, object]) -> str | None:
    """The set whose metric decides ``best`` (a ``Best`` or ``None``): ``Best(set=...)``, else the only set."""
    if best is None:
        return None
    names = list(sets)
    if names == [None]:
        if best.set is not None:
            raise ConfigError(
                f"Best(set={best.set!r}) names an evaluation set, but eval_input is one unnamed input; expected "
                f"a mapping that has {best.set!r}. Fix: eval_input={{{best.set!r}: ...}}, or leave set= out."
            )
        return None
    if best.set is None:
        if len(names) == 1:
            return names[0]
        raise ConfigError(
            f"Best(metric={best.metric!r}) does not say which of the evaluation sets {names} decides; expected "
            f"one named. Fix: Best({best.metric!r}, set={names[0]!r})."
        )
    if best.set not in names:
        raise ConfigError(
            f"Best(set={best.set!r}) is not among the evaluation sets {names}; expected one of them. "
            "Fix: correct the name, or add that set to eval_input."
        )
    return best.set


def returned(results: Mapping[str | None, object]):
    """What an evaluation of ``sets`` returns: the one result of an unnamed input, else ``{name: result}``."""
    return results[None] if list(results) == [None] else dict(results)


def flat(results: Mapping[str | None, Mapping[str, float]]) -> dict[str, float]:
    """One dict of floats (a summary record): an unnamed input's results, else ``<name>/<metric>``."""
    if list(results) == [None]:
        return dict(results[None])
    return {f"{name}/{metric}": value for name, values in results.items() for metric, value in values.items()}
