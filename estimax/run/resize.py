"""A run resumed in another shape: the processes or devices changed since its checkpoint.

Owns telling a resize apart (the shape a checkpoint's run record holds against
this run's), refusing, before the first step, an input that cannot continue
exactly in the new shape (the ``InputPlan`` knows which), and the one line and
``resize`` record that say what changed and what it cost. Does not own
resharding the state (a restore places it in this run's layout), nor where the
record goes (the writers), nor restarting a group (a supervisor).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import jax

from estimax import mesh as mesh_lib

logger = logging.getLogger("estimax")


def shape(mesh) -> dict:
    """This run's shape as a checkpoint's run record keeps it."""
    return {"processes": jax.process_count(), "devices": jax.device_count(), "mesh": mesh_lib.describe(mesh)}


def describe(shape: dict) -> str:
    """``2 processes, 8 devices (mesh data=8)``."""
    processes = shape["processes"]
    plural = "es" if processes > 1 else ""
    return f"{processes} process{plural}, {shape['devices']} devices (mesh {shape.get('mesh', '?')})"


def resumed(plan, input, restored: dict | None, now: dict, start: int, records: Callable) -> dict | None:
    """After a restore from a checkpoint of another shape: refuses an input that cannot continue
    there, else says so in one line and returns the ``resize`` record; ``None`` in the same shape.

    ``restored``: the restored checkpoint's metadata (its run record and when it was saved);
    ``records(split)``: the run's ``metrics.jsonl`` records; the last train step the run before
    recorded tells the steps past ``start`` that are trained again.
    """
    before = ((restored or {}).get("run") or {}).get("shape")
    if not before or before == now:
        return None
    plan.check_resize(input, before["processes"], start)
    saved_at = restored.get("saved_at")
    since = max(time.time() - saved_at, 0.0) if saved_at else float("nan")
    last = max((r["step"] for r in records("train") if isinstance(r.get("step"), int)), default=None)
    redone = max(last - start, 0) if last is not None else None
    logger.info(
        "Resuming step %d in another shape: %s when saved, %s now; the state is resharded and the input "
        "continues at the next example; %.1f s since that checkpoint was saved%s.",
        start,
        describe(before),
        describe(now),
        since,
        f", {redone} steps trained again" if redone is not None else "",
    )
    return {
        "processes_before": before["processes"],
        "devices_before": before["devices"],
        "processes": now["processes"],
        "devices": now["devices"],
        "seconds_since_checkpoint": since,
        **({} if redone is None else {"steps_redone": redone}),
    }


def totals(records: Callable, step: int) -> str | None:
    """What the run's changes of shape cost, from its ``resize`` records, as one line; ``None`` if none."""
    resizes = records("resize")
    if not resizes:
        return None
    seconds = [r.get("seconds_since_checkpoint", math.nan) for r in resizes]
    lost = sum(x for x in seconds if math.isfinite(x))  # unknown (NaN) left out
    redone = sum(r.get("steps_redone", 0) for r in resizes)
    return (
        f"This run changed shape {len(resizes)} time{'s' if len(resizes) > 1 else ''}: {lost:.1f} s from those "
        f"checkpoints to training again, {redone} steps trained again; step goodput {step / (step + redone):.3f} "
        f"({step} steps kept of {step + redone} trained)."
    )
