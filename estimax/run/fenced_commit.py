"""A checkpoint that a superseded writer cannot commit: Orbax's temporary paths, fenced by the lock.

Orbax writes a step on a thread of its own and commits it last: on a disk by renaming
``<step>.orbax-checkpoint-tmp`` to ``<step>``, on a bucket (no rename) by writing
``<step>/commit_success.txt``. A writer paused while that thread ran (SIGSTOP, a frozen VM)
would, once running again, finish the commit into a model_dir whose lock another process
took over meanwhile. So:

- every attempt writes a step on a disk under a temporary name of its own
  (``<step>.orbax-checkpoint-tmp-<attempt>``): two attempts never write the same files,
  and a rename never lands on a step another attempt committed (a folder is renamed only
  onto a name that is free);
- a save starts (``checkpoint.py``) and a step is committed only once this process proved
  that it holds the lock now (``prove()`` of ``lock.py`` / ``lease.py``): after a takeover
  the commit raises the lock's error, and nothing is renamed or marked (the creation of a
  step is not fenced here: Orbax's helper threads would wait for it until their timeout);
- on a bucket a step is written in place, so the step a writer is about to save is named in
  its lease first (``prove(saving=step)``), and the attempt that takes the lease over
  never writes that step (``lease.py``): the late writes of a paused writer land in a step
  nobody else writes, which it cannot commit.

Owns the two classes; does not own the lock nor when a step is saved (``checkpoint.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from estimax import storage


def temporary_path_class(directory: str, prove: Callable[[], None], attempt: str) -> type:
    """The Orbax ``TemporaryPath`` class of a writer of ``directory``: ``prove()`` before a step's
    commit, and on a disk the temporary folder named after ``attempt``."""
    from orbax.checkpoint.path import atomicity

    if storage.is_url(directory):

        class FencedCommitFile(atomicity.CommitFileTemporaryPath):
            async def finalize(self):
                await asyncio.to_thread(prove)
                await super().finalize()

        return FencedCommitFile

    class FencedRename(atomicity.AtomicRenameTemporaryPath):
        @classmethod
        def from_final(cls, final_path, **options):
            temporary = final_path.parent / f"{final_path.name}{atomicity.TMP_DIR_SUFFIX}-{attempt}"
            return cls(temporary, final_path, **options)

        async def finalize(self):
            await asyncio.to_thread(prove)
            await super().finalize()

    return FencedRename
