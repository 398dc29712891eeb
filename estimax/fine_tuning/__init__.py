"""The settings of fine-tuning: ``LoRA`` and the check of ``RunConfig(freeze=...)``.

Owns what these settings may be and their checked forms, and the one arithmetic of an
adapter merged into its kernel (``merge_adapter``, numpy: the merged export and the loading
of an adapters-only export both use it, and serving imports no Flax); imports no JAX, like
``config.py``, which uses them. What they do is ``freezing.py``'s and ``lora.py``'s.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import re
from collections.abc import Mapping, Sequence

from estimax.errors import ConfigError, ConfigTypeError


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Low-rank adapters (LoRA) on linear layers: only the adapters train (``estimax/fine_tuning/lora.py``).

    Each ``flax.nnx.Linear`` whose module path fully matches a regex of ``layers``
    (``blocks/0/attn/query``) gets ``lora_a`` (in x rank) and ``lora_b`` (rank x out,
    zeros at first); its output becomes ``x @ kernel + x @ lora_a @ lora_b * alpha / rank``.
    Every other parameter is frozen.

    Attributes:
      layers: regexes over the paths of ``nnx.Linear`` modules; each must match one.
      rank: the adapters' inner dimension.
      alpha: the scale numerator; the adapter output is scaled by ``alpha / rank``.
      adapters: an adapter file (``Estimator.save_adapters``) to start from instead of
        fresh adapters, when the run has no checkpoint of its own.
    """

    layers: tuple = ()
    rank: int = 8
    alpha: float = 16.0
    adapters: str | os.PathLike | None = None

    def __post_init__(self):
        example = r"e.g. LoRA(layers=[r'blocks/\d+/attn/(query|value)'], rank=8)"
        layers = self.layers
        if isinstance(layers, str) or not isinstance(layers, Sequence) or not layers:
            raise ConfigTypeError(f"LoRA(layers={layers!r}); expected a non-empty list of regexes, {example}.")
        for rule in layers:
            if not isinstance(rule, str):
                raise ConfigTypeError(f"LoRA(layers=...) has {rule!r}; expected regex strings, {example}.")
            try:
                re.compile(rule)
            except re.error as error:
                raise ConfigError(f"LoRA(layers=...): {rule!r} is not a regex ({error}).") from None
        object.__setattr__(self, "layers", tuple(layers))
        rank, alpha = self.rank, self.alpha
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
            raise ConfigError(f"LoRA(rank={rank!r}) must be a positive integer, e.g. 8.")
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha > 0:
            raise ConfigError(f"LoRA(alpha={alpha!r}) must be a number above 0, e.g. 16 (the scale is alpha / rank).")
        object.__setattr__(self, "rank", int(rank))
        object.__setattr__(self, "alpha", float(alpha))
        if self.adapters is not None:
            object.__setattr__(self, "adapters", os.fspath(self.adapters))


def merge_adapter(kernel, lora_a, lora_b, scale: float):
    """``kernel + lora_a @ lora_b * scale``, computed in float64 and returned in the kernel's dtype."""
    import numpy as np  # when merging only: the settings' import stays light

    kernel = np.asarray(kernel)
    update = np.asarray(lora_a).astype(np.float64) @ np.asarray(lora_b).astype(np.float64)
    return (kernel.astype(np.float64) + update * scale).astype(kernel.dtype)


def check_freeze(freeze) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """``RunConfig(freeze=...)`` as phases ``((start_step, (regex, ...)), ...)`` sorted, the first at
    step 0; ``()``: nothing frozen. A list of regexes is one phase from step 0."""
    example = "e.g. [r'embed/.*'] or {0: [r'blocks/.*'], 500: []}"
    if isinstance(freeze, Mapping):
        entries = list(freeze.items())
    elif isinstance(freeze, Sequence) and not isinstance(freeze, str | bytes):
        if all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], int) for e in freeze) and freeze:
            entries = list(freeze)  # the checked form again
        else:
            entries = [(0, freeze)] if freeze else []
    else:
        raise ConfigTypeError(
            f"RunConfig(freeze={freeze!r}) is of type {type(freeze).__name__}; expected a list of regexes or a "
            f"dict step -> list of regexes, {example}."
        )
    phases = []
    for start, rules in entries:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ConfigError(f"RunConfig(freeze=...) has step {start!r}; expected a step >= 0, {example}.")
        if isinstance(rules, str) or not isinstance(rules, Sequence):
            raise ConfigTypeError(
                f"RunConfig(freeze=...) gives step {start} {rules!r}; expected a list of regexes, {example}."
            )
        for rule in rules:
            if not isinstance(rule, str):
                raise ConfigTypeError(f"RunConfig(freeze=...) has rule {rule!r}; expected a regex string, {example}.")
            try:
                re.compile(rule)
            except re.error as error:
                raise ConfigError(f"RunConfig(freeze=...): {rule!r} is not a regex ({error}).") from None
        phases.append((start, tuple(rules)))
    phases.sort()
    if phases and phases[0][0] != 0:
        phases.insert(0, (0, ()))  # nothing frozen before the first entry
    return tuple(phases)
