"""Which TrainState an Estimator holds, where it came from, and whether it was trained.

Owns the state's provenance: ``initial``, ``warm_start``, ``restored`` or
``trained``; reloading the run directory's newest good checkpoint when it is
newer than what is in memory; the input position and device-loop mode a
restored checkpoint carries; the state of an explicit ``checkpoint=`` (a step
of the run or a path); and the one warning when untrained weights are used.
Does not own where arrays live (``layout.py``), how checkpoints are written
(``checkpoint.py``) nor where (``run_dir.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from estimax.errors import EstimaxError
from estimax.run import checkpoint as checkpoint_lib
from estimax.run import run_setup
from estimax.state import has_deleted_arrays


class UntrainedWarning(UserWarning):
    """evaluate, predict or model() used the initial weights: nothing was trained or restored."""


class CurrentState:
    """The state of one Estimator.

    Args:
      run_dir: the run's ``RunDir`` (or ``NoRunDir``), whose checkpoints are reloaded when newer.
      shapes: ``() -> ShapeDtypeStruct`` tree with shardings, the target of every restore.
      initialise: ``() -> TrainState``, a fresh state placed in its shardings.
      warm_start: a ``WarmStart`` applied to a fresh state, or ``None``.
      run_meta: this run's setup (``run_setup.record``), compared with a restored checkpoint's.
    """

    def __init__(self, run_dir, shapes: Callable, initialise: Callable, warm_start=None, run_meta: dict | None = None):
        self.run_dir, self.shapes, self.initialise = run_dir, shapes, initialise
        self.warm_start, self.run_meta = warm_start, run_meta or {}
        self.state = None
        self.step: int = 0
        self.input_state = None  # the input position a restored checkpoint or the last loop left
        self.origin: str | None = None  # "initial", "warm_start", "restored" or "trained"
        self.loop: str | None = None  # the device loop ("scan" or "step") the restored checkpoint was trained with
        self.restored: dict | None = None  # the metadata of the checkpoint last restored (its run record, ...)
        self._seen_latest: int | None = None
        self._warned = False

    def current(self):
        """The newest good checkpoint of the run if newer than what is in memory, else what is in
        memory, else a fresh initialisation (warm-started if asked)."""
        checkpoints = self.run_dir.checkpoints
        latest = checkpoints.latest_step()
        if latest is not None and latest != self._seen_latest and (self.state is None or latest > self.step):
            self._seen_latest = latest
            self.state, meta = checkpoints.restore(self.shapes())
            self.step, self.input_state, self.origin = meta["step"], meta.get("input_state"), "restored"
            self.loop, self.restored = meta.get("loop"), meta
            run_setup.warn_on_resume(meta.get("run"), self.run_meta, self.step, checkpoints.directory)
        elif self.state is None:
            self.state, self.step, self.origin = self.initialise(), 0, "initial"
            if self.warm_start is not None:
                self.state, self.origin = self.warm_start.apply(self.state), "warm_start"
        elif has_deleted_arrays(self.state):
            raise EstimaxError(
                f"The Estimator's state of step {self.step} has arrays that were deleted or donated outside "
                "estimax (e.g. est.state() passed to a jax.jit with donate_argnums); expected the arrays it "
                "holds. Fix: pass a copy, `jax.tree.map(jnp.copy, est.state())`, or restore a checkpoint "
                "with a new Estimator."
            )
        return self.state

    def publish(self, state, step: int, input_state) -> None:
        """What training just produced becomes the current state (also when an error stops it)."""
        self.state, self.step, self.input_state, self.origin = state, step, input_state, "trained"

    def at(self, checkpoint: int | str | None, what: str):
        """The current state, or that of ``checkpoint``: a step of the run, or a path."""
        if checkpoint is None:
            state = self.current()
            self._warn_if_untrained(what)
            return state
        if isinstance(checkpoint, int) and not isinstance(checkpoint, bool):
            checkpointer, step = self.run_dir.checkpoints, checkpoint
        else:
            checkpointer, step = checkpoint_lib.locate(checkpoint)
        return checkpointer.restore(self.shapes(), step)[0]

    def _warn_if_untrained(self, what: str) -> None:
        if self.origin != "initial" or self._warned:
            return
        self._warned = True
        warnings.warn(
            f"Estimator.{what}() uses the initial, untrained weights: {self.run_dir.no_checkpoint()} and this "
            "Estimator has not trained. Fix: train() first, set model_dir to a trained run, or pass "
            "checkpoint=<step or path>.",
            UntrainedWarning,
            stacklevel=4,
        )
