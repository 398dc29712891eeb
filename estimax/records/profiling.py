"""Profiling: a ``jax.profiler`` trace of chosen training steps, viewable in
TensorBoard's profile plugin or Perfetto.

``RunConfig(profile_steps=(A, B))`` traces every loop that runs a step of
``[A, B)`` into ``<model_dir>/profile``; each loop is annotated with its
first step. Steps are numbered as checkpoints count them: the loop from step
``s`` to ``t`` runs steps ``s + 1`` to ``t``. A loop is the unit of a trace,
so the trace starts at the first step of the first such loop and ends with
the last step of the last one. A window that no loop of the call reaches
is an error before the first step.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile

import jax

from estimax import storage
from estimax.errors import ConfigError

logger = logging.getLogger("estimax")


class Profiler:
    """Traces the loops of a train call from ``start`` to ``target`` that run a step of ``steps``."""

    def __init__(self, steps: tuple[int, int] | None, logdir: str | None, start: int = 0, target: int | None = None):
        self.steps, self.logdir = steps, logdir
        self._active = False
        self._local = logdir
        if steps is None:
            return
        first, last = steps[0], steps[1] - 1
        if logdir is None:
            raise ConfigError(
                f"RunConfig(profile_steps={steps}) writes a trace into <model_dir>/profile, and "
                "RunConfig(model_dir=None) has none. Fix: set model_dir, or profile_steps=None."
            )
        if target is not None and (last <= start or first > target):
            raise ConfigError(
                f"RunConfig(profile_steps={steps}) traces steps {first}-{last}, and this call trains steps "
                f"{start + 1}-{target}: no loop runs a step of the window. Fix: a window inside those "
                f"steps, e.g. profile_steps=({start + 1}, {min(start + 11, target + 1)}), or profile_steps=None."
            )

    def _runs_window(self, step_before: int, step_after: int) -> bool:
        """Whether the loop running steps ``step_before + 1`` to ``step_after`` runs a step of the window."""
        return self.steps[0] <= step_after and step_before + 1 < self.steps[1]

    def before_loop(self, step: int, step_after: int, state) -> None:
        if self.steps is None or self._active or not self._runs_window(step, step_after):
            return
        jax.block_until_ready(state)  # host sync: the trace starts with this loop, not the previous one
        # The profiler writes local files: a trace for an object store is uploaded when it stops.
        self._local = tempfile.mkdtemp(prefix="estimax-profile-") if storage.is_url(self.logdir) else self.logdir
        jax.profiler.start_trace(self._local)
        self._active = True
        first, last = self.steps[0], self.steps[1] - 1
        logger.info("Profiling from step %d (window %d-%d) into %s", step + 1, first, last, self.logdir)

    def annotate(self, step: int):
        if not self._active:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation("train_loop", step_num=step)

    def after_loop(self, step: int, state) -> None:
        if self._active and step + 1 >= self.steps[1]:  # the next loop starts at step + 1: past the window
            self.stop(state)

    def stop(self, state) -> None:
        if self._active:
            jax.block_until_ready(state)  # host sync: the traced loops must be in the trace
            jax.profiler.stop_trace()
            self._active = False
            logger.info("Wrote the profiler trace to %s", self.logdir)
            if self._local != self.logdir:
                fs, inner = storage.filesystem(self.logdir)
                fs.put(self._local.rstrip("/") + "/", inner, recursive=True)
                shutil.rmtree(self._local, ignore_errors=True)
