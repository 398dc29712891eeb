"""What a checkpoint records beside its arrays: the JSON ``meta`` item of every step.

Owns that record (``CheckpointMeta``: the step, the input position, the checksum
of every array, when it was saved, the run's setup and the device loop mode),
its one writer (``to_json``) and its one reader (``from_json``). A checkpoint
of an earlier release may lack the newer fields: they read as ``None``, and
what is written stays what every release wrote, so checkpoints already written
stay valid. Does not own the checksums' computation (``checkpoint_checks.py``),
the run's setup (``run_setup.py``) nor the input position (the input ``Plan``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from estimax.run.run_setup import RunSetup


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """The record of one checkpoint step.

    Attributes:
      step: the step the state was saved at.
      checksums: ``{array path: checksum}`` of every array, computed on the device at save time.
      input_state: where the input continues (the ``Plan``'s position), or ``None``.
      saved_at: when the save started (seconds since the epoch).
      run: how the run was set up (``RunSetup``), compared on resume.
      loop: the device loop mode (``"scan"`` or ``"step"``) the state was trained with.
    """

    step: int
    checksums: dict[str, int] = dataclasses.field(default_factory=dict)
    input_state: Any = None
    saved_at: float | None = None
    run: RunSetup | None = None
    loop: str | None = None

    def to_json(self) -> dict:
        """The record as Orbax's ``JsonSave`` writes it (the same keys, in the same order, as every release)."""
        record = {"step": self.step, "input_state": self.input_state, "checksums": self.checksums}
        record["saved_at"] = self.saved_at
        if self.run is not None:
            record["run"] = self.run.to_json()
        if self.loop is not None:
            record["loop"] = self.loop
        return record

    @classmethod
    def from_json(cls, record: dict) -> CheckpointMeta:
        """The record Orbax's ``JsonRestore`` read; what an earlier release did not write is ``None``."""
        return cls(
            step=record["step"],
            checksums=record.get("checksums", {}),
            input_state=record.get("input_state"),
            saved_at=record.get("saved_at"),
            run=RunSetup.from_json(record.get("run")),
            loop=record.get("loop"),
        )
