"""Every store operation has a deadline: on a store that stalls (the GCS emulator on 127.0.0.1 paused
with SIGSTOP: it accepts connections and answers nothing), an evaluation, an export and a data read each
end within ``ESTIMAX_STORE_DEADLINE_SECONDS`` with one ``StoreUnavailableError`` line, and training
ends within its lease (``lease.py``), which a checkpoint save cannot outlast. Deadlines are seconds here.
"""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import warm
from helpers import LEASE_JOB, ended, error_lines, resume_paused
from models import blobs, estimator

import estimax as ex
from estimax import storage
from estimax.data import feed, tfrecord
from estimax.errors import StoreUnavailableError

DEADLINE = 2.0  # seconds
LATE = 1.5  # seconds past the deadline that a failure may take (the 2-core machine is shared)


def _fails_within_the_deadline(operation: str, url: str, call) -> float:
    """Seconds ``call`` took to raise the one-line error naming ``url`` and ``operation``."""
    began = time.monotonic()
    with pytest.raises(StoreUnavailableError) as raised:
        call()
    took = time.monotonic() - began
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{url}: {operation}: the store did not answer for "), message
    assert "expected a store that answers within 2 s (ESTIMAX_STORE_DEADLINE_SECONDS)" in message, message
    assert "Fix: run the same command again once the store answers" in message, message
    assert DEADLINE <= took < DEADLINE + LATE, (operation, took)
    return took


def test_evaluate_export_and_a_data_read_on_a_stalled_store_end_within_the_deadline(
    gcs, tmp_path, monkeypatch, estimax_log
):
    url, data, export = "gs://bkt/deadlines", "gs://bkt/deadlines-data/a.tfrecord", "gs://bkt/deadlines-export"
    upload = "gs://bkt/deadlines-upload"
    features, labels = blobs(64)
    for model_dir in (url, str(tmp_path / "local")):  # the export's checkpoint is local: its write is under test
        est = estimator(model_dir, steps_per_loop=2, checkpoint=ex.CheckpointPolicy(every_steps=2, async_save=False))
        est.train(ex.data.from_arrays(features, labels), max_steps=2)
    tfrecord.write(data, [{"x": x, "y": int(y)} for x, y in zip(features["x"][:8], labels[:8], strict=True)])
    spec = {"x": tfrecord.Feature(np.float32, (6,)), "y": tfrecord.Feature(np.int32)}
    source = tfrecord.tfrecord(data, spec, label="y")  # lists and indexes the file; records are read on use
    reader = estimator(url)
    evaluated = reader.evaluate(ex.data.from_arrays(features, labels), steps=1)
    monkeypatch.setenv("ESTIMAX_STORE_DEADLINE_SECONDS", str(DEADLINE))
    with gcs.stalled():
        took = [
            _fails_within_the_deadline(
                "listing the checkpoints", f"{url}/checkpoints",
                lambda: reader.evaluate(ex.data.from_arrays(features, labels), steps=1),
            ),
            _fails_within_the_deadline("checking the bucket", export, lambda: est.export(export)),
            # export()'s upload, once the target is checked (a stall in between)
            _fails_within_the_deadline("uploading", upload, lambda: storage.upload(str(tmp_path / "local"), upload)),
            _fails_within_the_deadline("reading", data, lambda: list(feed.eval_batches(source, 8))),
        ]  # fmt: skip
    # Warnings while it waits, and while it tries again after a request timed out.
    assert re.search(r"/checkpoints: listing the checkpoints: the store has not answered for \d s; waiting another",
                     estimax_log.text)  # fmt: skip
    assert f"{export}: checking the bucket: the store did not answer (FSTimeoutError); trying again" in estimax_log.text
    # The store answers again: what was written before the stall is all there, and the same calls work.
    assert reader.evaluate(ex.data.from_arrays(features, labels), steps=1) == evaluated
    assert est.export(export) == export
    (batch,) = feed.eval_batches(source, 8)
    np.testing.assert_array_equal(batch[1], labels[:8])
    print("stalled store: evaluate, export, upload, data read failed after", ", ".join(f"{t:.1f}" for t in took), "s")


def test_a_checkpoint_save_on_a_stalled_store_ends_training_within_its_lease(gcs):
    url, lease = "gs://bkt/stalled-save", 4.0  # shorter than the deadline, as by default (60 s and 120 s)
    settings = {"ESTIMAX_LEASE_SECONDS": str(lease), "ESTIMAX_STORE_DEADLINE_SECONDS": str(2 * lease)}
    job = warm.Popen(
        [sys.executable, LEASE_JOB, url, "4", "40"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, **settings},
    )  # fmt: skip
    assert job.stdout.readline() == "waiting at step 4\n", job.communicate()
    committed = max(int(name) for name in storage.listdir(f"{url}/checkpoints") if name.isdigit())
    with gcs.stalled():  # the save of step 4, due once the job goes on, meets a stalled store
        stderr, said, exited = ended(job, resume_paused(job))
    lines = error_lines(stderr)
    assert job.returncode == 74 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert f"{url}/estimax.lock: renewing the lease: the store did not answer for" in lines[0], lines[0]
    assert f"resume from step {committed} with the same command once the store answers" in lines[0], lines[0]
    assert exited < 2 * lease, (said, exited)  # the lease's bound: L, then L/4 for the writes under way
    print(f"a save on a stalled store: training said so {said:.1f} s and exited {exited:.1f} s after the stall")
