"""Writers: event files TensorBoard reads, records off the training thread, and a full disk or a failing
writer that ends training with one line instead of hanging it."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from models import blobs, estimator

import estimax as ex
from estimax import events
from estimax.errors import WriterError
from estimax.writer_thread import InBackground
from estimax.writers import JsonlWriter, TensorBoardWriter

TESTS = os.path.dirname(__file__)
# Trains until stopped; says "training" at step 20, so that the test acts while it trains.
CHILD = """
import sys
from models import blobs, estimator
import estimax as ex

class Say(ex.Hook):
    def after_loop(self, loop):
        if loop.step_before < 20 <= loop.step_after:
            print("training", flush=True)

est = estimator(sys.argv[1], steps_per_loop=10, log_every_steps=10, tensorboard=True, save_every_steps=10**6)
est.train(ex.data.from_arrays(*blobs(256)), max_steps=10**8, hooks=[Say()])
"""


def test_event_files_read_back_with_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(str(tmp_path))
    writer.write_steps(
        "train",
        1,
        {"loss": np.array([3.0, 2.0, 1.0]), "grad_norm": np.array([np.nan, np.nan, 7.0])},
        sampled=("grad_norm",),
    )
    writer.write("eval", 3, {"accuracy": 0.75, "num_examples": 96.0})
    writer.close()
    train = EventAccumulator(str(tmp_path / "train"))
    train.Reload()
    assert [(e.step, e.value) for e in train.Scalars("loss")] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert [(e.step, e.value) for e in train.Scalars("grad_norm")] == [(3, 7.0)]  # sampled: measured once
    evaluation = EventAccumulator(str(tmp_path / "eval"))
    evaluation.Reload()
    assert [(e.step, e.value) for e in evaluation.Scalars("accuracy")] == [(3, 0.75)]


def test_encoded_events_equal_the_protobuf_messages():
    from tensorboard.compat.proto import event_pb2

    data = events.ScalarEncoder().event(2**40 + 5, {"loss": 0.5, "a/very/long/" + "x" * 200: -1.25}, 1234.5)
    event = event_pb2.Event.FromString(data[12:-4])  # inside the TFRecord frame
    assert event.wall_time == 1234.5 and event.step == 2**40 + 5
    assert [(v.tag, v.simple_value) for v in event.summary.value] == [
        ("loss", 0.5),
        ("a/very/long/" + "x" * 200, -1.25),
    ]


def test_metrics_records_are_continued_by_a_new_writer(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    for step in (1, 2):
        writer = InBackground(JsonlWriter(path), path)
        writer.write("train", step, {"loss": 1.0 / step})
        writer.close()
    with open(path) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]


class Broken:
    def write(self, split, step, values):
        raise OSError(28, "No space left on device")

    def close(self):
        pass


def test_a_failing_writer_is_one_error_at_the_next_record_and_at_close():
    writer = InBackground(Broken(), "/disk/run/metrics.jsonl")
    writer.write("train", 1, {"loss": 1.0})  # handed over: training goes on
    with pytest.raises(WriterError, match=r"Broken to /disk/run/metrics.jsonl failed: OSError: .*No space left"):
        for step in range(2, 10**6):  # the thread reports the failure within a few records
            writer.write("train", step, {"loss": 1.0})
    with pytest.raises(WriterError, match="No space left on device.*Fix: free space"):
        writer.close()
    writer.close()  # said once


def test_a_writer_error_in_training_keeps_the_checkpoint_that_was_due(tmp_path):
    class FailAtStep8(ex.Hook):
        """Stands for a writer that fails: the metric logger raises a WriterError the same way."""

        def after_loop(self, loop):
            if loop.step_after == 8:
                raise WriterError("metrics.jsonl failed")

    model_dir = str(tmp_path / "run")
    est = estimator(model_dir, steps_per_loop=4, save_every_steps=8)
    with pytest.raises(WriterError):
        est.train(ex.data.from_arrays(*blobs(256)), max_steps=40, hooks=[FailAtStep8()])
    assert sorted(int(n) for n in os.listdir(os.path.join(model_dir, "checkpoints")) if n.isdigit())[-1] >= 8


@pytest.fixture
def small_disk(tmp_path):
    disk = str(tmp_path / "disk")
    os.makedirs(disk)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", disk]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield disk
    subprocess.run(["umount", disk], check=True)


def _fill(disk):
    try:
        with open(os.path.join(disk, "filler"), "wb") as f:
            while True:
                f.write(bytes(4096))
                f.flush()
    except OSError:
        pass


def _start(command, ready="training"):
    env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in process.stdout:  # the child's readiness line, not a sleep
        if ready in line:
            return process
    pytest.fail(f"the child ended before training: {process.wait()}")


def test_a_full_disk_with_tensorboard_on_ends_training_with_one_line(small_disk):
    model_dir = os.path.join(small_disk, "run")
    process = _start([sys.executable, "-c", CHILD, model_dir])
    _fill(small_disk)
    out = process.communicate(timeout=300)[0]  # before: tensorboardX's writer died and training hung
    assert process.returncode == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("estimax.errors.WriterError: ") and "No space left on device" in last, out
    assert model_dir in last and "Fix: free space" in last


def test_sigterm_on_a_full_disk_ends_the_process(small_disk):
    model_dir = os.path.join(small_disk, "run")
    command = [sys.executable, "-m", "estimax.cli", "train", "--model-dir", model_dir, "--loop", "step"]
    process = _start(
        [*command, "--batch-size", "16", "--steps-per-loop", "2", "--max-steps", "100000000"], "train step"
    )
    _fill(small_disk)
    process.send_signal(signal.SIGTERM)
    out = process.communicate(timeout=300)[0]
    # Saved and stopped for requeue, or the one line saying what the full disk stopped.
    said = [line for line in out.splitlines() if line.startswith("estimax: error: ")]
    assert process.returncode == 75 or (process.returncode == 2 and len(said) == 1), out
    assert "never retrieved" not in out, out  # asyncio's echo of the failed save is kept off the console
