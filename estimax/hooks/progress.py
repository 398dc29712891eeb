"""Live progress bars for terminals (tqdm): training, updated once per loop,
and evaluation, updated once per batch.

The training bar reads "compiling" until the first loop has run, then shows
step / total, the epoch when an epoch's length is known, a smoothed loss,
steps/s, examples/s, the input-wait fraction and tqdm's ETA; it is closed at
100% when training reaches its target, before the "Done" line. While it shows,
estimax's log lines print above it (through ``tqdm.write``), never onto it.
The evaluation bar shows batches / total when the input's size is known.
Used when stderr is a terminal or in a notebook (one output per call, redrawn
in place: a widget with ``ipywidgets``, else text); elsewhere (CI, files) the
console writer's plain lines say the same.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import warnings

from estimax import counting
from estimax.hooks import Hook, LoopRecord, RunInfo, Summary


class ProgressBar(Hook):
    may_stop = False  # it only shows: training dispatches the next loop before it reads the last

    def __init__(self, global_batch_size: int, smoothing: float = 0.9):
        self.global_batch_size = global_batch_size
        self.smoothing = smoothing
        self._bar = None

    def begin(self, run: RunInfo) -> None:
        tqdm = _tqdm()
        self._run, self._loss = run, None
        self._logs_above = _logs_above_bars()
        self._bar = tqdm(
            total=run.target_step, initial=run.start_step, unit="step", dynamic_ncols=True, desc="compiling"
        )

    def after_loop(self, loop: LoopRecord) -> None:
        if self._bar is None:
            return
        self._bar.set_description("train", refresh=False)
        losses = [x for x in loop.outputs.get("loss", ()) if math.isfinite(x)]
        for loss in losses:
            self._loss = loss if self._loss is None else self.smoothing * self._loss + (1 - self.smoothing) * loss
        postfix = {}
        if self._run.steps_per_epoch:
            postfix["epoch"] = f"{loop.step_after / self._run.steps_per_epoch:.2f}"
        if self._loss is not None:
            postfix["loss"] = f"{self._loss:.4g}"
        if loop.seconds:
            steps_per_sec = loop.num_steps / loop.seconds
            postfix.update(
                steps_s=f"{steps_per_sec:.1f}",
                ex_s=f"{steps_per_sec * self.global_batch_size:.0f}",
                input_wait=f"{loop.input_wait_seconds / loop.seconds:.0%}",
            )
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(loop.num_steps)
        if loop.step_after >= self._run.target_step:  # done: the bar ends at 100%, above the "Done" line
            self._close()

    def end(self, summary: Summary) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            self._logs_above.close()


def _logs_above_bars() -> contextlib.ExitStack:
    """Sends estimax's console log lines through ``tqdm.write`` (above the bars) until closed."""
    with warnings.catch_warnings():  # tqdm.contrib imports tqdm.auto, which warns in a notebook without ipywidgets
        warnings.filterwarnings("ignore", message="IProgress not found")
        from tqdm.contrib.logging import logging_redirect_tqdm

    redirect = contextlib.ExitStack()
    estimax_logger = logging.getLogger("estimax")
    consoles = [
        h for h in estimax_logger.handlers if getattr(h, "stream", None) in (sys.stdout, sys.stderr)
    ]  # a logger set up otherwise is left as it is
    if consoles:
        redirect.enter_context(logging_redirect_tqdm([estimax_logger], tqdm_class=_tqdm()))
    return redirect


class EvalProgress:
    """A ``tqdm`` bar over evaluation batches when ``shown``; otherwise it passes them through.
    ``desc``: what the bar is labelled with (``eval``, or the evaluation set's name)."""

    def __init__(self, total: int | None, shown: bool, desc: str = "eval"):
        self._bar = None
        tqdm = _tqdm(nested=True) if shown else None
        if tqdm is not None:
            self._bar = tqdm(total=total, unit="batch", dynamic_ncols=True, desc=desc, leave=False)

    def wrap(self, batches):
        for batch in batches:
            yield batch
            if self._bar is not None:
                self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _tqdm(nested: bool = False):
    """tqdm's widget in a notebook where ``ipywidgets`` is installed; else its text bar, which a
    notebook redraws in place too (``tqdm.auto`` would warn there without ``ipywidgets``). ``None``
    for a ``nested`` bar in a notebook without widgets: text cannot move up to a second line there."""
    if counting.in_notebook():
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            if nested:
                return None
        else:
            from tqdm.notebook import tqdm

            return tqdm
    from tqdm.std import tqdm

    return tqdm
