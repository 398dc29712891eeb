"""Which parameters train: freeze rules over parameter paths, fixed or as a schedule over steps.

Owns turning ``RunConfig(freeze=...)`` into (1) an optax transformation in which frozen
parameters get a zero update and no optimizer state (``optax.multi_transform`` with
``optax.set_to_zero``), (2) an adapter whose bound modules see never-trained parameters
through ``jax.lax.stop_gradient``, so XLA drops their weight gradients, and (3) the plan
that says what trains at each phase, in counts and bytes. Does not own where arrays live
(``layout.py``) nor the step (``step.py``): both see an ordinary optimizer and adapter.

Rules match a parameter's ``/``-joined path (``blocks/0/mlp/up/kernel``) with
``re.fullmatch``, as ``sharding_rules`` and ``WarmStart`` do. A schedule
``{0: [r"embed/.*", r"blocks/.*"], 500: [r"embed/.*"]}`` freezes, from the update that
follows step ``s`` (the ``s``-th update counted from 0), the parameters its entry names,
until the next entry.

Parameters that train in some phases and not in others form groups, one per pattern of
phases; each group has its own optimizer state from the start, advanced only by the
updates it trains in (``optax.transforms.conditionally_mask``): a part unfrozen at
step 500 starts with fresh moments and its learning-rate schedule at its own count 0.
The phase is read from that count on the device, so one compiled program serves every
phase and a resumed run continues bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from estimax.errors import ConfigError
from estimax.layout import format_bytes as _bytes
from estimax.state import leaf_names

logger = logging.getLogger("estimax")

TRAINED, FROZEN = "trained", "frozen"


@dataclasses.dataclass(frozen=True)
class PhaseRow:
    """What trains from update ``start`` on."""

    start: int
    rules: tuple[str, ...]
    trained: int  # parameter arrays
    trained_elements: int
    trained_bytes: int
    frozen: int
    frozen_elements: int
    frozen_bytes: int


@dataclasses.dataclass(frozen=True)
class FreezePlan:
    """The phases of a freeze schedule, each with the counts and bytes of parameters trained and frozen,
    and the frozen paths of each phase (printable: the dry run of ``RunConfig(freeze=...)``)."""

    phases: tuple[PhaseRow, ...]
    frozen_paths: tuple[tuple[str, ...], ...]
    also_frozen_by: str = ""  # what freezes parameters besides the rules, e.g. "LoRA (the base)"

    def __str__(self) -> str:
        lines = []
        for row, paths in zip(self.phases, self.frozen_paths, strict=True):
            lines.append(
                f"from step {row.start}: training {row.trained} parameter arrays ({row.trained_elements:,} values, "
                f"{_bytes(row.trained_bytes)}), frozen {row.frozen} ({row.frozen_elements:,} values, "
                f"{_bytes(row.frozen_bytes)})" + self._by(row.rules)
            )
            lines += [f"  frozen  {p}" for p in paths[:20]]
            lines += [f"  ... {len(paths) - 20} more"] if len(paths) > 20 else []
        return "\n".join(lines)

    def _by(self, rules: tuple[str, ...]) -> str:
        named = ([f"{list(rules)}"] if rules else []) + ([self.also_frozen_by] if self.also_frozen_by else [])
        return f" by {' and '.join(named)}" if named else ""


class Freezing:
    """The freeze schedule of one run over one parameter tree.

    Args:
      phases: ``((start_step, (regex, ...)), ...)`` sorted by start, the first at 0
        (``config.check_freeze`` gives this form).
      abstract_params: the parameters' shapes (names are read from them).
      also_frozen: ``path -> bool``: parameters frozen in every phase besides the rules'
        (LoRA's base); ``also_frozen_by`` names it in the plan.
    """

    def __init__(self, phases, abstract_params, also_frozen=None, also_frozen_by: str = ""):
        self.phases = tuple((int(s), tuple(r)) for s, r in phases) or ((0, ()),)
        self.also_frozen_by = also_frozen_by
        self.names = leaf_names(abstract_params)
        self._leaves = jax.tree.leaves(abstract_params)
        self._check_rules_match()
        # frozen[i][j]: parameter j is frozen in phase i
        also = [bool(also_frozen and also_frozen(n)) for n in self.names]
        self._frozen = [
            [_matches(rules, n) or a for n, a in zip(self.names, also, strict=True)] for _, rules in self.phases
        ]
        self.labels = [self._label([f[j] for f in self._frozen]) for j in range(len(self.names))]

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.phases)

    def _label(self, frozen_by_phase: list[bool]) -> str:
        if not any(frozen_by_phase):
            return TRAINED
        if all(frozen_by_phase):
            return FROZEN
        # A group: the phases it trains in, e.g. "trains from 500" or "trains at 0,1000".
        return "trains at " + ",".join(str(s) for s, f in zip(self.starts, frozen_by_phase, strict=True) if not f)

    def _check_rules_match(self) -> None:
        for start, rules in self.phases:
            for rule in rules:
                if not any(re.fullmatch(rule, n) for n in self.names):
                    where = f"[{start}]" if len(self.phases) > 1 or start else ""
                    raise ConfigError(
                        f"RunConfig(freeze{where}=...) rule {rule!r} matches no parameter; expected a regex that "
                        f"fully matches paths such as {', '.join(self.names[:6])}"
                        f"{' ...' if len(self.names) > 6 else ''}. Fix: correct the regex or remove it."
                    )

    # -- the optimizer -------------------------------------------------------------------------
    def optimizer(self, inner: optax.GradientTransformation) -> optax.GradientTransformation:
        """``inner`` on the trained parameters only: frozen ones get a zero update and no state."""
        groups = sorted(set(self.labels))
        transforms = {}
        for group in groups:
            if group == TRAINED:
                transforms[group] = inner
            elif group == FROZEN:
                transforms[group] = optax.set_to_zero()
            else:
                transforms[group] = optax.transforms.conditionally_mask(inner, self._trains_at(group))
        labels = self.labels

        def param_labels(params):
            return jax.tree.unflatten(jax.tree.structure(params), labels)

        return optax.multi_transform(transforms, param_labels)

    def _trains_at(self, group: str):
        """``step -> bool``: whether ``group`` trains at this update (read on the device)."""
        trains = np.array([self.labels_in_phase(i, group) for i in range(len(self.phases))])
        starts = np.array(self.starts)

        def should_transform(step):
            phase = jnp.searchsorted(jnp.asarray(starts), step, side="right") - 1
            return jnp.asarray(trains)[phase]

        return should_transform

    def labels_in_phase(self, phase: int, group: str) -> bool:
        """Whether the parameters of ``group`` train in ``phase``."""
        j = self.labels.index(group)
        return not self._frozen[phase][j]

    # -- the model -----------------------------------------------------------------------------
    def stop_gradients(self, params):
        """``params`` with never-trained leaves behind ``stop_gradient``: XLA skips their weight gradients."""
        leaves, treedef = jax.tree.flatten(params)
        held = [jax.lax.stop_gradient(x) if lab == FROZEN else x for x, lab in zip(leaves, self.labels, strict=True)]
        return jax.tree.unflatten(treedef, held)

    def plan(self) -> FreezePlan:
        rows, paths = [], []
        for (start, rules), frozen in zip(self.phases, self._frozen, strict=True):
            sizes = [(math.prod(x.shape), math.prod(x.shape) * np.dtype(x.dtype).itemsize) for x in self._leaves]
            t = [s for s, f in zip(sizes, frozen, strict=True) if not f]
            z = [s for s, f in zip(sizes, frozen, strict=True) if f]
            rows.append(
                PhaseRow(
                    start,
                    rules,
                    len(t),
                    sum(e for e, _ in t),
                    sum(b for _, b in t),
                    len(z),
                    sum(e for e, _ in z),
                    sum(b for _, b in z),
                )
            )
            paths.append(tuple(n for n, f in zip(self.names, frozen, strict=True) if f))
        return FreezePlan(tuple(rows), tuple(paths), self.also_frozen_by)


class FrozenAdapter:
    """A model adapter whose bound modules see never-trained parameters behind ``stop_gradient``."""

    def __init__(self, adapter, freezing: Freezing):
        self._adapter, self._freezing = adapter, freezing

    def init(self):
        return self._adapter.init()

    def bind(self, params, model_state, mode, key):
        return self._adapter.bind(self._freezing.stop_gradients(params), model_state, mode, key)

    def model_state(self, module):
        return self._adapter.model_state(module)

    def live(self, params, model_state):
        return self._adapter.live(params, model_state)


def _matches(rules: tuple[str, ...], name: str) -> bool:
    return any(re.fullmatch(r, name) for r in rules)


def apply(phases, adapter, optimizer: optax.GradientTransformation, also_frozen=None, also_frozen_by: str = ""):
    """``(adapter, optimizer, plan)`` of a run with freeze ``phases`` (``config.check_freeze``'s form)
    and ``also_frozen`` (see ``Freezing``): unchanged and ``None`` when nothing is frozen. Raises a
    ``ConfigError`` for a rule that matches nothing, before anything compiles."""
    if not any(rules for _, rules in phases) and also_frozen is None:
        return adapter, optimizer, None
    abstract_params = jax.eval_shape(adapter.init)[0]  # shapes only: names and sizes
    freezing = Freezing(phases, abstract_params, also_frozen, also_frozen_by)
    return FrozenAdapter(adapter, freezing), freezing.optimizer(optimizer), freezing.plan()


def report(plan: FreezePlan | None) -> None:
    """Logs what trains (once the console shows estimax's lines)."""
    if plan is not None:
        logger.info("freeze: %s", plan)
