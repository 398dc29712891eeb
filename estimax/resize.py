"""A run resumed in another shape: the processes or devices changed since its checkpoint.

Owns telling a resize apart (the shape a checkpoint's run record holds against
this run's), refusing, before the first step, an input that cannot continue
exactly in the new shape (the input ``Plan`` knows which), and the one line and
``resize`` record that say what changed and what it cost. Does not own
resharding the state (a restore places it in this run's layout), nor where the
record goes (the writers), nor restarting a group (a supervisor).
"""

from __future__ import annotations

import logging
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


def resumed(plan, input, restored: dict | None, now: dict, start: int, last_step: Callable) -> dict | None:
    """After a restore from a checkpoint of another shape: refuses an input that cannot continue
    there, else says so in one line and returns the ``resize`` record; ``None`` in the same shape.

    ``restored``: the restored checkpoint's metadata (its run record and when it was saved);
    ``last_step()``: the last step the run before had recorded, or ``None`` (its steps past
    ``start`` are trained again).
    """
    before = ((restored or {}).get("run") or {}).get("shape")
    if not before or before == now:
        return None
    plan.check_resize(input, before["processes"], start)
    saved_at = restored.get("saved_at")
    since = max(time.time() - saved_at, 0.0) if saved_at else float("nan")
    last = last_step()
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
