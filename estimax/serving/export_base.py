"""An export base: versions of one model side by side, ``BASE/<step>/``, for a server that follows it.

The convention, shared with whatever serves the base: a version is an integer-named
subdirectory ``BASE/<step>/`` that holds ``signature.json``; anything else (a dot-name,
a folder without ``signature.json``) is not a version. Each version is written by
``export.publish``: on a disk staged under a dot-name in ``BASE`` and renamed, on a store
uploaded with ``signature.json`` last, so a version appears whole or not at all. Owns the
base's settings (``ExportBase``), listing its versions and deleting the old ones (the
signature first, so that a version stops being one before its files go). Does not own
writing an artifact (``export.py``) nor serving one (``server.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import uuid

from estimax import storage
from estimax.errors import ConfigError
from estimax.serving.export import SIGNATURE

WHICH = ("best", "latest")


@dataclasses.dataclass(frozen=True)
class ExportBase:
    """Where and what a follower exports (``Estimator.follow(export=...)``).

    Attributes:
      path: the base, a local path, ``gs://`` or ``s3://``: versions go to ``<path>/<step>/``.
      which: ``"best"``: each checkpoint that is the best so far by ``follow(best=...)``'s metric;
        ``"latest"``: every checkpoint evaluated.
      keep: the newest versions kept (older ones are deleted).
    """

    path: str
    which: str = "best"
    keep: int = 3

    def __post_init__(self):
        if self.which not in WHICH:
            raise ConfigError(f"ExportBase(which={self.which!r}); expected one of {WHICH}.")
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise ConfigError(f"ExportBase(keep={self.keep!r}); expected a whole number of versions, 1 or more.")

    def version(self, step: int) -> str:
        return storage.join(storage.resolve(self.path), str(step))


def versions(base: str) -> list[int]:
    """The steps of the versions under ``base`` (integer names holding ``signature.json``), in order."""
    base = storage.resolve(base)
    steps = [int(n) for n in storage.listdir(base) if n.isdigit()]
    return sorted(s for s in steps if storage.exists(storage.join(base, str(s), SIGNATURE)))


def prune(base: str, keep: int) -> list[int]:
    """Deletes the versions of ``base`` before its ``keep`` newest; returns their steps. Each stops
    being a version first: on disk renamed to a dot-name, on a store its ``signature.json`` deleted."""
    base = storage.resolve(base)
    old = versions(base)[:-keep]
    for step in old:
        path = storage.join(base, str(step))
        if storage.is_url(path):
            storage.remove(storage.join(path, SIGNATURE))
            storage.remove(path, recursive=True)
            continue
        aside = storage.join(base, f".deleting-{step}-{uuid.uuid4().hex[:8]}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, aside)
            shutil.rmtree(aside, ignore_errors=True)
    return old
