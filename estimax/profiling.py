"""Profiling: a ``jax.profiler`` trace of chosen training steps, viewable in
TensorBoard's profile plugin or Perfetto.

``RunConfig(profile_steps=(A, B))`` traces the loops that run steps A to B
into ``<model_dir>/profile``; each loop is annotated with its first step.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile

import jax

from estimax import storage

logger = logging.getLogger("estimax")


class Profiler:
    def __init__(self, steps: tuple[int, int] | None, logdir: str | None):
        self.steps, self.logdir = steps, logdir
        self._active = False
        self._local = logdir

    def before_loop(self, step: int, state) -> None:
        if self.steps is None or self._active or not (self.steps[0] <= step < self.steps[1]):
            return
        jax.block_until_ready(state)  # host sync: the trace starts with this loop, not the previous one
        # The profiler writes local files: a trace for an object store is uploaded when it stops.
        self._local = tempfile.mkdtemp(prefix="estimax-profile-") if storage.is_url(self.logdir) else self.logdir
        jax.profiler.start_trace(self._local)
        self._active = True
        logger.info("Profiling steps %d-%d into %s", step, self.steps[1], self.logdir)

    def annotate(self, step: int):
        if not self._active:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation("train_loop", step_num=step)

    def after_loop(self, step: int, state) -> None:
        if self._active and step >= self.steps[1]:
            self.stop(state)

    def stop(self, state) -> None:
        if self._active:
            jax.block_until_ready(state)  # host sync: the traced loops must be in the trace
            jax.profiler.stop_trace()
            self._active = False
            if self._local != self.logdir:
                fs, inner = storage.filesystem(self.logdir)
                fs.put(self._local.rstrip("/") + "/", inner, recursive=True)
                shutil.rmtree(self._local, ignore_errors=True)
