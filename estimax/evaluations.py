"""Evaluations: an Estimator's evaluation sets evaluated on a state, as its verbs ask for it.

Owns what ``evaluate``, ``evaluate_states``, ``train_and_evaluate`` and ``follow`` add around the
``Evaluator``: the state a verb reads, with the weights ``RunConfig(eval_weights=...)`` chooses;
each named set checked before any runs; the Estimator's host metrics unless a call gives its
own; ``ema_decay`` beside the results of the average; and, for ``evaluate``, the results
recorded under each set's split where the run's own computation made the state. Does not own
the evaluation itself (``evaluator.py``), which sets an input names (``eval_sets.py``), which
state is current (``run/current_state.py``) nor where records go (``hooks/call_writers.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from estimax import eval_sets
from estimax.checks import calls
from estimax.evaluator import Evaluator
from estimax.fine_tuning import averaging
from estimax.hooks.call_writers import CallWriters
from estimax.metrics import Metric
from estimax.metrics import host_metrics as host_metrics_lib
from estimax.run import run_computation


class Evaluations:
    """The evaluations of one Estimator.

    Args:
      evaluator: the Estimator's ``Evaluator``; config: its ``RunConfig``.
      writers: its ``CallWriters`` (an evaluation's record); host_metrics: ``Estimator(host_metrics=...)``.
      checks: its ``ModeChecks``; run_dir: its ``RunDir`` (or ``NoRunDir``); current: its ``CurrentState``.
    """

    def __init__(
        self,
        evaluator: Evaluator,
        config,
        writers: CallWriters,
        host_metrics: Callable | None,
        checks,
        run_dir,
        current,
    ):
        self.evaluator, self.config, self.writers, self.host_metrics = evaluator, config, writers, host_metrics
        self.checks, self.run_dir, self.current = checks, run_dir, current

    def state_at(self, checkpoint: int | str | None, what: str):
        """The state a verb uses, its ``params`` the weights ``RunConfig.eval_weights`` chooses."""
        calls.check_step(self.run_dir.checkpoints, checkpoint, what)
        return averaging.chosen(self.current.at(checkpoint, what), averaging.evaluates_average(self.config))

    def evaluate(self, input, *, steps=None, checkpoint=None, host_metrics=None) -> dict:
        """``Estimator.evaluate``: each set of ``input`` checked, then evaluated on the state of ``checkpoint``."""
        host_metrics_lib.check(host_metrics)
        sets = eval_sets.named(input, "evaluate(input=...)")
        sets = {name: self.checks.evaluate(one) for name, one in sets.items()}  # all checked before any runs
        state = self.state_at(checkpoint, "evaluate")
        step = int(jax.device_get(state.step))  # host sync: the step of the state evaluated
        own = run_computation.own_evaluation(self.run_dir, step, checkpoint, self.checks.computation_on)
        results = {
            name: self.one_set(name, one, state, steps=steps, host_metrics=host_metrics, record=own)
            for name, one in sets.items()
        }
        return eval_sets.returned(results)

    def states(self, input, *, steps=None, checkpoint=None) -> dict[str, Metric] | dict[str, dict[str, Metric]]:
        """``Estimator.evaluate_states``: the merged metric states of each set of ``input``."""
        sets = eval_sets.named(input, "evaluate_states(input=...)")
        sets = {name: self.checks.evaluate(one) for name, one in sets.items()}
        state = self.state_at(checkpoint, "evaluate")
        states = {name: self.evaluator.states(one, state, steps=steps, name=name)[0] for name, one in sets.items()}
        return eval_sets.returned(states)

    def one_set(
        self,
        name: str | None,
        input,
        state,
        *,
        steps: int | None = None,
        should_stop: Callable | None = None,
        host_metrics: Callable | None = None,
        record: bool = False,
    ) -> dict[str, float] | None:
        """The exact metrics of ONE evaluation set on ``state`` (a ``TrainState``); ``None`` if
        ``should_stop()`` interrupted it. ``name``: the set's (``None``: the unnamed input, split
        ``eval``); ``input``: as ``ModeChecks.evaluate(input)`` returned it (a plain iterator's
        first batch put back); ``record``: also write the results under the set's split (console,
        metrics.jsonl, TensorBoard, trackers), as ``evaluate`` does (training's evaluations are
        written by its own records instead)."""
        if name is not None:
            eval_sets.check_name(name, "the evaluation set")
        average = averaging.evaluates_average(self.config)
        results = self.evaluator.results(
            input,
            averaging.chosen(state, average),
            steps=steps,
            should_stop=should_stop,
            host_metrics=host_metrics or self.host_metrics,
            name=name,
        )
        if results is not None and average:  # the records say which weights were evaluated
            results = {**results, "ema_decay": self.config.ema_decay}
        if record and results is not None:
            step = int(jax.device_get(state.step))  # host sync: the step of the state evaluated
            self.writers.record_evaluation(step, results, eval_sets.split_of(name))
        return results
