"""Which computation made a run's steps, kept in ``<model_dir>/computation.json``.

A run is the computation that made it. Owns that file, a JSON list with one
entry per training call that trained with a computation other than the
entry before (``{"from_step": s, **Computation}``: the steps after ``s``
were trained by it); the computation that made a step; the one line a
training call says when it continues a run with another computation (it
continues: a new learning rate for the rest of a run is a real need; the
checkpoints it writes are the new computation's); and whether an
evaluation may go into the run's history as the run's own (the model, loss
and metrics in eval mode decide, not the optimizer). Does not own the
fingerprint itself (``fingerprint.py``) nor the rest of the run directory
(``run_dir.py``). A run without the file (trained by an earlier release)
is taken as made by whatever evaluates it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import jax

from estimax import storage
from estimax.fingerprint import Computation, differences, evaluation_differences

logger = logging.getLogger("estimax")

FILE = "computation.json"


def history(run_dir) -> list[tuple[int, Computation]]:
    """``[(from_step, computation), ...]`` of the run, oldest first; none without a model_dir or the
    file (a damaged file is said once and read as none)."""
    if run_dir.url is None:
        return []
    path = storage.join(run_dir.url, FILE)
    if not storage.exists(path):
        return []
    try:
        entries = json.loads(storage.read_bytes(path))
        found = [(int(e["from_step"]), Computation.from_json(e)) for e in entries]
    except (ValueError, TypeError, KeyError) as error:
        logger.warning("%s is damaged (%s): its run is taken as made by any computation.", path, error)
        return []
    return [(step, computation) for step, computation in found if computation is not None]


def made(entries: list[tuple[int, Computation]], step: int) -> Computation | None:
    """The computation that trained ``step`` (the last entry from before it), ``None`` when unknown."""
    before = [computation for start, computation in entries if start < step]
    return before[-1] if before else None


def continuing(run_dir, start: int, computation: Callable[[], Computation | None] | None) -> None:
    """Before a training call trains from ``start``: says in one line when the state there was made by
    another computation, and (process 0, holding the run's lock) records ``computation()`` from ``start``
    on. Nothing is traced without a model_dir."""
    if computation is None or run_dir.url is None:
        return
    now = computation()
    if now is None:
        return
    entries = history(run_dir)
    before = made(entries, start)
    if before is not None and (changed := differences(before, now)):
        logger.warning(
            "Continuing step %d of %s with another computation (%s): training goes on, and the checkpoints "
            "from here are this computation's; for a new experiment use another model_dir (with WarmStart).",
            start, run_dir.url, changed,
        )  # fmt: skip
    if jax.process_index() != 0 or (entries and entries[-1][1] == now and entries[-1][0] <= start):
        return
    kept = [(s, c) for s, c in entries if s < start]  # what a later start trained again is this call's now
    written = [{"from_step": s, **c.to_json()} for s, c in [*kept, (start, now)]]
    storage.write_bytes(storage.join(run_dir.url, FILE), json.dumps(written, indent=1).encode())


def foreign(run_dir, step: int, traced: Callable[[object], Computation | None]) -> str:
    """What differs between what evaluating ``step`` of the run computed in the computation that made it
    and in this one (``traced(batch)``: this Estimator's computation on a recorded batch; its optimizer
    does not count), ``""`` when it is the same or unknown."""
    before = made(history(run_dir), step)
    if before is None:
        return ""
    now = traced(before.batch)
    return "" if now is None else evaluation_differences(before, now)


def own_evaluation(run_dir, step: int, checkpoint, traced: Callable[[object], Computation | None]) -> bool:
    """Whether an evaluation of the run's ``step`` goes into the run's history as the run's own: not
    when this Estimator computes otherwise than what made the step, which is said in one line (the
    results are still returned). ``checkpoint``: as the call was given it; a path is another run's."""
    if isinstance(checkpoint, str):
        return True
    changed = foreign(run_dir, step, traced)
    if changed:
        logger.warning(
            "The evaluation of step %d is not written into %s's history: this code evaluates otherwise than the "
            "code that trained that step (%s), so these results are this code's on its weights, not the run's own.",
            step, run_dir.url, changed,
        )  # fmt: skip
    return not changed
