"""Preemption: a SIGTERM, SIGINT or SIGUSR1 during training becomes a save and a clean exit.

Owns noticing the signal and deciding, at a loop boundary, that training must
stop. The training loop then saves, waits for the save, and raises
``Preempted``: a ``SystemExit`` with code ``PREEMPTED_EXIT_CODE`` (75,
``EX_TEMPFAIL``: "temporary failure, run me again"), which schedulers and
``estimax launch`` treat as "requeue from the latest checkpoint".

At an interactive prompt (``python -i``, IPython, Jupyter) a Ctrl-C instead
raises ``Interrupted``, a ``KeyboardInterrupt`` that leaves the interpreter
running and the trained state in memory; a script or the CLI still exits 75.

SIGUSR1 is SLURM's notice before the end of a job's time (``sbatch
--signal=USR1@90``): it is treated as SIGTERM, so that the job saves and is
requeued. With one process, estimax installs its own handlers for the
duration of ``train``. With several, JAX's preemption sync service (started
by ``jax.distributed.initialize``) notices SIGTERM, and every process stops
at the same step; a SIGUSR1 is handed to it as a SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import jax

from estimax.errors import PREEMPTED_EXIT_CODE

logger = logging.getLogger("estimax")


class Preempted(SystemExit):
    """Training stopped on a signal at ``step``; ``saved_to`` is the checkpoint directory that
    holds that step, or ``None`` when nothing was saved (no model_dir)."""

    def __init__(self, step: int, signal_name: str, saved_to: str | None = None):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.signal_name, self.saved_to = step, signal_name, saved_to

    def __str__(self) -> str:
        return f"{_stopped(self.step, self.signal_name, self.saved_to)}; exit code {PREEMPTED_EXIT_CODE} " + (
            "(run the same command again to resume)." if self.saved_to else "(RunConfig(model_dir=None))."
        )


class Interrupted(KeyboardInterrupt):
    """Ctrl-C at an interactive prompt stopped training at ``step``; the Estimator keeps the
    trained state in memory (``saved_to``: as for ``Preempted``)."""

    def __init__(self, step: int, signal_name: str, saved_to: str | None = None):
        super().__init__(step, signal_name, saved_to)
        self.step, self.signal_name, self.saved_to = step, signal_name, saved_to

    def __str__(self) -> str:
        return (
            f"{_stopped(self.step, self.signal_name, self.saved_to)}. The trained state stays in memory "
            f"(estimator.step == {self.step}): train() again continues from it."
        )


def _stopped(step: int, signal_name: str, saved_to: str | None) -> str:
    saved = f"after saving a checkpoint of it to {saved_to}" if saved_to else "without saving (no model_dir)"
    return f"{signal_name}: training stopped at step {step} {saved}"


def stopped(step: int, signal_name: str, saved_to: str | None) -> Preempted | Interrupted:
    """The exception that ends a train call on a signal: ``Interrupted`` for a Ctrl-C at an
    interactive prompt, else ``Preempted`` (exit code 75)."""
    if signal_name == "SIGINT" and interactive():
        return Interrupted(step, signal_name, saved_to)
    return Preempted(step, signal_name, saved_to)


def interactive() -> bool:
    """Whether a person types at a Python prompt: ``python -i``, the REPL, IPython or Jupyter."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    ipython = sys.modules.get("IPython")
    return ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None


class PreemptionWatch:
    """While active, remembers a SIGTERM/SIGINT instead of dying on it.

    A second SIGINT (Ctrl-C twice) is one line: the stop and the save are under way. A third
    raises ``KeyboardInterrupt`` at once, without the save. A signal that no training loop
    answered (the call had nothing to train) is raised again once the previous handlers are back.
    """

    _SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, saves: bool = True):
        self.signal_name: str | None = None
        self.saves = saves  # whether training saves a checkpoint before it stops (a model_dir)
        self._previous: dict = {}
        self._repeats = 0  # SIGINTs after the first

    def __enter__(self) -> PreemptionWatch:
        # Handlers can only be set from the main thread; JAX handles SIGTERM itself across processes.
        if threading.current_thread() is not threading.main_thread():
            return self
        if jax.process_count() == 1:
            self._previous = {s: signal.signal(s, self._handle) for s in self._SIGNALS}
        else:  # JAX's preemption sync listens for SIGTERM only
            self._previous = {signal.SIGUSR1: signal.signal(signal.SIGUSR1, _as_sigterm)}
        return self

    def __exit__(self, error_type, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        if error_type is None and self.signal_name is not None:  # a loop answers with Preempted or Interrupted
            signal.raise_signal(signal.Signals[self.signal_name])

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            self._repeats += 1
            if self._repeats > 1:
                raise KeyboardInterrupt
            logger.warning("SIGINT again: already stopping%s; a third Ctrl-C quits without it.",
                           " and saving" if self.saves else "")  # fmt: skip
            return
        self.signal_name = signal.Signals(signum).name
        then = "returning to the prompt" if signum == signal.SIGINT and interactive() else "exiting"
        then = f"saving and {then}" if self.saves else f"{then} (no model_dir: nothing is saved)"
        logger.warning("%s received: finishing the current loop, then %s.", self.signal_name, then)

    def requested(self, step: int, since: int | None = None) -> bool:
        """Whether training must stop after ``step`` (the same answer on every process).

        ``since``: the step before the loop that just ran (default ``step - 1``).
        """
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            # JAX's sync point is the largest step any process had reported when the notice
            # came, plus one; Orbax reports steps too (at every save). A loop advances by
            # steps_per_loop, so every step of it is reported, or the sync point is skipped.
            first = step if since is None else since + 1
            if any([multihost_utils.reached_preemption_sync_point(s) for s in range(first, step + 1)]):
                self.signal_name = self.signal_name or "SIGTERM"
                return True
            return False
        return self.signal_name is not None


def _as_sigterm(signum, frame) -> None:
    logger.warning("SIGUSR1 received: handled as SIGTERM (save, then exit for requeue).")
    os.kill(os.getpid(), signal.SIGTERM)
