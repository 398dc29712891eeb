"""Checkpoints of the TrainState in ``<model_dir>/checkpoints`` through Orbax.

Owns saving (async), which checkpoints are kept, and restoring the latest
*good* one into the shardings the run expects; when a save is due is
``save_schedule.py``'s, told here when each save starts and commits.

A checkpoint is the state (Orbax's standard format: tensorstore arrays and
JSON metadata, never pickle; written by ``checkpoint_handlers.py``) plus a
JSON record (``checkpoint_meta.py``) with the step, the input position and a
checksum of every array computed on the device at save time
(``checkpoint_checks.py``).
A half-written checkpoint (a killed save) is never listed by Orbax, and a
writer removes it with a warning naming the step; a
truncated or altered one fails to restore or fails its checksums, and the
previous one is used instead, with a warning that names both. A writer
(the process holding the model_dir's lock) then moves the damaged step
directories aside (``<step>.corrupt-<time>``, never deleted) so that the
retrained steps are saved again. A checkpoint of another model or optimizer
is an error naming the arrays that differ, checked on Orbax's array metadata
before anything is read.

A Checkpointer opens read-only (it creates, cleans and renames nothing)
until ``open_for_writing()``, which ``RunDir.writing`` (``run_dir.py``) calls
under the lock. Where the checkpoints of a run live is ``run_dir.py``'s; what
tells a checkpoint is whole and fits is ``checkpoint_checks.py``'s.
"""

from __future__ import annotations

import contextlib
import logging
import time

import jax
import orbax.checkpoint as ocp

from estimax import storage
from estimax.config import CheckpointPolicy
from estimax.errors import CheckpointError, StorageError
from estimax.fine_tuning import averaging
from estimax.run import checkpoint_handlers, pruning
from estimax.run.checkpoint_checks import check_structure, checksums, disk_errors, first_line, saved_shapes
from estimax.run.checkpoint_meta import CheckpointMeta
from estimax.run.checkpoint_repair import move_aside, remove_unfinished, step_identity, unfinished_steps
from estimax.run.fenced_commit import temporary_path_class
from estimax.run.run_setup import RunSetup
from estimax.run.save_schedule import SaveSchedule
from estimax.storage import noise, orbax_s3, unanswered

logger = logging.getLogger("estimax")
CHECKPOINTS = "checkpoints"  # a model_dir's folder of checkpoints (``run_dir.py`` lays out the rest)


class Checkpointer:
    """The checkpoints of one directory (``<model_dir>/checkpoints``)."""

    saves = True  # (``run_dir.NoCheckpoints`` keeps nothing)

    def __init__(
        self,
        directory: str,
        policy: CheckpointPolicy | None = None,
        read_only: bool = False,
        best: tuple[str, str] | None = None,
        lock=None,
        setup: RunSetup | None = None,
    ):
        """``best=(metric, "max"|"min")`` keeps only the ``policy.keep`` best checkpoints by that metric.
        ``lock``: the model_dir's lock (``lock.py``, ``lease.py``), whose ``prove()`` fences every write.
        ``setup``: how the run was set up, saved with every checkpoint (``CheckpointMeta.run``)."""
        noise.quiet_libraries()
        self.directory = storage.resolve(directory)
        storage.quiet_tensorstore(self.directory)
        self.policy = policy or CheckpointPolicy()
        self.read_only = read_only
        self._best = best
        self._lock = lock or _NoLock()
        self._attempt = ""  # this writer's name for its temporary folders (``fenced_commit.py``)
        self._left: tuple[int, ...] = ()  # steps an earlier holder may still be writing: never saved here
        self._manager = self._open(read_only)
        self._manager_writable = not read_only  # Orbax's manager may save and delete (``open_for_writing``)
        self._names_read: list[str] | None = None  # a local folder's names when Orbax last read its steps
        self._checksums = jax.jit(checksums)
        self.schedule = SaveSchedule(self.policy)
        self.setup = setup
        self._damaged: dict[int, int] = {}  # step -> inode of a step directory a restore found damaged
        self._moved_aside: dict[int, str] = {}
        self._saving: int | None = None  # the step of the latest save started
        self._primary = True

    def _open(self, read_only: bool) -> ocp.CheckpointManager:
        policy, best_options = self.policy, {}
        if self._best is not None:
            metric, direction = self._best
            best_options = dict(
                best_fn=lambda m: m[metric], best_mode=direction, keep_checkpoints_without_metrics=False
            )
        store_options = orbax_s3.options() if storage.scheme(self.directory) == "s3" else {}
        if not read_only:
            store_options["temporary_path_class"] = temporary_path_class(
                self.directory, self._lock.prove, self._attempt
            )
        # The latest checkpoints are kept by ``_prune`` (the best ones by Orbax): only committed steps are
        # deleted, never one that is already gone, and nothing after this writer's lock was taken over.
        keep = policy.keep if self._best is not None else None
        return pruning.listed(
            "opening the checkpoints",
            self.directory,
            ocp.CheckpointManager,
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=policy.async_save,
                cleanup_tmp_directories=False,  # ``_remove_unfinished``: another attempt may be writing there
                read_only=read_only,
                **best_options,
                **store_options,
            ),
            handler_registry=checkpoint_handlers.registry(),
        )

    def open_for_writing(self, primary: bool = True, attempt: str = "", left=()) -> None:
        """Becomes the writer (the caller holds the model_dir's lock): leftovers of killed saves are
        cleaned up, and the damaged steps a restore found are moved aside (by ``primary`` only, the
        one process that renames for a group). ``attempt``: the group's name for its temporary folders;
        ``left``: the steps an earlier holder may still be writing, which this writer never saves."""
        self._left = tuple(left)
        if self.read_only:
            if attempt != self._attempt:
                self._attempt, self._manager_writable = attempt, False  # opened again with the new name
            # Listed again (steps() reloads): what others wrote is seen.
            unfinished = unfinished_steps(self.directory, self.steps) if primary else []
            # One process that wrote here last, with nothing left unfinished since, goes on with the manager it
            # kept (its view was just reloaded); otherwise Orbax opens again and removes unfinished saves.
            if unfinished or not self._manager_writable or jax.process_count() > 1:
                with contextlib.suppress(Exception):  # idle, or its failed save was reported: discarded
                    self._manager.close()
                self._manager = self._open(False)
            self.read_only, self._manager_writable = False, True
            remove_unfinished(self.directory, unfinished)
            if unfinished:  # Orbax listed on opening: a step committed since the check, removed here, is listed no more
                self._manager.reload()
            for step in unfinished:
                again = "is not saved by this run" if step in self._left else "is saved again when training reaches it"
                logger.warning(
                    "The save of step %d in %s never finished (the process writing it stopped): removed; the "
                    "latest finished checkpoint is used, and step %d %s.",
                    step, self.directory, step, again,
                )  # fmt: skip
        self._primary = primary
        if primary:
            self._move_damaged_aside()

    def close_for_writing(self) -> None:
        """Back to a read-only view (the caller releases the lock): saves in flight complete first.
        The writable manager is kept for this process's next ``open_for_writing``; nothing is saved
        or deleted through it meanwhile (``save`` refuses), and reads list the store again."""
        if not self.read_only:
            self.read_only = True
            try:
                self.wait()
            except BaseException:
                self._manager_writable = False  # a failed save: Orbax opens afresh next time
                raise
            self._names_read = self._local_names()  # the writer's own view is current: no need to read it again

    def refresh(self) -> None:
        """Lists the step directories again (another process, or the group's primary, changed them).
        On a local disk, where Orbax commits a step by renaming its folder, Orbax reads the steps
        again only when the folder's names changed."""
        names = self._local_names()
        if names is not None and names == self._names_read:
            return
        storage.forget_listings(self.directory)
        pruning.listed("listing the checkpoints", self.directory, self._manager.reload)
        self._names_read = names

    def _local_names(self) -> list[str] | None:
        """The names in a local checkpoints folder; ``None`` on a bucket (a step is committed by a
        marker inside its folder, so the names alone do not tell)."""
        return None if storage.is_url(self.directory) else storage.listdir(self.directory)

    def steps(self) -> list[int]:
        if self.read_only:
            self.refresh()  # a reader sees what the writer saved since
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        if self.read_only:
            self.refresh()
        return self._manager.latest_step()

    def committed_step(self, read: bool = False) -> int | None:
        """The latest committed step: on a local disk from the folder's names (a step is committed by the
        rename of its folder, whoever saved it); on a bucket from memory, or with ``read`` from a listing
        (a failing store may be why it is asked: only ``read`` calls it)."""
        names = self._local_names()
        if names is not None:
            return max((int(name) for name in names if name.isdigit()), default=None)
        if read:
            with contextlib.suppress(Exception):  # the listing failed: what this process saw
                storage.forget_listings(self.directory)
                return max(pruning.listed("listing the checkpoints", self.directory, self._manager.all_steps, True),
                           default=None)  # fmt: skip
        steps = set(self._manager.all_steps())
        if not self.read_only and self._manager.is_saving_in_progress():  # listed before it is committed
            steps.discard(self._saving)
        return max(steps, default=None)

    def due(self, step_before: int, step_after: int) -> bool:
        """Whether a save is due after the loop ``step_before`` -> ``step_after`` (``SaveSchedule``)."""
        if self.schedule.in_flight and not self._manager.is_saving_in_progress():  # Orbax asked only then
            self.schedule.finished()
        return self.schedule.due(step_before, step_after)

    def clock_decides(self, step_before: int, step_after: int) -> bool:
        """Whether ``due`` reads this process's clock here (with several processes: process 0's decides)."""
        return self.schedule.depends_on_clock(step_before, step_after)

    def save(self, step: int, state, input_state=None, metrics: dict | None = None, loop: str | None = None) -> None:
        """Starts a save of ``state`` at ``step``; returns once the state is copied off the devices.

        ``loop``: the device loop mode the state was trained with, which a resumed ``auto`` run keeps.
        """
        if self.read_only:
            # a bug in estimax, not a user's mistake: the run directory opens it for writing before any save
            raise RuntimeError(f"Checkpointer of {self.directory} is read-only; open_for_writing() first.")
        if step in self._manager.all_steps():
            return
        if step in self._left:
            logger.warning(
                "Step %d is not saved in %s: an earlier holder of the model_dir's lock may still be writing it "
                "(it was saving it when its lease was taken over); the next checkpoint is saved as usual.",
                step, self.directory,
            )  # fmt: skip
            return
        sums = {k: int(v) for k, v in jax.device_get(self._checksums(state)).items()}  # host sync: state is ready
        meta = CheckpointMeta(step, sums, input_state, saved_at=time.time(), run=self.setup, loop=loop)
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(_on_disk(state)), meta=ocp.args.JsonSave(meta.to_json()))
        with disk_errors(self.directory), self._lock_errors():
            self._manager.wait_until_finished()  # the save before (Orbax would wait for it in ``save``)
            self.schedule.finished()
            self._prune()
            self._lock.prove(saving=step)  # a successor never writes this step (``fenced_commit.py``)
            self._saving = step
            self.schedule.started()
            self._manager.save(step, args=args, force=True, metrics=metrics)
        if not self.policy.async_save:
            self.schedule.finished()
        if step in self._moved_aside:
            aside = self._moved_aside.pop(step)
            logger.warning("Saved step %d again in %s; the damaged one is kept in %s.", step, self.directory, aside)

    def restore(self, abstract_state, step: int | None = None) -> tuple[object, CheckpointMeta]:
        """``(state, meta)`` of ``step``, or of the latest checkpoint that restores and verifies.

        A corrupt latest checkpoint is skipped with a warning for the one
        before it; a corrupt ``step`` that was asked for raises. On a store, the restore has
        the store's deadline (``storage.bounded``): a store that does not answer is no damage.
        """
        return storage.bounded("restoring a checkpoint", self.directory, self._restore, abstract_state, step)

    def _restore(self, abstract_state, step: int | None, listings: int = 1):
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        failures, damaged = [], {}
        for candidate in candidates:
            saved = saved_shapes(self.directory, candidate)
            target = averaging.restore_target(abstract_state, saved)  # with a parameter average where one was saved
            check_structure(target, self.directory, candidate, saved)  # another model: an error, not damage
            try:
                state, meta = self._restore_verified(target, candidate)
            except Exception as error:  # truncated files, altered arrays
                if isinstance(error, StorageError) or unanswered(error):
                    raise  # the store, not the checkpoint: ``bounded`` tries again or reports it
                if step is None and (self.latest_step() or -1) > candidates[0]:
                    # A newer step was committed since the listing: the writer may have deleted this one.
                    if listings < pruning.LISTINGS:
                        return self._restore(abstract_state, None, listings + 1)
                    raise pruning.outpaced(self.directory, candidate, first_line(error)) from error
                # A later attempt that took the model_dir over meanwhile may have pruned or replaced this step:
                # the lock's error (exit 74), not damage, and nothing moved aside by a process that is no writer.
                self._lock.prove()
                failures.append(f"step {candidate}: {first_line(error)}")
                logger.warning("Checkpoint %s/%d cannot be used: %s", self.directory, candidate, first_line(error))
                damaged[candidate] = step_identity(storage.join(self.directory, str(candidate)))
                continue
            if failures:
                logger.warning("Restored step %d of %s instead of %s.", candidate, self.directory, failures[0])
                self._damaged = damaged
                if not self.read_only and self._primary:
                    self._move_damaged_aside()
            else:
                logger.info("Restored checkpoint step %d from %s", candidate, self.directory)
            where = f"Checkpoint {storage.join(self.directory, str(candidate))}"
            return averaging.as_wanted(state, abstract_state, where), meta
        raise CheckpointError(
            f"No usable checkpoint in {self.directory}: {'; '.join(failures) or 'there is none'}. Fix: if the "
            "model or optimizer changed since they were saved, use another model_dir (WarmStart can start from "
            "this one); if they are damaged, point to another checkpoint or delete the damaged step directories."
        )

    def _move_damaged_aside(self) -> None:
        """Moves the step directories the last restore found damaged aside, so that training saves those
        steps again (``checkpoint_repair.move_aside``)."""
        if self._damaged:
            self._lock.prove()  # a rename that must not land after a takeover
            self._moved_aside.update(move_aside(self.directory, self._damaged))
            self._damaged = {}
            self._manager.reload()

    def _restore_verified(self, abstract_state, step: int) -> tuple[object, CheckpointMeta]:
        target = ocp.args.StandardRestore(_on_disk(abstract_state))
        restored = self._manager.restore(step, args=ocp.args.Composite(state=target, meta=ocp.args.JsonRestore()))
        state = _from_disk(restored.state, abstract_state)
        meta = CheckpointMeta.from_json(restored.meta)
        expected = meta.checksums
        found = jax.device_get(self._checksums(state))
        bad = sorted(k for k in found if k not in expected or int(found[k]) != expected[k])
        if bad or len(found) != len(expected):
            raise CheckpointError(f"array contents differ from what was saved (checksum mismatch in {bad[:5]})")
        return state, meta

    def restore_raw(self, step: int | None = None):
        """The saved state as plain nested dicts of arrays, without a target structure."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"No checkpoint in {self.directory}; expected at least one saved step.")
        args = ocp.args.Composite(state=ocp.args.StandardRestore())
        return self._manager.restore(step, args=args).state

    def wait(self, prune: bool = False) -> None:
        """Waits for the save in flight; with ``prune`` (every process of a group at once: Orbax's deletion
        is a collective), then deletes the steps past the policy's ``keep``."""
        with disk_errors(self.directory), self._lock_errors():
            self._manager.wait_until_finished()
            if prune and not self.read_only:
                self._prune()
        self.schedule.finished()

    def _prune(self) -> None:
        if self._best is None:  # Orbax keeps the best ones
            pruning.prune(self._manager, self.policy, self.directory, self._lock.prove)

    @contextlib.contextmanager
    def _lock_errors(self):
        """A save that failed because this process lost the model_dir's lock (its commit was refused,
        ``fenced_commit.py``, or the attempt that took over removed its unfinished files) raises the lock's
        own error: one line, exit code 74. Proved, not checked: the lease's last renewal may still hold."""
        try:
            yield
        except Exception:
            self._lock.prove()
            raise

    def close(self) -> None:
        self._manager.close()


class _NoLock:
    """The lock of a checkpointer that holds none (a reader, or a test's): nothing to prove."""

    def check(self) -> None:
        pass

    def prove(self, saving: int | None = None) -> None:
        pass


def locate(path: str) -> tuple[Checkpointer, int | None]:
    """A read-only view of a checkpoint path: a model_dir (its latest checkpoint),
    its ``checkpoints`` directory, or one step directory ``.../checkpoints/<step>``."""
    path = storage.resolve(path)
    if storage.isdir(storage.join(path, CHECKPOINTS)):
        path = storage.join(path, CHECKPOINTS)
    name = storage.name(path)
    if name.isdigit() and storage.isdir(path):
        return Checkpointer(storage.parent(path), read_only=True), int(name)
    if storage.isdir(path):
        return Checkpointer(path, read_only=True), None
    raise CheckpointError(
        f"Checkpoint path {path} does not exist; expected a model_dir, its checkpoints directory, "
        "or a step directory such as runs/x/checkpoints/1000."
    )


def abstract_like(abstract_state, shardings):
    """``ShapeDtypeStruct``s of ``abstract_state`` carrying ``shardings`` (a tree like it, one per leaf),
    the target of a restore: the arrays come back in this run's layout, whatever the saving run's was."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings)


def _on_disk(state):
    """A TrainState as Orbax saves it: its fields by name, less those that hold nothing (no parameter
    average), so that a run without an average writes and reads what earlier releases did."""
    return {name: value for name, value in state._asdict().items() if value is not None}


def _from_disk(tree: dict, abstract_state):
    """The TrainState of a restored ``_on_disk`` tree; a field the checkpoint does not hold is ``None``."""
    return type(abstract_state)(**{name: tree.get(name) for name in abstract_state._fields})
