"""A run resumed with another number of processes or devices: every input continues at the next
example, or is refused before the first step; the state is resharded; the change is recorded.

Random-access inputs are checked by reading them as 2 processes, then 3, against one process
(cheap: no devices); the whole path by real groups on 127.0.0.1 (tests/resize_job.py).
"""

import json
import os
import re
import sys

import grain
import numpy as np
import pytest
import warm
from helpers import job_env
from models import blobs, estimator

import estimax as ex
from estimax.data import arrayrecord, feed, tfrecord
from estimax.data.plan import POSITIONS
from estimax.run import resize

TESTS = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(TESTS, "resize_job.py")
N, GLOBAL_BATCH = 103, 12  # 8 steps an epoch, 7 examples of each epoch dropped


def _input(kind, tmp_path):
    features, labels = blobs(N)
    rows = [{"x": features["x"][i], "id": i, "label": labels[i]} for i in range(N)]
    if kind == "arrays":
        return ex.data.from_arrays({"x": features["x"], "id": np.arange(N)}, labels)
    if kind == "grain":
        return ex.data.from_grain(
            grain.MapDataset.source(rows).map(lambda r: ({"x": r["x"], "id": r["id"]}, r["label"]))
        )
    if kind == "hf":
        import datasets

        table = datasets.Dataset.from_dict({"x": features["x"], "id": np.arange(N), "label": labels})
        return ex.data.from_hf(table, ["x", "id"], label="label")
    spec = {
        "x": tfrecord.Feature(np.float32, (6,)),
        "id": tfrecord.Feature(np.int64),
        "label": tfrecord.Feature(np.int32),
    }
    for k, part in enumerate(np.array_split(np.arange(N), 3)):  # 3 files: not a multiple of 2 processes
        module = tfrecord if kind == "tfrecord" else arrayrecord
        module.write(str(tmp_path / f"part-{k}.{kind}"), (rows[i] for i in part))
    reader = tfrecord.tfrecord if kind == "tfrecord" else ex.data.array_record
    return reader(str(tmp_path / f"part-*.{kind}"), spec, label="label")


def _global_batches(source, start: int, steps: int, processes: int) -> np.ndarray:
    """The ids of global batches ``start`` .. ``start + steps`` as ``processes`` processes read them."""
    host = GLOBAL_BATCH // processes
    parts = [
        np.concatenate([s[0]["id"] for s in feed.train_stacks(source, host, [steps], seed=7, start_step=start,
                                                               shard=feed.Shard(p, processes))])
        for p in range(processes)
    ]  # fmt: skip
    return np.concatenate(parts, axis=1)  # (steps, global batch): each process holds its block of rows


@pytest.mark.parametrize("kind", ["arrays", "grain", "tfrecord", "array_record", "hf"])
def test_a_random_access_input_continues_at_the_next_example_in_any_shape(kind, tmp_path):
    source = _input(kind, tmp_path)
    per_epoch = source.steps_per_epoch(GLOBAL_BATCH // 2, 2)
    assert per_epoch == source.steps_per_epoch(GLOBAL_BATCH, 1) == N // GLOBAL_BATCH
    # 2 processes to step 5, then 3 processes through the end of the second epoch, then 1.
    resized = np.concatenate(
        [_global_batches(source, 0, 5, 2), _global_batches(source, 5, 9, 3), _global_batches(source, 14, 2, 1)]
    )
    np.testing.assert_array_equal(resized, _global_batches(source, 0, 16, 1))  # the same global batches
    for epoch in resized.reshape(2, -1):  # each example at most once an epoch, across the change
        assert len(np.unique(epoch)) == per_epoch * GLOBAL_BATCH


def test_a_stream_keeps_every_process_position_and_refuses_another_shape(tmp_path):
    plan = estimator(train_batch_size=8, steps_per_loop=4).plan
    examples = grain.MapDataset.range(1000).map(lambda i: ({"x": np.full(6, i, np.float32)}, np.int32(i % 3)))
    stream = ex.data.from_grain(lambda i, n: examples[i::n].to_iter_dataset())
    chunks = list(plan.train_chunks(stream, 0, 8))
    saved = plan.saved_position(chunks[0].input_state)  # one process: a list of one position
    assert saved == {"format": POSITIONS, "processes": 1, "positions": [chunks[0].input_state]}
    resumed = next(iter(plan.train_chunks(stream, 4, 8, saved)))
    np.testing.assert_array_equal(resumed.stack[0]["x"], chunks[1].stack[0]["x"])  # the next example
    by_two = {**saved, "processes": 2, "positions": [chunks[0].input_state] * 2}
    with pytest.raises(
        ex.errors.InputError,
        match=r"a Grain IterDataset per process \(from_grain\): a stream whose "
        r"position at step 4 was saved by 2 processes, and this run has 1.*Fix: resume with 2",
    ):
        plan.train_chunks(stream, 4, 8, by_two)
    # A plain iterable has no position to save: resuming it in another shape is refused.
    with pytest.raises(ex.errors.InputError, match=r"a plain iterable of batches \(list\).*trained by 2 processes"):
        plan.check_resize([], 2, 4)
    plan.check_resize([], 1, 4)  # the same shape: the caller's iterable goes on as before


def _run(processes: int, devices: int, *job_args, ok: bool = True) -> str:
    command = [sys.executable, JOB, *job_args]
    if processes > 1:
        command = [sys.executable, "-m", "estimax.cli", "launch", "--num-processes", str(processes),
                   "--devices-per-process", str(devices), "--", *command]  # fmt: skip
    done = warm.run(command, env=job_env(JAX_NUM_CPU_DEVICES=str(devices)), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done.stdout + done.stderr


def _params(out) -> dict:
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def test_a_group_resumes_in_another_shape_like_a_run_that_never_stopped(tmp_path):
    run, ref = str(tmp_path / "run"), str(tmp_path / "ref")
    _run(2, 4, run, str(tmp_path / "a"), "12", "grain")  # 2 processes x 4 devices to step 12
    log = _run(1, 8, run, str(tmp_path / "b"), "24", "grain")  # then 1 process x 8 devices to 24
    assert (
        "Resuming step 12 in another shape: 2 processes, 8 devices (mesh data=8) when saved, 1 process, 8 devices "
        "(mesh data=8) now" in log
    )
    _run(1, 8, ref, str(tmp_path / "r"), "24", "grain")  # uninterrupted
    resumed, reference = _params(tmp_path / "b"), _params(tmp_path / "r")
    assert resumed["step"] == reference["step"] == 24
    for name, value in reference["params"].items():
        np.testing.assert_allclose(resumed["params"][name], value, rtol=1e-5, atol=1e-6)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        (record,) = [r for r in map(json.loads, f) if r["split"] == "resize"]
    assert record["step"] == 12 and (record["processes_before"], record["processes"]) == (2, 1)
    assert (record["devices_before"], record["devices"]) == (8, 8) and record["seconds_since_checkpoint"] >= 0
    assert record["steps_redone"] == 0  # the run before stopped at its checkpoint
    assert re.search(r"This run changed shape 1 time: [\d.]+ s from those checkpoints to training again, 0 steps "
                     r"trained again; step goodput 1\.000 \(24 steps kept of 24 trained\)", log), log  # fmt: skip

    # A stream: each process's own position is saved; another number of processes is refused, nothing trained.
    stream = str(tmp_path / "stream")
    _run(2, 4, stream, str(tmp_path / "c"), "8", "stream")
    with open(os.path.join(stream, "checkpoints", "8", "meta", "metadata")) as f:  # Orbax's JsonSave
        position = json.load(f)["input_state"]
    assert position["processes"] == 2 and len(position["positions"]) == 2
    log = _run(1, 8, stream, str(tmp_path / "d"), "16", "stream", ok=False)
    assert "InputError: The training input is a Grain IterDataset per process (from_grain)" in log
    assert sorted(os.listdir(os.path.join(stream, "checkpoints"))) == ["4", "8"]


def test_the_cost_of_the_changes_of_shape_adds_up_over_the_run():
    resizes = [{"seconds_since_checkpoint": 30.5, "steps_redone": 4}, {"seconds_since_checkpoint": float("nan")}]
    records = {"resize": resizes}.get
    assert resize.totals(lambda split: records(split, []), 100) == (
        "This run changed shape 2 times: 30.5 s from those checkpoints to training again, 4 steps trained again; "
        "step goodput 0.962 (100 steps kept of 104 trained)."
    )
    assert resize.totals(lambda split: [], 100) is None
