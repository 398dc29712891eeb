"""Which committed checkpoints a writer deletes, and deleting them without ever deleting twice.

Owns the choice (the committed steps before the ``keep`` newest, except one every
``keep_every_hours`` by commit time) and the deletion: each batch once this process proved it
holds the model_dir's lock, oldest first, a step that is already gone skipped; a step a live
follower has not read yet (``holds.py``) is kept until it has, or until its hold expires; a
reader's listing that a deletion raced, which is listed again; and the error of a reader that lost
that race every time (``outpaced``). Does not own when it runs
(``checkpoint.py``: with no save in flight, on every process of a group alike, since Orbax's
deletion is a collective) nor which steps are committed (Orbax's listing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import numpy as np

from estimax import storage
from estimax.config import CheckpointPolicy
from estimax.errors import CheckpointError
from estimax.run import holds


def prune(manager, policy: CheckpointPolicy, directory: str, prove: Callable[[], None]) -> None:
    """Deletes, through Orbax's ``manager``, the committed steps ``policy`` no longer keeps."""
    steps = sorted(manager.all_steps())
    doomed = [s for s in steps[: -policy.keep] if s not in kept_by_time(manager, steps, policy.keep_every_hours)]
    if doomed:  # a follower's hold keeps the steps from its floor on (read only when something would go)
        floor = held_from(storage.parent(directory))
        doomed = [s for s in doomed if floor is None or s < floor]
    if not doomed:
        return
    prove()  # nothing is deleted after a takeover
    for step in doomed:
        with contextlib.suppress(FileNotFoundError):  # gone already (another process deleted it)
            storage.bounded("deleting an old checkpoint", directory, manager.delete, step)


LISTINGS = 8  # listings a reader tries while a writer prunes


def listed(operation: str, directory: str, function, *args, **kwargs):
    """``function(*args, **kwargs)``, an Orbax listing of ``directory`` (opening its manager, reading its steps
    again) while a writer may be pruning it. Orbax lists the step folders, then reads each one: a step
    deleted in between fails the listing (about 1 in 20 listings failed while a writer saved and pruned
    without pause). It is listed again, up to ``LISTINGS`` times."""
    for attempt in range(LISTINGS):
        try:
            return storage.bounded(operation, directory, function, *args, **kwargs)
        except (FileNotFoundError, NotADirectoryError):  # a listed step folder is gone
            if attempt + 1 == LISTINGS:
                raise
            storage.forget_listings(directory)


def outpaced(directory: str, step: int, error: str) -> CheckpointError:
    """The error of a reader whose every listing's newest step was gone (deleted by the writer, which
    committed a newer one meanwhile) before it was read: a race lost ``LISTINGS`` times, not damage."""
    return CheckpointError(
        f"Could not read a checkpoint of {directory}: its writer deleted the newest step of each of {LISTINGS} "
        f"listings before it was read, committing a newer one each time (the last tried, step {step}: {error}). "
        "Nothing is damaged. Fix: evaluate while training with Estimator.follow (`estimax evaluate --follow`), "
        "which keeps each step until it is read; or have the trainer keep more checkpoints "
        "(CheckpointPolicy(keep=...)) or save less often; or read once training ends."
    )


def held_from(model_dir: str) -> int | None:
    """The first step a live follower's hold keeps (``holds.py``), ``None`` without one: process 0's
    reading on every process, so that they delete the same steps (each deletion is a collective)."""
    floor = min(holds.live_floors(model_dir), default=-1) if jax.process_index() == 0 else -1
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        floor = int(multihost_utils.broadcast_one_to_all(np.int32(floor)))
    return None if floor < 0 else floor


def kept_by_time(manager, steps: list[int], hours: float | None) -> set[int]:
    """The steps ``keep_every_hours`` keeps: the first, then each committed that long after the last kept."""
    if hours is None:
        return set()
    kept, last = set(), None
    for step in steps:
        committed = manager.metadata(step).commit_timestamp_nsecs or 0
        if last is None or committed - last >= hours * 3600e9:
            kept.add(step)
            last = committed
    return kept
