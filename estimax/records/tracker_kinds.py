"""The experiment trackers a run can name, and how each one writes.

Owns the settings objects (``MLflow``), the names ``RunConfig(trackers=...)``
and ``--trackers`` take (``TRACKERS``), turning what a user gave into settings
objects (``resolve``, run by ``RunConfig``), each tracker's writer
(``MLflowWriter``), and what a writer gets from its run (``RunContext``: the
configuration to log, the run ids kept in model_dir). Imports no JAX and no
tracker library: a library is an optional extra (``estimax[mlflow]``), looked
for when a tracker is named and imported only when its writer starts. Which
writers a run gets and the parameters they log are ``trackers.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence

from estimax import storage
from estimax.errors import ConfigError, ConfigTypeError, MissingLibraryError, WriterError

logger = logging.getLogger("estimax")


@dataclasses.dataclass(frozen=True)
class MLflow:
    """MLflow settings.

    Attributes:
      tracking_uri: a tracking server (``http://host:5000``), a database URI, or a
        local directory (runs go to ``<dir>/mlflow.db``, for ``mlflow ui
        --backend-store-uri sqlite:///<dir>/mlflow.db``); ``None``: MLflow's own
        default (``MLFLOW_TRACKING_URI``, else ``./mlflow.db``).
      experiment: the experiment the run belongs to (created if missing).
      run_name: default: the model_dir's name.
    """

    tracking_uri: str | None = None
    experiment: str = "estimax"
    run_name: str | None = None

    def __post_init__(self):
        if importlib.util.find_spec("mlflow") is None:  # at configuration, not after the first steps
            raise _missing("mlflow", "mlflow")

    def writer(self, run: RunContext):
        return MLflowWriter(self, run)


TRACKERS = {"mlflow": MLflow}
"""The trackers by the name ``--trackers`` and ``RunConfig`` take."""

SERVER_PATIENCE = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}
"""How long MLflow's client waits for a tracking server: 2 retries, 10 s each, 1 s backoff factor."""


def resolve(trackers: Sequence) -> tuple:
    """``RunConfig.trackers`` as settings objects: ``"mlflow"``, ``"mlflow=URI"`` or ``MLflow(...)``."""
    if isinstance(trackers, str) or hasattr(trackers, "writer"):
        trackers = (trackers,)
    resolved = []
    for tracker in trackers:
        if isinstance(tracker, str):
            name, _, value = tracker.partition("=")
            if name not in TRACKERS:
                raise ConfigError(
                    f"RunConfig(trackers=...) received {tracker!r}; expected one of {', '.join(TRACKERS)} "
                    "(optionally mlflow=URI), or estimax.trackers.MLflow(...)."
                )
            tracker = TRACKERS[name](value) if value else TRACKERS[name]()
        elif not hasattr(tracker, "writer"):
            raise ConfigTypeError(
                f"RunConfig(trackers=...) received {tracker!r}; expected 'mlflow', 'mlflow=URI' or "
                "estimax.trackers.MLflow(...)."
            )
        resolved.append(tracker)
    return tuple(resolved)


def _missing(library: str, extra: str) -> MissingLibraryError:
    return MissingLibraryError(
        f"RunConfig(trackers=...) names {extra}, whose library {library} is not installed. "
        f"Fix: pip install 'estimax[{extra}]', or leave {extra} out of the trackers."
    )


@dataclasses.dataclass
class RunContext:
    """What a tracker writer needs from its run: the configuration to log as parameters, the
    run's name, and the run ids shared by every writer of one Estimator, kept in ``ids_file``
    (the run directory's ``trackers.json``; ``None`` without a model_dir)."""

    name: str
    parameters: dict
    run_ids: dict  # tracker name -> run id
    ids_file: str | None = None

    def run_id(self, tracker: str) -> str | None:
        if tracker not in self.run_ids and self.ids_file:
            with contextlib.suppress(FileNotFoundError):
                self.run_ids.update(json.loads(storage.read_bytes(self.ids_file)))
        return self.run_ids.get(tracker)

    def remember(self, tracker: str, run_id: str) -> None:
        self.run_ids[tracker] = run_id
        if self.ids_file:
            storage.write_bytes(self.ids_file, json.dumps(self.run_ids).encode())


class MLflowWriter:
    """Logs to one MLflow run through ``MlflowClient`` (no global active run)."""

    def __init__(self, settings: MLflow, run: RunContext):
        from mlflow.tracking import MlflowClient

        uri = settings.tracking_uri
        if uri and "://" not in uri and not uri.startswith("databricks"):  # a local directory
            os.makedirs(uri, exist_ok=True)
            uri = f"sqlite:///{os.path.abspath(os.path.join(uri, 'mlflow.db'))}"
        if uri and uri.startswith(("http://", "https://")):
            # MLflow's defaults retry an unreachable server for about 4 minutes (7 retries, a 120 s
            # timeout each); a few seconds tell as much. Settings of the user's own win.
            for name, value in SERVER_PATIENCE.items():
                os.environ.setdefault(name, value)
        self.client = MlflowClient(tracking_uri=uri)
        try:
            self._start(settings, run)
        except Exception as error:
            raise WriterError(
                f"MLflow at {uri or 'its default tracking URI'} did not start a run: {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}. Fix: start the tracking server or correct "
                "MLflow(tracking_uri=...), or leave MLflow out of RunConfig(trackers=...)."
            ) from error

    def _start(self, settings: MLflow, run: RunContext) -> None:
        self.run_id = run.run_id("mlflow")
        if self.run_id is not None and self._exists(self.run_id):
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(settings.experiment)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(settings.experiment)
            )
            self.run_id = self.client.create_run(experiment_id, run_name=settings.run_name or run.name).info.run_id
            run.remember("mlflow", self.run_id)
        self._log_parameters(run.parameters)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def _log_parameters(self, parameters: dict) -> None:
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in parameters.items() if k in logged and logged[k] != v)
        if changed:  # MLflow parameters cannot change: the run keeps its first values
            logger.warning("MLflow run %s keeps its first values of %s (this run differs).", self.run_id, changed)
        new = [Param(k, v[:6000]) for k, v in parameters.items() if k not in logged]
        for start in range(0, len(new), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=new[start : start + 100])

    def write(self, split: str, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{split}/{name}", float(value), now, step) for name, value in values.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
