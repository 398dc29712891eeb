"""Checkpoints of the TrainState in ``<model_dir>/checkpoints`` through Orbax.

Owns when a save is due (a multiple of ``every_steps`` crossed, or
``every_seconds`` passed), async saving, which checkpoints are kept, and
restoring the latest *good* one into the shardings the run expects.

A checkpoint is the state (Orbax ``StandardSave``: tensorstore arrays and
JSON metadata, never pickle) plus a JSON record with the step, the input
position and a checksum of every array computed on the device at save time.
A half-written checkpoint (a killed save) is never listed by Orbax; a
truncated or altered one fails to restore or fails its checksums, and the
previous one is used instead, with a warning that names both.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from estimax.config import CheckpointPolicy

logger = logging.getLogger("estimax")


class CheckpointError(ValueError):
    """No usable checkpoint where one was asked for."""


class Checkpointer:
    """The checkpoints of one directory (``<model_dir>/checkpoints``)."""

    def __init__(
        self,
        directory: str,
        policy: CheckpointPolicy | None = None,
        read_only: bool = False,
        best: tuple[str, str] | None = None,
    ):
        """``best=(metric, "max"|"min")`` keeps only the ``policy.keep`` best checkpoints by that metric."""
        self.directory = os.path.abspath(directory)
        self.policy = policy = policy or CheckpointPolicy()
        keep_every = policy.keep_every_hours
        best_options = {}
        if best is not None:
            metric, mode = best
            best_options = dict(best_fn=lambda m: m[metric], best_mode=mode, keep_checkpoints_without_metrics=False)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=policy.keep,
                keep_time_interval=None if keep_every is None else datetime.timedelta(hours=keep_every),
                enable_async_checkpointing=policy.async_save,
                cleanup_tmp_directories=not read_only,
                read_only=read_only,
                **best_options,
            ),
        )
        self._checksums = jax.jit(checksums)
        self._last_save = time.monotonic()

    @classmethod
    def of_model_dir(cls, model_dir: str, policy: CheckpointPolicy) -> Checkpointer:
        return cls(os.path.join(model_dir, "checkpoints"), policy)

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def due(self, step_before: int, step_after: int) -> bool:
        """Whether the loop that just ended crossed a multiple of ``every_steps`` or the time interval."""
        every, seconds = self.policy.every_steps, self.policy.every_seconds
        by_steps = every is not None and step_after // every > step_before // every
        by_time = seconds is not None and time.monotonic() - self._last_save >= seconds
        return by_steps or by_time

    def save(self, step: int, state, input_state=None, metrics: dict | None = None) -> None:
        """Starts a save of ``state`` at ``step``; returns once the state is copied off the devices."""
        if step in self._manager.all_steps():
            return
        sums = {k: int(v) for k, v in jax.device_get(self._checksums(state)).items()}  # host sync: state is ready
        meta = {"step": step, "input_state": input_state, "checksums": sums, "saved_at": time.time()}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._manager.save(step, args=args, force=True, metrics=metrics)
        self._last_save = time.monotonic()

    def restore(self, abstract_state, step: int | None = None):
        """``(state, meta)`` of ``step``, or of the latest checkpoint that restores and verifies.

        A corrupt latest checkpoint is skipped with a warning for the one
        before it; a corrupt ``step`` that was asked for raises.
        """
        candidates = [step] if step is not None else sorted(self._manager.all_steps(), reverse=True)
        failures = []
        for candidate in candidates:
            try:
                state, meta = self._restore_verified(abstract_state, candidate)
            except Exception as error:  # truncated files, altered arrays, wrong structure
                failures.append(f"step {candidate}: {_first_line(error)}")
                logger.warning("Checkpoint %s/%d cannot be used: %s", self.directory, candidate, _first_line(error))
                continue
            if failures:
                logger.warning("Restored step %d of %s instead of %s.", candidate, self.directory, failures[0])
            else:
                logger.info("Restored checkpoint step %d from %s", candidate, self.directory)
            return state, meta
        raise CheckpointError(
            f"No usable checkpoint in {self.directory}: {'; '.join(failures) or 'there is none'}. Fix: if the "
            "model or optimizer changed since they were saved, use another model_dir (WarmStart can start from "
            "this one); if they are damaged, point to another checkpoint or delete the damaged step directories."
        )

    def _restore_verified(self, abstract_state, step: int):
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        expected = restored.meta.get("checksums", {})
        found = jax.device_get(self._checksums(restored.state))
        bad = sorted(k for k in found if k not in expected or int(found[k]) != expected[k])
        if bad or len(found) != len(expected):
            raise CheckpointError(f"array contents differ from what was saved (checksum mismatch in {bad[:5]})")
        return restored.state, restored.meta

    def restore_raw(self, step: int | None = None):
        """The saved state as plain nested dicts of arrays, without a target structure."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"No checkpoint in {self.directory}; expected at least one saved step.")
        args = ocp.args.Composite(state=ocp.args.StandardRestore())
        return self._manager.restore(step, args=args).state

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def locate(path: str) -> tuple[Checkpointer, int | None]:
    """A read-only view of a checkpoint path: a model_dir (its latest checkpoint),
    its ``checkpoints`` directory, or one step directory ``.../checkpoints/<step>``."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    name = os.path.basename(path)
    if name.isdigit() and os.path.isdir(path):
        return Checkpointer(os.path.dirname(path), read_only=True), int(name)
    if os.path.isdir(path):
        return Checkpointer(path, read_only=True), None
    raise CheckpointError(
        f"Checkpoint path {path} does not exist; expected a model_dir, its checkpoints directory, "
        "or a step directory such as runs/x/checkpoints/1000."
    )


def abstract_like(abstract_state, shardings):
    """``ShapeDtypeStruct``s of ``abstract_state`` carrying ``shardings`` (a tree like it, one per leaf),
    the target of a restore: the arrays come back in this run's layout, whatever the saving run's was."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings)


def checksums(tree) -> dict[str, jax.Array]:
    """A position-weighted sum of the bits of every array, by path (computed on the device)."""
    return {jax.tree_util.keystr(path): _checksum(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _checksum(x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
