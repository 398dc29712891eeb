"""The type and range of one setting's value: an integer, a positive integer, a number above a
bound, a flag.

Owns those checks and their messages, which name the settings object and the argument
(``RunConfig(seed=...)``, ``CheckpointPolicy(keep=...)``). Does not own which settings exist
nor how settings relate to each other (``config.py``, ``policies.py``). Imports no JAX.
"""

from __future__ import annotations

import contextlib
import numbers
import operator

from estimax.errors import ConfigError, ConfigTypeError


def integer(owner: str, name: str, value) -> int:
    """``value`` as a plain ``int`` (numpy's integers too); a ``ConfigTypeError`` for another type."""
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)
    raise ConfigTypeError(
        f"{owner}({name}={value!r}) is of type {type(value).__name__}; expected an integer. Fix: pass {name}=<int>."
    )


def positive(owner: str, name: str, value) -> int:
    """``value`` as a plain ``int``: a ``ConfigTypeError`` for another type, a ``ConfigError`` below 1."""
    value = integer(owner, name, value)
    if value < 1:
        raise ConfigError(f"{owner}({name}={value!r}) must be a positive integer; expected 1 or more.")
    return value


def number(owner: str, name: str, value, minimum: float = 0.0) -> float:
    """``value`` as a ``float`` above ``minimum`` (numpy's numbers too)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigTypeError(f"{owner}({name}={value!r}) is of type {type(value).__name__}; expected a number.")
    if not value > minimum or value != value:  # NaN compares false
        raise ConfigError(f"{owner}({name}={value!r}) must be a number above {minimum:g}.")
    return float(value)


def flag(owner: str, name: str, value) -> bool:
    """``value`` as a ``bool`` (numpy's too); ``"yes"`` or ``1`` are not read as one."""
    if type(value).__name__ not in ("bool", "bool_"):
        raise ConfigTypeError(f"{owner}({name}={value!r}) is of type {type(value).__name__}; expected True or False.")
    return bool(value)


def set_checked(settings, name: str, value) -> None:
    """Replaces a field of a frozen dataclass by its checked form, in its ``__post_init__``."""
    object.__setattr__(settings, name, value)
