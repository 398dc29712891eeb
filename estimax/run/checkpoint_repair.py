"""What a writer repairs in a checkpoints folder: saves that never finished, and damaged steps.

Owns finding the saves that were stopped while they were written (which Orbax
does not list), removing their folders, telling a step directory from one
saved later at the same path, and moving the step directories a restore found
damaged aside (``<step>.corrupt-<time>``, never deleted) unless they changed
since, so that training saves those steps again. Does not own when a writer
repairs (``Checkpointer.open_for_writing`` in ``checkpoint.py``) nor what makes
a step damaged (``checkpoint_checks.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable

from estimax import storage

logger = logging.getLogger("estimax")

# A step's folder, or the temporary folder Orbax writes a step into before renaming it.
_UNFINISHED = re.compile(r"(\d+)(\.orbax-checkpoint-tmp.*)?")


def unfinished_steps(directory: str, committed: Callable[[], list[int]]) -> list[int]:
    """The steps of saves that were stopped while they were written, which Orbax does not list:
    on a local disk a folder under Orbax's temporary name, on a bucket (no atomic rename) the
    step's own folder without Orbax's commit marker. ``committed()`` lists the committed steps
    again, after the folder's names were read (a step committed in between is not unfinished)."""
    names = (_UNFINISHED.fullmatch(name) for name in storage.listdir(directory))
    return sorted({int(match[1]) for match in names if match} - set(committed()))


def remove_unfinished(directory: str, steps: list[int]) -> None:
    """Removes the folders of unfinished saves of ``steps``; one that an earlier attempt is still
    writing (it cannot commit it) may change meanwhile: what cannot be removed is left."""
    for name in storage.listdir(directory) if steps else ():
        match = _UNFINISHED.fullmatch(name)
        if match and int(match[1]) in steps:
            with contextlib.suppress(OSError):
                storage.remove(storage.join(directory, name), recursive=True)


def step_identity(path: str):
    """What tells a step directory from one saved later at the same path: its inode on disk; on an
    object store, the directory's listing (a re-save writes new objects)."""
    if not storage.is_url(path):
        return os.stat(path).st_ino if os.path.exists(path) else None
    fs, inner = storage.filesystem(path)
    fs.invalidate_cache(inner)
    objects = fs.find(inner, detail=True)
    return tuple(sorted((p, str(i.get("generation") or i.get("ETag") or i.get("size"))) for p, i in objects.items()))


def move_aside(directory: str, damaged: dict) -> dict[int, str]:
    """Renames the step directories of ``damaged`` (``{step: step_identity}``, as a restore found them) to
    ``<step>.corrupt-<time>`` unless they changed since; returns ``{step: where it was moved}``."""
    stamp, moved = time.strftime("%Y%m%dT%H%M%S"), {}
    for step, identity in sorted(damaged.items()):
        path = storage.join(directory, str(step))
        with contextlib.suppress(OSError):
            if step_identity(path) != identity:
                continue
            aside = f"{path}.corrupt-{stamp}"
            storage.move(path, aside)
            moved[step] = aside
            logger.warning(
                "Moved the damaged checkpoint %s aside to %s (kept for inspection); step %d is saved "
                "again when training reaches it.",
                path,
                aside,
                step,
            )
    return moved
