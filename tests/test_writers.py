"""Writers: event files TensorBoard reads, records off the training thread, records that read as one
history after a kill and a resume, and a full disk or a failing writer that ends training with one line
instead of hanging it."""

import json
import os
import signal
import subprocess
import sys
import time

import fsspec
import numpy as np
import pytest
import warm
from models import blobs, estimator

import estimax as ex
from estimax import storage
from estimax.errors import WriterError
from estimax.records import events
from estimax.records.writer_thread import InBackground
from estimax.records.writers import JsonlWriter, TensorBoardWriter

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
    run = EventAccumulator(str(tmp_path))  # one run: every split's tags named after it
    run.Reload()
    assert sorted(run.Tags()["scalars"]) == ["eval/accuracy", "eval/num_examples", "train/grad_norm", "train/loss"]
    assert [(e.step, e.value) for e in run.Scalars("train/loss")] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert [(e.step, e.value) for e in run.Scalars("train/grad_norm")] == [(3, 7.0)]  # sampled: measured once
    assert [(e.step, e.value) for e in run.Scalars("eval/accuracy")] == [(3, 0.75)]


def test_encoded_events_equal_the_protobuf_messages():
    from tensorboard.compat.proto import event_pb2

    data = events.ScalarEncoder().event(2**40 + 5, {"loss": 0.5, "a/very/long/" + "x" * 200: -1.25}, 1234.5)
    event = event_pb2.Event.FromString(data[12:-4])  # inside the TFRecord frame
    assert event.wall_time == 1234.5 and event.step == 2**40 + 5
    assert [(v.tag, v.simple_value) for v in event.summary.value] == [
        ("loss", 0.5),
        ("a/very/long/" + "x" * 200, -1.25),
    ]
    start = event_pb2.Event.FromString(events.session_start(2**33 + 1, 99.0)[12:-4])
    assert (start.step, start.wall_time, start.session_log.status) == (2**33 + 1, 99.0, event_pb2.SessionLog.START)


@pytest.mark.parametrize("first_step", [1, 100, 16_370, 2**35 - 3])  # the step's varint grows within a loop
@pytest.mark.parametrize("num_steps", [50, 700])  # one loop; the loops of a flush (CRCs from their bits)
def test_a_loops_points_encoded_together_equal_one_event_per_step(first_step, num_steps):
    from tensorboard.compat.proto import event_pb2

    rng = np.random.default_rng(0)
    loss, sampled = rng.standard_normal(num_steps), np.full(num_steps, np.nan)
    measured = [0, 7, 8, 49, num_steps - 1]  # measured on some steps only, the first and the last among them
    sampled[measured] = rng.standard_normal(len(measured))
    times = 1234.5 + np.arange(num_steps) // 50 * 0.37  # the wall time each loop reached the writer
    encoder, one_by_one = events.ScalarEncoder(), events.ScalarEncoder()
    data = encoder.steps(
        first_step, {"loss": loss, "grad_norm": sampled, "lr": loss * 2}, skip_nan=("grad_norm",), wall_times=times
    )
    expected = [
        one_by_one.event(first_step + i, {"loss": v, **({"grad_norm": g} if g == g else {}), "lr": 2 * v}, t)
        for i, (v, g, t) in enumerate(zip(loss.tolist(), sampled.tolist(), times.tolist(), strict=True))
    ]
    assert data == b"".join(expected)
    read, at = [], 0
    while at < len(data):  # TFRecords: length, its CRC, the event, its CRC
        size = int.from_bytes(data[at : at + 8], "little")
        read.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + size]))
        at += size + 16
    assert [e.step for e in read] == list(range(first_step, first_step + num_steps))
    assert read[7].summary.value[1].tag == "grad_norm" and len(read[9].summary.value) == 2


def test_loops_encoded_at_the_flush_read_back_as_every_step_in_order(tmp_path, monkeypatch):
    """Loops' columns wait for the flush and are encoded together, with log lines' points written
    between them and a gap in the steps (another call's loops): TensorBoard reads each tag's points
    once, in step order, each at the wall time its loop reached the writer."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer, rng, clock = TensorBoardWriter(str(tmp_path)), np.random.default_rng(1), [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    loss, expected_norms = rng.standard_normal(250).astype(np.float32), []
    firsts = [1, 51, 101, 151, 1001]  # a gap after step 200: a later call's loop
    for n, first in enumerate(firsts):
        clock[0] = 1000.0 + n
        norms = np.full(50, np.nan)
        norms[-1] = n + 0.5  # the loop's last step measures it
        expected_norms.append((first + 49, n + 0.5))
        writer.write_steps("train", first, {"loss": loss[50 * n : 50 * n + 50], "grad_norm": norms}, ("grad_norm",))
        if n % 2:
            writer.write("train", first + 49, {"steps_per_sec": 10.0 * n})
    clock[0] = 2000.0
    writer.close()
    train = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    train.Reload()
    steps = [s for first in firsts for s in range(first, first + 50)]
    assert [(e.step, e.value) for e in train.Scalars("train/loss")] == list(zip(steps, loss.tolist(), strict=True))
    assert [e.wall_time for e in train.Scalars("train/loss")] == [1000.0 + n for n in range(5) for _ in range(50)]
    assert [(e.step, e.value) for e in train.Scalars("train/grad_norm")] == expected_norms
    assert [e.wall_time for e in train.Scalars("train/grad_norm")] == [1000.0 + n for n in range(5)]
    assert [(e.step, e.value) for e in train.Scalars("train/steps_per_sec")] == [(100, 10.0), (200, 30.0)]


def test_metrics_records_are_continued_by_a_new_writer(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    for step in (1, 2):
        writer = InBackground(JsonlWriter(path), path)
        writer.write("train", step, {"loss": 1.0 / step})
        writer.close()
    with open(path) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]


# Trains past its checkpoint of step 8, evaluating every 4 steps, and stands still at step 14 until
# killed; every record reaches its file at once (the flush intervals are the test's short deadlines).
PAST_CHECKPOINT = """
import sys, threading
from models import blobs, estimator
import estimax as ex
from estimax.records.writers import JsonlWriter, TensorBoardWriter

JsonlWriter.STORE_FLUSH_SECONDS = TensorBoardWriter.FLUSH_SECONDS = TensorBoardWriter.STORE_FLUSH_SECONDS = 0

class StandStillAt14(ex.Hook):
    def after_loop(self, loop):
        if loop.step_after == 14:
            est.run_dir.checkpoints.wait()  # step 8 committed: the resume starts there
            print("past the checkpoint", flush=True)
            threading.Event().wait()

est = estimator(sys.argv[1], steps_per_loop=2, log_every_steps=2, save_every_steps=8, tensorboard=True)
data = ex.data.from_arrays(*blobs(256))
est.train_and_evaluate(data, data, max_steps=100, eval_every=4, hooks=[StandStillAt14()])
"""


def _records(model_dir):
    with fsspec.open(storage.join(model_dir, "metrics.jsonl")) as f:  # a plain line reader, as a user's
        return [json.loads(line) for line in f]


def _event_steps(model_dir):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    names = [name for name in storage.listdir(model_dir) if name.startswith(events.FILE_PREFIX)]
    return [e.step for name in names for e in EventFileLoader(storage.join(model_dir, name)).Load()]


def _written(model_dir, step):
    """Whether metrics.jsonl and TensorBoard hold ``step`` (a line still being written is not parsed)."""
    metrics = storage.join(model_dir, "metrics.jsonl")
    in_metrics = storage.exists(metrics) and f'"step": {step},'.encode() in storage.read_bytes(metrics)
    return in_metrics and step in _event_steps(model_dir)


def _scalars(logdir, tag):
    """``(step, value)`` of ``tag`` as TensorBoard's two readers give them (the plugin one: what its server
    shows; it takes the first start event of a run as its start, later ones as restarts)."""
    from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
    from tensorboard.util import tensor_util

    legacy = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0})
    plugin = plugin_event_accumulator.EventAccumulator(logdir, size_guidance={"tensors": 0})
    legacy.Reload(), plugin.Reload()
    from_plugin = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in plugin.Tensors(tag)]
    return [(e.step, e.value) for e in legacy.Scalars(tag)], from_plugin


@pytest.mark.parametrize("store", ["disk", "gs"])
def test_records_read_as_one_history_after_a_sigkill_and_a_resume(store, tmp_path, request):
    """SIGKILL once metrics.jsonl and TensorBoard hold steps 10-14 (an evaluation at 12), past the checkpoint
    of step 8; the resumed run (training only) reads as one history, each step once and in order, steps 1-14
    with the values the killed run (uninterrupted until then) wrote, and no evaluation past step 8."""
    model_dir = str(tmp_path / "run")
    if store == "gs":
        request.getfixturevalue("gcs")
        model_dir = f"gs://bkt/history-{tmp_path.name}"
    process = _start([sys.executable, "-c", PAST_CHECKPOINT, model_dir], ready="past the checkpoint")
    while not _written(model_dir, 14):  # the writers' threads reach their files
        assert process.poll() is None
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed = [r for r in _records(model_dir) if r["split"] == "train"]
    assert [r["step"] for r in killed] == list(range(2, 15, 2))
    assert [r["step"] for r in _records(model_dir) if r["split"] == "eval"] == [4, 8, 12]
    killed_events, _ = _scalars(model_dir, "train/loss")
    assert [step for step, _ in killed_events] == list(range(1, 15))

    resumed = estimator(model_dir, steps_per_loop=2, log_every_steps=2, save_every_steps=8, tensorboard=True)
    assert resumed.step == 8
    resumed.train(ex.data.from_arrays(*blobs(256)), max_steps=20)

    records = _records(model_dir)
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)
    train = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(2, 21, 2))
    assert [r["loss"] for r in train[:7]] == [r["loss"] for r in killed]
    assert [(r["split"], r["step"]) for r in records if r["split"] != "train"] == [
        ("eval", 4),
        ("eval", 8),
        ("summary", 20),
    ]
    evaluations = [[step for step, _ in steps] for steps in _scalars(model_dir, "eval/loss")]
    assert evaluations == [[4, 8], [4, 8]]  # the run that resumed wrote no evaluation: its start event dropped 12
    legacy, plugin = _scalars(model_dir, "train/loss")
    assert [step for step, _ in legacy] == [step for step, _ in plugin] == list(range(1, 21))
    assert legacy[:14] == killed_events and plugin[:14] == killed_events
    assert _event_steps(model_dir).count(13) == 2  # the killed run's events stay; the readers drop them


def test_a_run_continuing_from_a_step_drops_the_records_past_it_and_a_line_cut_short(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        json.dumps({"split": split, "step": step}) + "\n" for split, step in [("train", 2), ("eval", 2), ("train", 4)]
    ]
    path.write_text("".join(lines) + "not a record\n" + '{"split": "train", "st')
    writer = JsonlWriter(str(path), continuing_from=2)
    writer.write("train", 3, {"loss": 0.5})
    assert path.read_text() == "".join(lines[:2]) + "not a record\n" + '{"split": "train", "step": 3, "loss": 0.5}\n'


def test_records_past_the_step_are_dropped_wherever_they_are_and_a_file_without_any_is_kept_as_it_is(tmp_path):
    """A dead run's train records past the checkpoint, then an evaluation of that checkpoint: the
    records past it are dropped though the last line is not past it. A file with none is not
    rewritten."""
    path = tmp_path / "metrics.jsonl"
    records = [("train", 2), ("train", 4), ("eval", 2), ("train", 3)]
    lines = [json.dumps({"split": split, "step": step, "loss": 0.25}) + "\n" for split, step in records]
    path.write_text("".join(lines))
    writer = JsonlWriter(str(path), continuing_from=3)
    writer.write("train", 4, {"loss": 0.5})
    writer.close()
    kept = lines[0] + lines[2] + lines[3] + '{"split": "train", "step": 4, "loss": 0.5}\n'
    assert path.read_text() == kept
    inode = path.stat().st_ino
    writer = JsonlWriter(str(path), continuing_from=4)
    writer.write("train", 5, {"loss": 0.125})
    writer.close()
    assert path.stat().st_ino == inode and path.read_text() == kept + '{"split": "train", "step": 5, "loss": 0.125}\n'


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
    process = warm.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
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
        [*command, "--batch-size", "16", "--steps-per-loop", "2", "--log-every-steps", "2", "--max-steps", "100000000"],
        "train step",
    )
    _fill(small_disk)
    process.send_signal(signal.SIGTERM)
    out = process.communicate(timeout=300)[0]
    # Saved and stopped for requeue, or the one line saying what the full disk stopped.
    said = [line for line in out.splitlines() if line.startswith("estimax: error: ")]
    assert process.returncode == 75 or (process.returncode == 2 and len(said) == 1), out
    assert "never retrieved" not in out, out  # asyncio's echo of the failed save is kept off the console


def test_a_writer_whose_store_stopped_answering_reports_the_store_not_itself():
    """A store past its deadline is the store's one line and exit code (74), not a writer failure."""
    from estimax.errors import STORE_FAILURE_EXIT_CODE, StoreUnavailableError
    from estimax.records.writer_thread import InBackground

    class Stalled:
        def write(self, split, step, values):
            raise StoreUnavailableError("gs://b/run/metrics.jsonl: writing: the store did not answer for 120 s")

        def close(self):
            pass

    writer = InBackground(Stalled(), "gs://b/run/metrics.jsonl")
    writer.write("train", 1, {"loss": 1.0})
    with pytest.raises(StoreUnavailableError, match=r"^gs://b/run/metrics.jsonl: writing: the store did not") as e:
        writer.close()
    assert e.value.exit_code == STORE_FAILURE_EXIT_CODE == 74
