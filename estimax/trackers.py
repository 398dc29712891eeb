"""Experiment trackers: the records of ``metrics.jsonl`` also in MLflow.

``RunConfig(trackers=("mlflow",))`` (or ``"mlflow=URI"``, or the settings
object ``MLflow(...)``) adds a writer per tracker: train records, evaluations and the final summary
become metrics named ``<split>/<name>`` at their step, and the run's
configuration (``RunConfig`` and the model's ``params``) its parameters.
One tracker run per model_dir: its id is kept in ``<model_dir>/trackers.json``
(``run_dir.py`` names the file), so a resumed ``train`` and a later
``evaluate`` log to the same run.

Owns the writers of a run's trackers and the parameters they log. The
trackers themselves (settings, names, each one's writer, the run ids they
share) are ``records/tracker_kinds.py``'s, re-exported here. Does not own when
records are written (``hooks/metric_logger.py``), nor which process writes (only
process 0, when it may write into model_dir: ``hooks/call_writers.py``). A tracker
is a settings object with ``writer(run) -> Writer``: ``TRACKERS`` names them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from estimax.records.tracker_kinds import SERVER_PATIENCE, TRACKERS, MLflow, MLflowWriter, RunContext, resolve

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


def writers(config, params: Mapping, run_ids: dict, run_dir) -> list:
    """One writer per tracker of ``config`` (a ``RunConfig``); ``params``: the model's hyper-parameters;
    ``run_dir``: the run's ``RunDir`` (or ``NoRunDir``)."""
    if not config.trackers:
        return []
    from estimax.records.writer_thread import InBackground

    run = RunContext(run_dir.name, run_parameters(config, params), run_ids, run_dir.trackers_file)
    return [InBackground(tracker.writer(run), repr(tracker)) for tracker in config.trackers]


def run_parameters(config, params: Mapping) -> dict:
    """The run's configuration as flat text: RunConfig fields and ``params.<name>``."""
    flat = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            flat.update({f"{field.name}.{k}": v for k, v in dataclasses.asdict(value).items()})
        elif field.name != "trackers":
            flat[field.name] = value
    flat.update({f"params.{k}": v for k, v in params.items()})
    return {k: str(v) for k, v in flat.items()}
