"""Checkpoints of the TrainState in ``<model_dir>/checkpoints`` through Orbax.

Owns when a save is due (a multiple of ``save_every_steps`` crossed), async
saving, keeping the last N, and restoring the latest complete checkpoint into
the shardings the run expects. Half-written checkpoints (a killed save) are
never restored: Orbax only lists committed steps.
"""

from __future__ import annotations

import logging
import os

import jax
import orbax.checkpoint as ocp

logger = logging.getLogger("estimax")


class Checkpointer:
    def __init__(self, model_dir: str, *, save_every_steps: int | None, keep: int):
        self.directory = os.path.join(os.path.abspath(model_dir), "checkpoints")
        self.save_every_steps = save_every_steps
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=True
            ),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def due(self, step_before: int, step_after: int) -> bool:
        """Whether this loop crossed a multiple of ``save_every_steps``."""
        every = self.save_every_steps
        return every is not None and step_after // every > step_before // every

    def save(self, step: int, state) -> None:
        """Starts an async save; returns once the state is copied off the devices."""
        if step in self._manager.all_steps():
            return
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore(self, abstract_state, step: int | None = None):
        """The state at ``step`` (default: latest), placed as ``abstract_state`` says."""
        step = self.latest_step() if step is None else step
        state = self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
        logger.info("Restored checkpoint step %d from %s", step, self.directory)
        return state

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def abstract_like(abstract_state, sharding):
    """``ShapeDtypeStruct``s of ``abstract_state`` carrying ``sharding``, the target of a restore."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract_state)
