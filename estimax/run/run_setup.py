"""What a checkpoint records about how its run was set up, and what changed on resume.

Owns the small ``run`` record saved with every checkpoint (the global train
batch size, the seed, the optimizer's hyper-parameters, read from the
closures of the optax transformation, and the shape: processes, devices, mesh) and the warning a resumed run gives
when its own setup differs. A differing model or optimizer *structure* is an
error of ``checkpoint.py``; these differences still restore, but the resumed
run no longer continues the saved one exactly, so they are said.
"""

from __future__ import annotations

import logging
import numbers
import re

logger = logging.getLogger("estimax")

_NOISE = re.compile(r"^(tx|inner|init|update|step_size_fn|init_fn|update_fn)$")


def record(train_batch_size: int, seed: int, optimizer, shape: dict | None = None) -> dict:
    """The run record; ``shape``: the processes, devices and mesh it trains on (``resize.shape``)."""
    found = {"train_batch_size": train_batch_size, "seed": seed, "optimizer": optimizer_hyperparameters(optimizer)}
    return found if shape is None else {**found, "shape": shape}


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


def differences(saved: dict | None, now: dict) -> list[str]:
    """What differs between a checkpoint's run record and this run's, one phrase each."""
    if not saved:
        return []
    said = []
    for key in ("train_batch_size", "seed"):
        if key in saved and saved[key] != now[key]:
            said.append(f"{key} {saved[key]} when saved, {now[key]} now")
    before, after = saved.get("optimizer"), now["optimizer"]
    if before is not None and before != after:
        changed = [
            f"{k or 'value'} {before.get(k, 'absent')} -> {after.get(k, 'absent')}"
            for k in sorted(before.keys() | after.keys())
            if before.get(k, "absent") != after.get(k, "absent")
        ]
        said.append(f"optimizer hyper-parameters ({', '.join(changed[:6])}{' ...' if len(changed) > 6 else ''})")
    return said


def warn_on_resume(saved: dict | None, now: dict, step: int, directory: str) -> None:
    changed = differences(saved, now)
    if changed:
        logger.warning(
            "Resuming step %d of %s with another setup: %s. Training continues, but not as the saved run "
            "would have; use another model_dir (with WarmStart) for a new experiment.",
            step,
            directory,
            "; ".join(changed),
        )
