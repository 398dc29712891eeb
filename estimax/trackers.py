"""Experiment trackers: the records of ``metrics.jsonl`` also in MLflow.

``RunConfig(trackers=("mlflow",))`` (or ``"mlflow=URI"``, or the settings
object ``MLflow(...)``) adds a writer per tracker: train records, evaluations and the final summary
become metrics named ``<split>/<name>`` at their step, and the run's
configuration (``RunConfig`` and the model's ``params``) its parameters.
One tracker run per model_dir: its id is kept in ``<model_dir>/trackers.json``
(``run_dir.py`` names the file), so a resumed ``train`` and a later
``evaluate`` log to the same run.

The public names of trackers, re-exported here: what they are and how each
writes (settings, names, each one's writer, the parameters they log, the run
ids they share) is ``records/tracker_kinds.py``'s; a run's writers
(``writers``) are ``hooks/call_writers.py``'s. Does not own when
records are written (``hooks/metric_logger.py``), nor which process writes (only
process 0, when it may write into model_dir: ``hooks/call_writers.py``). A tracker
is a settings object with ``writer(run) -> Writer``: ``TRACKERS`` names them.
"""

from __future__ import annotations

from estimax.hooks.call_writers import tracker_writers as writers
from estimax.records.tracker_kinds import (
    SERVER_PATIENCE,
    TRACKERS,
    MLflow,
    MLflowWriter,
    RunContext,
    resolve,
    run_parameters,
)

__all__ = [
    "MLflow",
    "MLflowWriter",
    "RunContext",
    "SERVER_PATIENCE",
    "TRACKERS",
    "resolve",
    "run_parameters",
    "writers",
]
