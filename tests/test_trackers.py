"""Experiment trackers: a run read back with MLflow's own client from a local store."""

import importlib.util
import json
import os

import numpy as np
import pytest
from models import blobs, estimator

import estimax as ex
from estimax import trackers
from estimax.errors import WriterError


def test_mlflow_run_holds_the_records_of_metrics_jsonl(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store, model_dir = str(tmp_path / "mlruns"), str(tmp_path / "run")
    est = estimator(
        model_dir,
        train_batch_size=16,
        steps_per_loop=2,
        loop="step",
        log_every_steps=4,
        tensorboard=False,
        trackers=(trackers.MLflow(tracking_uri=store, experiment="blobs"),),
    )
    data = ex.data.from_arrays(*blobs(64))
    est.train(data, max_steps=8)
    est.evaluate(data)
    est.train(data, max_steps=12)  # a second train call logs to the same run

    client = MlflowClient(tracking_uri=f"sqlite:///{store}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("blobs").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert json.load(open(os.path.join(model_dir, "trackers.json"))) == {"mlflow": run.info.run_id}
    params = run.data.params
    assert params["train_batch_size"] == "16" and params["loop"] == "step" and params["checkpoint.keep"] == "3"
    assert params["model_dir"] == model_dir and params["params.dropout"] == "0.3"
    records = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
    assert {r["split"] for r in records} == {"train", "eval", "summary"}
    for record in records:  # every value of metrics.jsonl, at its step, under <split>/<name>
        for name, value in record.items():
            if name in ("split", "step"):
                continue
            history = client.get_metric_history(run.info.run_id, f"{record['split']}/{name}")
            logged = [m.value for m in history if m.step == record["step"]]
            assert logged and np.isclose(logged[-1], value), (record, name, logged)


def test_tracker_settings_are_checked():
    with pytest.raises(ValueError, match=r"RunConfig\(trackers=...\) received 'neptune'; expected one of mlflow"):
        ex.RunConfig(trackers=("neptune",))
    with pytest.raises(TypeError, match=r"received 3; expected 'mlflow', 'mlflow=URI'"):
        ex.RunConfig(trackers=(3,))
    if importlib.util.find_spec("mlflow") is not None:
        assert ex.RunConfig(trackers="mlflow=http://localhost:5000").trackers == (
            trackers.MLflow("http://localhost:5000"),
        )
    else:
        with pytest.raises(ImportError, match=r"Fix: pip install 'estimax\[mlflow\]'"):
            ex.RunConfig(trackers=("mlflow",))


def test_an_unreachable_tracking_server_is_one_error_naming_it(tmp_path):
    pytest.importorskip("mlflow")
    import socket

    with socket.socket() as closed:  # a port of 127.0.0.1 that nothing listens on
        closed.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{closed.getsockname()[1]}"
    est = estimator(str(tmp_path / "run"), trackers=(trackers.MLflow(tracking_uri=uri),))
    # MLflow's own defaults retry for about 4 minutes; estimax's settings give up after two retries.
    with pytest.raises(WriterError, match=f"MLflow at {uri} did not start a run: .*Fix: start the tracking"):
        est.train(ex.data.from_arrays(*blobs(64)), max_steps=4)
