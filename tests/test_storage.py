"""A model_dir on object storage: gs:// end to end against a real GCS emulator on 127.0.0.1,
stores that cannot hold checkpoints refused before anything is written, and paths as users type them."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import fsspec
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import STORE_DATA, assert_same_params, bucket_names, store_estimator, user_env
from models import mlp, model_fn

import estimax as ex
from estimax import storage
from estimax.data import tfrecord
from estimax.errors import LeaseLostError, StorageError
from estimax.run import checkpoint
from estimax.run.holder import LOCK_FILE, RUN_ID, Holder, this_process
from estimax.run.lease import LeaseLock

# -- paths as users type them -----------------------------------------------------------


def test_paths_expand_home_and_variables_and_keep_urls(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    assert storage.resolve("~/x") == str(tmp_path / "x")
    assert storage.resolve("$RUNS/y") == str(tmp_path / "runs" / "y")
    assert storage.resolve("file:///tmp/z") == "/tmp/z"
    assert storage.resolve("gs://bucket/run/") == "gs://bucket/run"
    assert storage.join("gs://bucket/run", "checkpoints") == "gs://bucket/run/checkpoints"
    assert store_estimator("~/run").run_dir.url == str(tmp_path / "run")
    assert not os.path.exists("~")


def test_a_store_that_cannot_hold_checkpoints_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = "memory://runs/digits"
    with pytest.raises(StorageError, match=f"model_dir {url}: .*Fix: use"):
        store_estimator(url)
    assert os.listdir(tmp_path) == []  # no local folder named after the URL


# -- gs:// against the emulator -------------------------------------------------------------


def test_gs_model_dir_trains_resumes_bitwise_evaluates_exports_and_serves(gcs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = "gs://bkt/e2e"
    policy = ex.CheckpointPolicy(every_steps=8)
    store_estimator(url, checkpoint=policy, tensorboard=True, log_every_steps=8).train(
        ex.data.from_arrays(*STORE_DATA), max_steps=16
    )
    names = bucket_names(url)
    assert any(n.startswith("checkpoints/8/") for n in names) and any(n.startswith("checkpoints/16/") for n in names)
    assert "estimax.lock" not in names  # released at the end
    assert not os.path.exists(tmp_path / "gs:")  # nothing local named after the URL

    # A new process's view: resumes from the bucket and continues exactly as an uninterrupted run.
    resumed = store_estimator(url, checkpoint=policy, tensorboard=True, log_every_steps=8)
    resumed.train(ex.data.from_arrays(*STORE_DATA), max_steps=32)
    local = store_estimator(str(tmp_path / "local"), checkpoint=policy).train(
        ex.data.from_arrays(*STORE_DATA), max_steps=32
    )
    assert_same_params(resumed.state(), local.state())

    # The records of both runs, in one object that fsspec reads; every step's point in TensorBoard.
    with fsspec.open(f"{url}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if r["split"] == "train"] == [8, 16, 24, 32]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(url, size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 33))

    reader = store_estimator(url)
    assert reader.step == 32
    assert reader.evaluate(ex.data.from_arrays(*STORE_DATA)) == local.evaluate(ex.data.from_arrays(*STORE_DATA))
    assert (
        store_estimator(None).evaluate(ex.data.from_arrays(*STORE_DATA), checkpoint=f"{url}/checkpoints/16")[
            "num_examples"
        ]
        == 256
    )

    exported = reader.export("gs://bkt/exports/mlp", example_features={"x": STORE_DATA[0]["x"][:1]})
    assert exported == "gs://bkt/exports/mlp" and "signature.json" in bucket_names(exported)
    scratch = tmp_path / "scratch"  # where the loader's local copy goes, deleted once read
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    model = ex.serving.load(exported)
    assert model.path == exported and list(scratch.iterdir()) == []
    served = model({"x": STORE_DATA[0]["x"][:8]})
    expected = [row["class"] for row in reader.predict(ex.data.from_arrays({"x": STORE_DATA[0]["x"][:8]}))]
    np.testing.assert_array_equal(served["class"], expected)


def test_gs_best_checkpoint_and_warm_start_from_a_bucket(gcs):
    url = "gs://bkt/best"
    est = store_estimator(url, checkpoint=ex.CheckpointPolicy(every_steps=4))
    est.train_and_evaluate(
        ex.data.from_arrays(*STORE_DATA), ex.data.from_arrays(*STORE_DATA), max_steps=12, eval_every=4,
        best=ex.Best("accuracy"),
    )  # fmt: skip
    assert any(n.startswith("best/") for n in bucket_names(url))
    warm = ex.Estimator(
        mlp, model_fn, optax.adam(1e-2), ex.RunConfig(model_dir=None, train_batch_size=32), warm_start=ex.WarmStart(url)
    )
    assert_same_params(warm.state(), est.state())


def test_gs_damaged_checkpoint_is_moved_aside_by_copy_then_delete(gcs, caplog):
    url = "gs://bkt/heal"
    store_estimator(url, checkpoint=ex.CheckpointPolicy(every_steps=4)).train(
        ex.data.from_arrays(*STORE_DATA), max_steps=8
    )
    fs, inner = fsspec.core.url_to_fs(url)
    arrays = [p for p in fs.find(f"{inner}/checkpoints/8/state") if "/d/" in p]
    fs.pipe_file(arrays[0], b"garbage")  # an altered array file
    healed = store_estimator(url, checkpoint=ex.CheckpointPolicy(every_steps=4))
    with caplog.at_level("INFO", logger="estimax"):
        healed.train(ex.data.from_arrays(*STORE_DATA), max_steps=8)  # restores 4, trains 4 -> 8 again
    names = bucket_names(url)
    assert any(".corrupt-" in n for n in names) and any(n.startswith("checkpoints/8/") for n in names)
    assert "Restored step 4" in caplog.text and "Moved the damaged checkpoint" in caplog.text


def test_gs_save_stopped_before_its_commit_is_removed_with_a_warning(gcs, tmp_path, estimax_log):
    url = "gs://bkt/unfinished"
    store_estimator(url, checkpoint=ex.CheckpointPolicy(every_steps=4)).train(
        ex.data.from_arrays(*STORE_DATA), max_steps=8
    )
    fs, inner = fsspec.core.url_to_fs(url)
    # A bucket has no atomic rename: a save stopped mid-write leaves the step's folder without Orbax's marker.
    fs.rm_file(f"{inner}/checkpoints/8/commit_success.txt")
    resumed = store_estimator(url, checkpoint=ex.CheckpointPolicy(every_steps=4))
    resumed.train(ex.data.from_arrays(*STORE_DATA), max_steps=8)  # restores 4, trains 4 -> 8 again
    assert f"The save of step 8 in {url}/checkpoints never finished" in estimax_log.text
    assert "Restored checkpoint step 4" in estimax_log.text
    assert "checkpoints/8/commit_success.txt" in bucket_names(url)
    local = store_estimator(str(tmp_path / "local"), checkpoint=ex.CheckpointPolicy(every_steps=4))
    local.train(ex.data.from_arrays(*STORE_DATA), max_steps=8)
    assert_same_params(resumed.state(), local.state())


def test_gs_a_step_removed_as_unfinished_is_not_restored_though_committed_meanwhile(
    gcs, tmp_path, estimax_log, monkeypatch
):
    # An earlier attempt, taken over while it saved step 4, commits it (inside its fence's window) after the new
    # writer found it unfinished and before Orbax listed the steps: the writer removes it, then restores from
    # what is left (nothing here), never from the step it removed ("No usable checkpoint" before).
    url = "gs://bkt/committed-meanwhile"
    store_estimator(url, checkpoint=ex.CheckpointPolicy(every_steps=4)).train(
        ex.data.from_arrays(*STORE_DATA), max_steps=4
    )
    found = [[4]]  # what the check found, once: step 4 without its marker then
    unfinished = checkpoint.unfinished_steps
    monkeypatch.setattr(
        checkpoint, "unfinished_steps", lambda d, committed: found.pop() if found else unfinished(d, committed)
    )
    resumed = store_estimator(url, checkpoint=ex.CheckpointPolicy(every_steps=4))
    resumed.train(ex.data.from_arrays(*STORE_DATA), max_steps=8)  # from step 0
    assert f"The save of step 4 in {url}/checkpoints never finished" in estimax_log.text
    assert "cannot be used" not in estimax_log.text and "Restored" not in estimax_log.text, estimax_log.text
    local = store_estimator(str(tmp_path / "local"), checkpoint=ex.CheckpointPolicy(every_steps=4))
    local.train(ex.data.from_arrays(*STORE_DATA), max_steps=8)
    assert_same_params(resumed.state(), local.state())


def test_gs_a_save_that_fails_after_a_takeover_ends_with_the_locks_error(gcs, monkeypatch):
    # A later attempt of the run takes the lease over while a save is in flight and removes that step as unfinished:
    # the save fails (Orbax's finalize finds its files gone). What ends the run is the lock's error (exit 74), not
    # the store's FileNotFoundError (exit 1), though the lease's last renewal still holds.
    url = "gs://bkt/failed-after-takeover"
    monkeypatch.setenv(RUN_ID, "run-a")  # an attempt of a run: a later one takes its lease over at any moment
    wait = ocp.CheckpointManager.wait_until_finished

    def taken_over_then_failed(self):
        wait(self)
        if self.all_steps():  # the first save is done: the takeover, then that save's failure
            later = Holder.from_json(storage.read_bytes(f"{url}/{LOCK_FILE}").decode())
            later = dataclasses.replace(later, attempt_started=later.attempt_started + 1, pid=later.pid + 1)
            storage.write_bytes(f"{url}/{LOCK_FILE}", later.to_json().encode())
            raise FileNotFoundError(f"{url}/checkpoints/4/state/array_metadatas/process_0")

    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", taken_over_then_failed)
    with pytest.raises(LeaseLostError, match="took over"):
        store_estimator(url, checkpoint=ex.CheckpointPolicy(every_steps=2)).train(
            ex.data.from_arrays(*STORE_DATA), max_steps=8
        )


def test_gs_lock_names_the_holder_and_takes_over_an_expired_lease(gcs, estimax_log):
    url = "gs://bkt/locked"
    holder = dataclasses.replace(this_process(), host="another-host", pid=4242, lease_seconds=60.0)
    storage.write_bytes(f"{url}/estimax.lock", dataclasses.replace(holder, renewed_at=time.time()).to_json().encode())
    with pytest.raises(ex.ModelDirLocked, match="another-host, pid 4242.*lease was renewed"):
        store_estimator(url).train(ex.data.from_arrays(*STORE_DATA), max_steps=4)
    storage.write_bytes(
        f"{url}/estimax.lock", dataclasses.replace(holder, renewed_at=time.time() - 600).to_json().encode()
    )
    assert store_estimator(url).train(ex.data.from_arrays(*STORE_DATA), max_steps=4).step == 4
    assert "Took over the lock of model_dir gs://bkt/locked: its lease expired" in estimax_log.text

    with LeaseLock(url, lease_seconds=60.0) as lock:  # a live holder: a second writer is refused
        assert lock.held
        with pytest.raises(ex.ModelDirLocked, match="being written by another process"):
            LeaseLock(url).acquire()


def test_gs_missing_bucket_is_one_line_before_the_first_step(gcs):
    est = store_estimator("gs://no-such-bucket/run")
    with pytest.raises(StorageError, match="gs://no-such-bucket/run: bucket 'no-such-bucket' does not exist.*Fix"):
        est.train(ex.data.from_arrays(*STORE_DATA), max_steps=4)
    assert est.step == 0


@pytest.mark.parametrize("store", ["gs", "s3"])
def test_two_processes_saving_to_a_bucket_are_killed_and_resume_bitwise(store, request, tmp_path, multihost_references):
    """2 processes x 4 devices write one model_dir on a bucket; one is killed with SIGKILL after a save;
    the restarted group ends with the parameters of an uninterrupted run, bit for bit."""
    from helpers import MULTIHOST_STEPS, finish, launch_group, max_difference, read_result

    request.getfixturevalue({"gs": "gcs", "s3": "s3"}[store])  # the store's server on 127.0.0.1
    url, out_dir = f"{store}://bkt/multihost", tmp_path / "out"
    launcher = launch_group(url, str(out_dir), "train", str(MULTIHOST_STEPS), "1.0", max_restarts=1)
    deadline = time.monotonic() + 120
    # A bucket has no atomic rename: a step's folder is listed while it is written. Step 8's folder
    # means step 4 was committed (a save starts once the one before it has finished).
    while max([int(n) for n in storage.listdir(f"{url}/checkpoints") if n.isdigit()] or [0]) < 8:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0]
        time.sleep(0.1)
    os.kill(int((out_dir / "pid-1").read_text()), signal.SIGKILL)
    out = finish(launcher, timeout=240)
    assert "restarting the group from its latest checkpoint" in out and "Restored checkpoint step" in out
    resumed, uninterrupted = read_result(out_dir), multihost_references.two
    assert resumed["step"] == MULTIHOST_STEPS and min(resumed["losses"]) > 1  # it did not start from scratch
    assert max_difference(resumed["params"], uninterrupted["params"]) == 0.0
    assert resumed["eval"] == uninterrupted["eval"]


def test_tfrecord_data_in_a_bucket_trains_like_the_same_arrays(gcs):
    features, labels = STORE_DATA
    examples = [{"x": features["x"][i], "y": int(labels[i])} for i in range(len(labels))]
    tfrecord.write("gs://bkt/data/train-0.tfrecord", examples[:128])
    tfrecord.write("gs://bkt/data/train-1.tfrecord", examples[128:])
    spec = {"x": tfrecord.Feature(np.float32, (6,)), "y": tfrecord.Feature(np.int64)}
    from_bucket = store_estimator(None).train(
        tfrecord.tfrecord("gs://bkt/data/train-*.tfrecord", spec, label="y"), steps=8
    )
    on_disk = store_estimator(None).train(ex.data.from_arrays(*STORE_DATA), steps=8)
    assert from_bucket.step == on_disk.step == 8
    results = from_bucket.evaluate(tfrecord.tfrecord("gs://bkt/data/train-*.tfrecord", spec, label="y"))
    assert results["num_examples"] == 256


# A TensorFlow that etils finds importable; any use of it is written to $TENSORFLOW_USES and fails.
FAKE_TENSORFLOW = """
import os

def __getattr__(name):
    with open(os.environ["TENSORFLOW_USES"], "a") as f:
        f.write(name + "\\n")
    raise AttributeError(f"fake tensorflow: {name}")
"""
# What estimax sets or derives; the child starts without them, as a user's shell would.
DERIVED = ("EPATH_USE_TF", *storage.clients.EMULATOR_VARIABLES, storage.clients.GCSFS_BUCKET_LAYOUTS)
# ArrayRecord files in the bucket, trained from with a checkpoint there, which a new Estimator restores.
WITH_TENSORFLOW = """
import numpy as np
from models import blobs, estimator
import estimax as ex

features, labels = blobs(64)
examples = [{"x": features["x"][i], "y": int(labels[i])} for i in range(64)]
ex.data.array_record.write("gs://bkt/tf-present/data.array_record", examples)
spec = {"x": ex.data.array_record.Feature(np.float32, (6,)), "y": ex.data.array_record.Feature(np.int64)}
data = lambda: ex.data.array_record("gs://bkt/tf-present/data.array_record", spec, label="y")
estimator("gs://bkt/tf-present/run", quiet=True).train(data(), max_steps=8)
print("restored step", estimator("gs://bkt/tf-present/run").step, flush=True)
import fsspec
print("gcsfs file system", type(fsspec.filesystem("gs")).__name__, flush=True)
"""


def test_gs_goes_through_one_client_with_tensorflow_importable(gcs, tmp_path):
    """With TensorFlow importable, etils.epath (Orbax's paths) would choose tf.io.gfile for gs://; estimax keeps
    it on gcsfs, and STORAGE_EMULATOR_HOST alone points TensorStore and ArrayRecord's reader at the emulator
    and gives gcsfs its plain file system (its default one asks Google's Storage Control API for the bucket's
    layout before each operation: never the emulator, and again each time when that fails)."""
    fake = tmp_path / "fake" / "tensorflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_TENSORFLOW)
    uses = tmp_path / "tensorflow-uses"
    env = user_env(*DERIVED)  # one device is enough
    env.update(
        STORAGE_EMULATOR_HOST=gcs.url,
        TENSORFLOW_USES=str(uses),
        PYTHONPATH=os.pathsep.join([str(fake.parent), os.path.dirname(__file__), env.get("PYTHONPATH", "")]),
    )
    run = subprocess.run([sys.executable, "-c", WITH_TENSORFLOW], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "restored step 8" in run.stdout, run.stdout + run.stderr
    assert "gcsfs file system GCSFileSystem\n" in run.stdout, run.stdout  # not ExtendedGcsFileSystem
    assert not uses.exists(), uses.read_text()  # TensorFlow was never asked for anything
    assert "checkpoints/8/" in " ".join(bucket_names("gs://bkt/tf-present/run"))

    # The same fake is reached when a user asks etils for TensorFlow: the check above can fail.
    asked = "from etils import epath; epath.Path('gs://bkt/tf-present').exists()"
    subprocess.run([sys.executable, "-c", asked], env={**env, "EPATH_USE_TF": "true"}, capture_output=True)
    assert uses.read_text().split() == ["io"]


def test_home_in_data_paths_and_the_compilation_cache_is_expanded(monkeypatch, tmp_path):
    from estimax import compile_cache

    monkeypatch.setenv("HOME", str(tmp_path))
    features, labels = STORE_DATA
    tfrecord.write(str(tmp_path / "d.tfrecord"), [{"x": features["x"][0], "y": 1}])
    spec = {"x": tfrecord.Feature(np.float32, (6,)), "y": tfrecord.Feature(np.int64)}
    assert len(tfrecord.tfrecord("~/d.tfrecord", spec, label="y")) == 1
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert compile_cache.enable("~/cache") == str(tmp_path / "cache")
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


def test_s3_holds_data_and_exports_against_a_real_s3_server(s3, tmp_path):
    features, labels = STORE_DATA
    tfrecord.write("s3://bkt/data/train.tfrecord", [{"x": features["x"][i], "y": int(labels[i])} for i in range(256)])
    spec = {"x": tfrecord.Feature(np.float32, (6,)), "y": tfrecord.Feature(np.int64)}
    est = store_estimator(str(tmp_path / "run")).train(
        tfrecord.tfrecord("s3://bkt/data/train.tfrecord", spec, label="y"), steps=8
    )
    exported = est.export("s3://bkt/exports/mlp/8", example_features={"x": features["x"][:1]})
    served = ex.serving.load(exported)({"x": features["x"][:8]})
    expected = [row["class"] for row in est.predict(ex.data.from_arrays({"x": features["x"][:8]}))]
    np.testing.assert_array_equal(served["class"], expected)
    assert not os.path.exists("s3:")
