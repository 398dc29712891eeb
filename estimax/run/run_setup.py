"""What a checkpoint records about how its run was set up, and what changed on resume.

Owns the small ``run`` record saved with every checkpoint (``RunSetup``: the
global train batch size, the seed, the optimizer's hyper-parameters, read from
the closures of the optax transformation, and the ``RunShape``: processes,
devices, mesh), its one writer (``to_json``) and reader (``from_json``: a
record of an earlier release may lack newer fields, read as ``None``), and the
warning a resumed run gives when its own setup differs. A differing model or optimizer *structure* is an
error of ``checkpoint.py``; these differences still restore, but the resumed
run no longer continues the saved one exactly, so they are said.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import re
from typing import Any

logger = logging.getLogger("estimax")

_NOISE = re.compile(r"^(tx|inner|init|update|step_size_fn|init_fn|update_fn)$")


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What a run trains on: its processes, its devices and its mesh (``mesh.describe``: ``data=4 x model=2``)."""

    processes: int
    devices: int
    mesh: str | None = None

    def to_json(self) -> dict:
        return {"processes": self.processes, "devices": self.devices, "mesh": self.mesh}

    @classmethod
    def from_json(cls, record: dict | None) -> RunShape | None:
        if not record:
            return None
        return cls(record["processes"], record["devices"], record.get("mesh"))


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """How a run was set up, saved with every checkpoint (a field an earlier release did not save is ``None``)."""

    train_batch_size: int | None = None
    seed: int | None = None
    optimizer: dict[str, Any] | None = None  # ``optimizer_hyperparameters``
    shape: RunShape | None = None

    def to_json(self) -> dict:
        found = {"train_batch_size": self.train_batch_size, "seed": self.seed, "optimizer": self.optimizer}
        return found if self.shape is None else {**found, "shape": self.shape.to_json()}

    @classmethod
    def from_json(cls, record: dict | None) -> RunSetup | None:
        """The setup a checkpoint's ``run`` record holds; ``None`` when it holds none."""
        if not record:
            return None
        return cls(
            record.get("train_batch_size"), record.get("seed"), record.get("optimizer"),
            RunShape.from_json(record.get("shape")),
        )  # fmt: skip


def record(train_batch_size: int, seed: int, optimizer, shape: RunShape | None = None) -> RunSetup:
    """This run's setup; ``shape``: the processes, devices and mesh it trains on (``resize.shape``)."""
    return RunSetup(train_batch_size, seed, optimizer_hyperparameters(optimizer), shape)


def optimizer_hyperparameters(optimizer) -> dict[str, float | int | str | bool | None]:
    """``{"1.step_size": -0.1, ...}``: the numbers and flags an optax transformation closes over,
    by position in its chain and name (``optax.sgd(0.1)`` and ``optax.sgd(0.2)`` differ here)."""
    found: dict = {}
    _walk(optimizer, [], found, set(), 0)
    return found


def _walk(value, path: list[str], found: dict, seen: set, depth: int) -> None:
    if depth > 12 or id(value) in seen:
        return
    seen.add(id(value))
    if hasattr(value, "init") and hasattr(value, "update") and isinstance(value, tuple):
        _walk(value.init, path, found, seen, depth + 1)
        _walk(value.update, path, found, seen, depth + 1)
        return
    code, cells = getattr(value, "__code__", None), getattr(value, "__closure__", None) or ()
    if code is None:
        return
    for name, cell in zip(code.co_freevars, cells, strict=False):
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        _value(content, path + ([] if _NOISE.match(name) else [name]), found, seen, depth)


def _value(content, where: list[str], found: dict, seen: set, depth: int) -> None:
    if content is None or isinstance(content, bool | str):
        found[".".join(where)] = content
    elif isinstance(content, numbers.Number) or (getattr(content, "shape", None) == () and hasattr(content, "item")):
        found[".".join(where)] = content.item() if hasattr(content, "item") else content
    elif isinstance(content, dict):  # e.g. the hyper-parameters of optax.inject_hyperparams
        for key, item in content.items():
            _value(item, [*where, str(key)], found, seen, depth + 1)
    elif isinstance(content, list | tuple) and not hasattr(content, "update"):
        for i, item in enumerate(content):
            _walk(item, [*where[:-1], str(i)] if where else [str(i)], found, seen, depth + 1)
    elif callable(content) or hasattr(content, "update"):
        _walk(content, where, found, seen, depth + 1)


def differences(saved: RunSetup | None, now: RunSetup | None) -> list[str]:
    """What differs between a checkpoint's run setup and this run's, one phrase each."""
    if saved is None or now is None:
        return []
    said = []
    for key, before, after in [
        ("train_batch_size", saved.train_batch_size, now.train_batch_size),
        ("seed", saved.seed, now.seed),
    ]:
        if before is not None and before != after:
            said.append(f"{key} {before} when saved, {after} now")
    before, after = saved.optimizer, now.optimizer
    if before is not None and before != after:
        changed = [
            f"{k or 'value'} {before.get(k, 'absent')} -> {after.get(k, 'absent')}"
            for k in sorted(before.keys() | after.keys())
            if before.get(k, "absent") != after.get(k, "absent")
        ]
        said.append(f"optimizer hyper-parameters ({', '.join(changed[:6])}{' ...' if len(changed) > 6 else ''})")
    return said


def warn_on_resume(saved: RunSetup | None, now: RunSetup | None, step: int, directory: str) -> None:
    changed = differences(saved, now)
    if changed:
        logger.warning(
            "Resuming step %d of %s with another setup: %s. Training continues, but not as the saved run "
            "would have; use another model_dir (with WarmStart) for a new experiment.",
            step,
            directory,
            "; ".join(changed),
        )
