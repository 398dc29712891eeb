"""Exact evaluation and prediction of one state over one input, on every device.

Owns the host side of both: global batches padded and masked (every example
counted once), prefetched to the devices, the compiled evaluation and
prediction steps (``loop.EvalRunner``, built on first use), the progress bar,
merging metric states into results, a ``host_metrics`` function over every
example's outputs, and prediction rows in input order. Does not own which
state is evaluated (``current_state.py``) nor where results are written
(``call_writers.py``).

A failure of the user's code inside an evaluation (the input, a metric's
``compute``, a ``host_metrics`` function) becomes one ``EvaluationError``
naming which, so that training can save its state and say what broke.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator

import jax

from estimax import counting, eval_sets
from estimax import mesh as mesh_lib
from estimax import metrics as metrics_lib
from estimax.data import feed
from estimax.data.source import SizedSource
from estimax.errors import EstimaxError, EvaluationError, InputError, one_line
from estimax.hooks.progress import EvalProgress
from estimax.loop import EvalRunner
from estimax.metrics import host_metrics as host_metrics_lib
from estimax.spec import EVAL, PREDICT
from estimax.state import has_deleted_arrays


def _where(fn) -> str:
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def _named_host_metrics(host_metrics: Callable) -> Callable:
    """``host_metrics`` whose own errors name it, and for a missing key, the keys its outputs hold."""

    @functools.wraps(host_metrics)
    def call(outputs):
        try:
            return host_metrics(outputs)
        except EstimaxError:
            raise
        except Exception as error:
            keys = f"; its outputs hold the keys {sorted(outputs)}" if isinstance(error, KeyError) else ""
            raise EvaluationError(
                f"The host_metrics function {_where(host_metrics)} raised {one_line(error)}{keys}. "
                "Fix: correct that function (outputs holds the Spec(eval_outputs=...) arrays of every example)."
            ) from error

    return call


def _metric_results(name: str, state) -> dict[str, float]:
    try:
        return metrics_lib.results(name, state)
    except EstimaxError:
        raise
    except Exception as error:
        raise EvaluationError(
            f"The compute() of metric {name!r} ({type(state).__name__}) raised {one_line(error)}. "
            "Fix: correct that metric's compute (it receives the state merged over every evaluation batch)."
        ) from error


def _check_not_donated(state, step: int) -> None:
    """A prediction generator continued after train() moved the state it predicts with."""
    if has_deleted_arrays(state.params):
        raise EvaluationError(
            f"This predict() generator predicts with the state of step {step}, whose arrays train() has "
            "since given to training (they are donated, not copied). Fix: finish iterating before training, "
            "e.g. `list(est.predict(x))`, or call predict() again after train() for the new state."
        )


class Evaluator:
    """Evaluates and predicts for an Estimator.

    ``plan``: the Estimator's ``InputPlan``, which gives the batches; ``quiet``: no progress bar.
    """

    def __init__(self, core, layout, plan, quiet: bool):
        self.core, self.layout, self.plan, self.quiet = core, layout, plan, quiet
        self._runner: EvalRunner | None = None

    @property
    def runner(self) -> EvalRunner:
        if self._runner is None:
            self._runner = EvalRunner(self.core, self.layout)
        return self._runner

    def results(
        self, input, state, *, steps=None, should_stop=None, host_metrics: Callable | None = None, name=None
    ) -> dict[str, float] | None:
        """The metrics of ``state`` on ``input`` (``num_examples`` last); ``None`` if ``should_stop()``
        interrupted it. ``name``: the evaluation set's, which the progress bar and errors show."""
        totals, rows = self.states(
            input, state, steps=steps, should_stop=should_stop, rows=bool(host_metrics), name=name
        )
        if totals is None:
            return None
        results = {}
        for name in sorted(totals, key=lambda n: n == metrics_lib.NUM_EXAMPLES):
            results.update(_metric_results(name, totals[name]))
        if host_metrics is not None:
            results.update(host_metrics_lib.results(_named_host_metrics(host_metrics), rows.rows(), results))
        return results

    def states(self, input, state, *, steps=None, should_stop=None, rows: bool = False, name=None):
        """``(metric states by name, OutputRows or None)``; ``(None, None)`` if ``should_stop()``
        interrupted it. ``name``: the evaluation set's (``None``: the one unnamed input)."""
        device_batches = self.plan.eval_batches(input, EVAL)
        if steps is not None:
            device_batches = itertools.islice(device_batches, steps)
        outputs = host_metrics_lib.OutputRows() if rows else None
        with feed.Prefetch(device_batches) as device_batches:
            bar = self._bar(input, self.plan.global_batch(EVAL), steps, eval_sets.split_of(name))
            try:
                totals = self.runner.totals(state, bar.wrap(device_batches), should_stop, outputs)
            finally:
                bar.close()
        if totals is None:
            if should_stop is not None and should_stop():
                return None, None
            what = "Evaluation input" if name is None else f"Evaluation set {name!r}"
            raise InputError(
                f"{what} yielded no batches; expected at least one example. "
                "Fix: pass an evaluation input that is not empty."
            )
        return totals, outputs

    def predict(self, input, state, gather: bool) -> Iterator:
        """One prediction per example, in input order (see ``Estimator.predict``)."""
        rows = mesh_lib.gathered_rows if gather and jax.process_count() > 1 else mesh_lib.rows
        pending, step = None, int(jax.device_get(state.step))
        device_batches = self.plan.eval_batches(input, PREDICT)
        with feed.Prefetch(device_batches) as device_batches:
            for db in device_batches:
                _check_not_donated(state, step)
                predictions = self.runner.predict(state, db.batch)
                if pending is not None:  # the host reads a batch once the next one is dispatched
                    yield from rows(*pending)
                pending = (predictions, db.num_valid)
        if pending is not None:
            yield from rows(*pending)

    def _bar(self, input, batch_size: int, steps: int | None, desc: str) -> EvalProgress:
        shown = counting.progress_bar_shows(self.quiet)
        total = -(-len(input) // batch_size) if isinstance(input, SizedSource) else None
        return EvalProgress(min(filter(None, (total, steps)), default=None), shown, desc)
