"""An s3:// model_dir end to end against moto's S3 server on 127.0.0.1, as tests/test_storage.py does gs://:
train, keep N (each step uncommitted before its other objects go), heal, SIGTERM, resume bitwise, best,
warm start, export, the lease lock, the endpoint variables, two processes and a SIGKILL, and Orbax's
patch (estimax/storage/orbax_s3.py) checked against the installed Orbax."""

import base64
import dataclasses
import json
import os
import time
import urllib.request

import fsspec
import numpy as np
import optax
import pytest
from helpers import STORE_DATA, SigtermAfter, assert_same_params, bucket_names, store_estimator
from models import mlp, model_fn

import estimax as ex
from estimax import storage
from estimax.errors import StorageError
from estimax.run.holder import this_process
from estimax.run.lease import LeaseLock
from estimax.storage import orbax_s3


def requests_for_objects(server_url: str) -> list[tuple[str, str]]:
    """``(verb, key)`` of every object written or deleted since the recording started, in the order the
    server received them (moto's recorder)."""
    with urllib.request.urlopen(f"{server_url}/moto-api/recorder/download-recording") as response:
        requests = [json.loads(line) for line in response.read().decode().splitlines() if line]
    done = []
    for request in requests:
        bucket, _, key = request["url"].split("://", 1)[-1].split("/", 1)[1].partition("/")
        if request["method"] in ("PUT", "DELETE") and key:
            done.append((request["method"], key))
        elif request["method"] == "POST" and bucket.endswith("?delete"):  # DeleteObjects: the keys in its XML body
            body = base64.b64decode(request["body"]).decode() if request["body_encoded"] else request["body"]
            done += [("DELETE", part.split("</Key>")[0]) for part in body.split("<Key>")[1:]]
    return done


def moto_api(server_url: str, action: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{server_url}/moto-api/recorder/{action}", method="POST")).read()


def test_s3_model_dir_trains_keeps_n_heals_resumes_bitwise_evaluates_exports_and_serves(
    s3, tmp_path, monkeypatch, estimax_log
):
    monkeypatch.chdir(tmp_path)  # where no local "s3:" folder may appear
    url, policy = "s3://bkt/e2e", ex.CheckpointPolicy(every_steps=4, keep=3)
    moto_api(s3.url, "reset-recording")
    moto_api(s3.url, "start-recording")
    try:
        store_estimator(url, checkpoint=policy, tensorboard=True, log_every_steps=8).train(
            ex.data.from_arrays(*STORE_DATA), max_steps=16
        )
    finally:
        moto_api(s3.url, "stop-recording")
    names = bucket_names(url)
    assert sorted({int(n.split("/")[1]) for n in names if n.startswith("checkpoints/")}) == [8, 12, 16]  # keep=3
    assert "estimax.lock" not in names and not os.path.exists(tmp_path / "s3:")
    # Keep-N: the deleted step lost its commit marker before any other object, so that a deletion
    # stopped half way leaves a step that is not listed (and is cleaned up), never one that looks whole.
    done = requests_for_objects(s3.url)
    marker = "e2e/checkpoints/4/commit_success.txt"
    deleted = [k for verb, k in done[done.index(("PUT", marker)) :] if verb == "DELETE" and "/checkpoints/4/" in k]
    assert len(deleted) > 5 and deleted[0] == marker, deleted

    # Step 16 as a save or a deletion stopped part way leaves it (its objects, no marker); step 12 altered.
    fs, inner = fsspec.core.url_to_fs(url)
    fs.rm_file(f"{inner}/checkpoints/16/commit_success.txt")
    fs.pipe_file(next(p for p in fs.find(f"{inner}/checkpoints/12/state") if "/d/" in p), b"garbage")
    assert store_estimator(url).step == 8  # a reader lists neither 16 (uncommitted) nor uses 12 (damaged)

    # A new process's view: resumes from step 8; a SIGTERM after step 12 saves it and stops (exit 75).
    with pytest.raises(ex.Preempted) as stopped:
        store_estimator(url, checkpoint=policy, tensorboard=True, log_every_steps=8).train(
            ex.data.from_arrays(*STORE_DATA), max_steps=24, hooks=[SigtermAfter(12)]
        )
    log = estimax_log.text
    assert f"The save of step 16 in {url}/checkpoints never finished" in log
    assert "Restored step 8" in log and "Moved the damaged checkpoint" in log
    assert any(".corrupt-" in n for n in bucket_names(url))
    assert stopped.value.step == 12 and store_estimator(url).step == 12  # the preemption save is committed

    # Run again, it ends exactly as an uninterrupted run.
    resumed = store_estimator(url, checkpoint=policy, tensorboard=True, log_every_steps=8)
    resumed.train(ex.data.from_arrays(*STORE_DATA), max_steps=24)
    local = store_estimator(str(tmp_path / "local"), checkpoint=policy).train(
        ex.data.from_arrays(*STORE_DATA), max_steps=24
    )
    assert_same_params(resumed.state(), local.state())

    with fsspec.open(f"{url}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    # Each step once: a resumed run drops the records the run before left past its checkpoint. A train
    # record is written at every log point (8) and every checkpoint (4), which closes the window before it.
    assert [r["step"] for r in records if r["split"] == "train"] == [4, 8, 12, 16, 20, 24]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(url, size_guidance={"scalars": 0})
    events.Reload()
    assert sorted({e.step for e in events.Scalars("train/loss")}) == list(range(1, 25))

    reader = store_estimator(url)
    assert reader.step == 24
    assert reader.evaluate(ex.data.from_arrays(*STORE_DATA)) == local.evaluate(ex.data.from_arrays(*STORE_DATA))
    at_20 = reader.evaluate(ex.data.from_arrays(*STORE_DATA), checkpoint=f"{url}/checkpoints/20")
    assert at_20 == local.evaluate(ex.data.from_arrays(*STORE_DATA), checkpoint=str(tmp_path / "local/checkpoints/20"))
    exported = reader.export("s3://bkt/exports/e2e", example_features={"x": STORE_DATA[0]["x"][:1]})
    assert exported == "s3://bkt/exports/e2e" and "signature.json" in bucket_names(exported)
    served = ex.serving.load(exported)({"x": STORE_DATA[0]["x"][:8]})
    expected = [row["class"] for row in reader.predict(ex.data.from_arrays({"x": STORE_DATA[0]["x"][:8]}))]
    np.testing.assert_array_equal(served["class"], expected)
    assert not os.path.exists(tmp_path / "s3:")


def test_s3_best_checkpoint_warm_start_and_lease_takeover_through_aws_endpoint_url_s3(s3, monkeypatch, estimax_log):
    # The S3-specific variable wins over the general one, for TensorStore's arrays as for fsspec's objects.
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    url = "s3://bkt/best"
    holder = dataclasses.replace(this_process(), host="another-host", pid=4242, lease_seconds=60.0)
    storage.write_bytes(
        f"{url}/estimax.lock", dataclasses.replace(holder, renewed_at=time.time() - 600).to_json().encode()
    )
    est = store_estimator(url, checkpoint=ex.CheckpointPolicy(every_steps=4))
    est.train_and_evaluate(
        ex.data.from_arrays(*STORE_DATA), ex.data.from_arrays(*STORE_DATA), max_steps=12, eval_every=4,
        best=ex.Best("accuracy"),
    )  # fmt: skip
    assert f"Took over the lock of model_dir {url}: its lease expired" in estimax_log.text
    assert any(n.startswith("best/") and n.endswith("/commit_success.txt") for n in bucket_names(url))
    warm = ex.Estimator(
        mlp, model_fn, optax.adam(1e-2), ex.RunConfig(model_dir=None, train_batch_size=32), warm_start=ex.WarmStart(url)
    )
    assert_same_params(warm.state(), est.state())


def test_s3_lock_is_a_conditional_create_that_names_the_holder(s3):
    url = "s3://bkt/locked"
    holder = dataclasses.replace(this_process(), host="another-host", pid=4242, lease_seconds=60.0)
    storage.write_bytes(f"{url}/estimax.lock", dataclasses.replace(holder, renewed_at=time.time()).to_json().encode())
    with pytest.raises(ex.ModelDirLocked, match="another-host, pid 4242.*lease was renewed"):
        store_estimator(url).train(ex.data.from_arrays(*STORE_DATA), max_steps=4)
    storage.remove(f"{url}/estimax.lock")
    with LeaseLock(url, lease_seconds=60.0) as lock:  # a live holder: a second writer is refused
        assert lock.held
        with pytest.raises(ex.ModelDirLocked, match="being written by another process"):
            LeaseLock(url).acquire()


def test_s3_missing_bucket_is_one_line_before_the_first_step(s3):
    est = store_estimator("s3://no-such-bucket/run")
    with pytest.raises(StorageError, match="s3://no-such-bucket/run: bucket 'no-such-bucket' does not exist.*Fix"):
        est.train(ex.data.from_arrays(*STORE_DATA), max_steps=4)
    assert est.step == 0


def test_the_orbax_patch_fits_the_installed_orbax_or_names_itself(monkeypatch):
    """Fails loudly when Orbax changes under estimax/storage/orbax_s3.py: pin orbax-checkpoint or update the patch."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    orbax_s3.enable()  # raises StorageError naming the patch if the installed Orbax does not fit it
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:5000")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    spec = tensorstore_utils.build_kvstore_tspec("s3://b/run/checkpoints/4/state", use_ocdbt=True)
    assert spec["driver"] == "ocdbt" and spec["base"] == {
        "driver": "s3", "bucket": "b", "path": "run/checkpoints/4/state", "endpoint": "http://127.0.0.1:5000",
        "aws_region": "eu-west-3", "aws_credentials": {"type": "environment"},
    }  # fmt: skip
    gs = tensorstore_utils.build_kvstore_tspec("gs://b/run/checkpoints/4/state", use_ocdbt=True)["base"]
    assert gs["driver"].startswith("gcs") and gs["bucket"] == "b"  # gs:// as Orbax builds it

    # An Orbax without one of the functions the patch replaces is refused, naming the patch and the fix.
    monkeypatch.delattr(tensorstore_utils, "_use_gcs_driver")
    with pytest.raises(StorageError, match=r"estimax/storage/orbax_s3.py.*_use_gcs_driver is gone.*orbax-checkpoint>="):
        orbax_s3.enable.__wrapped__()
