"""A follower evaluates every checkpoint a trainer commits, once and in step order, whatever fails.

Real processes (``follow_job.py``): a trainer on 8 devices and a follower on 4 (it restores
into another mesh), killed with SIGKILL inside a restore and inside the write of a record,
a trainer preempted with SIGTERM and resumed, a trainer keeping one checkpoint while the
follower reads slowly, and a store stalled with SIGSTOP under the follower. Results are
compared with ``Estimator.evaluate(checkpoint=N)`` of the same step in this process.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import warm
from follow_job import EVAL, eval_input
from helpers import user_env
from models import estimator

import estimax as ex
from estimax import storage
from estimax.run.holds import Hold, live_floors
from estimax.serving.export_base import versions

JOB = os.path.join(os.path.dirname(__file__), "follow_job.py")
ERROR = "estimax: error: "


def _start(kind: str, model_dir: str, *args, **env) -> subprocess.Popen:
    return warm.Popen(
        [sys.executable, JOB, kind, model_dir, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, **{k: str(v) for k, v in env.items()}},
    )  # fmt: skip


def _following(model_dir: str, *args, **env) -> subprocess.Popen:
    """A follower, once it holds the run's unread steps (its readiness line)."""
    process = _start("follow", model_dir, *args, **env)
    for line in process.stdout:
        if line.strip() == "following":
            return process
    raise AssertionError(f"the follower never started: exit {process.wait()}: {process.stderr.read()[-2000:]}")


def _finished(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def _records(model_dir: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_bytes(f"{model_dir}/evaluations/eval.jsonl").splitlines()]


def _model_dir(store: str, request, tmp_path) -> str:
    if store == "disk":
        return str(tmp_path / "run")
    request.getfixturevalue("gcs" if store == "gs" else "s3")
    return f"{store}://bkt/follow-{tmp_path.name}"


def _check_against_reference(model_dir: str, records: list[dict]) -> None:
    """Each record of a step still kept equals ``evaluate(checkpoint=step)`` here, on 8 devices."""
    est = estimator(model_dir, eval_batch_size=32)
    kept = [r for r in records if r["step"] in est.run_dir.checkpoints.steps()]
    assert kept, "no evaluated step is kept to compare with"
    for record in kept:
        reference = est.evaluate(eval_input(), checkpoint=record["step"])
        assert record["num_examples"] == reference["num_examples"] == EVAL
        for name in ("loss", "accuracy"):
            assert math.isclose(record[name], reference[name], rel_tol=1e-5), (record, reference)


def _check_tensorboard(model_dir: str, records: list[dict], trained_to: int) -> None:
    """The run is one TensorBoard run, as TensorBoard's own reader reads it: the trainers' every step once
    and the follower's evaluations (its files beside theirs) at the steps and with the values it recorded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    if not storage.is_url(model_dir):
        runs = EventMultiplexer().AddRunsFromDirectory(model_dir)
        assert list(runs.Runs()) == ["."]
    events = EventAccumulator(model_dir, size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, trained_to + 1))
    for name in ("loss", "accuracy"):
        evaluated = [(e.step, e.value) for e in events.Scalars(f"eval/{name}")]
        assert evaluated == [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in records]


def _wait_for_records(model_dir: str, count: int, process: subprocess.Popen) -> None:
    while not (storage.exists(f"{model_dir}/evaluations/eval.jsonl") and len(_records(model_dir)) >= count):
        assert process.poll() is None, process.communicate()
        time.sleep(0.1)


@pytest.mark.parametrize("store", ["disk", "gs", "s3"])
def test_every_checkpoint_is_evaluated_once_in_order_though_the_trainer_keeps_one(store, request, tmp_path):
    model_dir = _model_dir(store, request, tmp_path)
    follower = _following(model_dir, SLOW_RESTORE=0.3)  # before the trainer: it waits for the first checkpoint
    code, out, err = _finished(_start("train", model_dir, 10, 1))  # keep=1, saving faster than the follower reads
    assert code == 0, err
    code, out, err = _finished(follower)
    assert code == 0, err
    records = _records(model_dir)
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10], records
    assert json.loads(out.strip().splitlines()[-1]) == records  # what follow() returned
    assert all(r["lag_seconds"] >= 0 and "skipped" not in r and "missed" not in r for r in records)
    _check_tensorboard(model_dir, records, trained_to=10)  # before the reference's evaluations add theirs
    _check_against_reference(model_dir, records)
    assert live_floors(model_dir) == []  # released at its end


def test_newest_only_evaluates_the_newest_and_records_the_steps_it_skipped(tmp_path):
    model_dir = str(tmp_path / "run")
    follower = _following(model_dir, "--newest-only", SLOW_RESTORE=1.5)
    code, out, err = _finished(_start("train", model_dir, 16, 1, SLOW_SECONDS=0.2))
    assert code == 0, err
    code, out, err = _finished(follower)
    assert code == 0, err
    records = _records(model_dir)
    steps = [r["step"] for r in records]
    skipped = [s for r in records for s in r.get("skipped", [])]
    assert steps == sorted(steps) and steps[-1] == 16
    assert sorted(steps + skipped) == list(range(2, 17, 2)), records  # each committed step once: read or skipped
    assert skipped, "the follower was never behind"
    assert all(max(r.get("skipped", [0])) < r["step"] for r in records)
    assert "steps are skipped (newest only" in err or "are skipped (newest only" in err
    _check_against_reference(model_dir, records[-1:])


def test_a_follower_killed_in_a_restore_and_in_a_record_misses_nothing_and_repeats_nothing(tmp_path):
    model_dir = str(tmp_path / "run")
    first = _following(model_dir, KILL_IN_RESTORE=4, HOLD_SECONDS=60)
    second = _start("follow", model_dir)
    code, out, err = _finished(second)  # a second follower of the same run and set is refused
    assert code == 2 and err.strip().startswith(ERROR + "Another follower of") and len(err.strip().splitlines()) == 1
    trainer = _start("train", model_dir, 12, 1, SLOW_SECONDS=0.3)
    assert _finished(first)[0] == -signal.SIGKILL
    # Started again at once on this host (the dead one's pid is free): it takes the hold over.
    code, out, err = _finished(_following(model_dir, KILL_IN_RECORD=8, HOLD_SECONDS=60))
    assert code == -signal.SIGKILL
    assert not storage.read_bytes(f"{model_dir}/evaluations/eval.jsonl").endswith(b"\n")  # a record cut short
    third = _following(model_dir, HOLD_SECONDS=60)
    assert _finished(trainer)[0] == 0
    code, out, err = _finished(third)
    assert code == 0, err
    records = _records(model_dir)
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12], records
    assert not any("missed" in r for r in records)
    _check_against_reference(model_dir, records)


def test_a_preempted_and_resumed_trainer_is_followed_to_its_end(tmp_path):
    model_dir = str(tmp_path / "run")
    follower = _following(model_dir)
    trainer = _start("train", model_dir, 14, 2, SLOW_SECONDS=1.0)
    while not os.path.isdir(f"{model_dir}/checkpoints/4"):  # training, with steps left to train
        assert trainer.poll() is None and follower.poll() is None, trainer.communicate()
        time.sleep(0.1)
    trainer.send_signal(signal.SIGTERM)
    code, out, err = _finished(trainer)
    assert code == 75, err
    assert follower.poll() is None, follower.communicate()  # training has not ended: the follower waits
    code, out, err = _finished(_start("train", model_dir, 14, 2))
    assert code == 0, err
    code, out, err = _finished(follower)
    assert code == 0, err
    records = _records(model_dir)
    steps = [r["step"] for r in records]
    assert steps == list(range(2, 15, 2)), records  # each once, the preempted call's and the resumed one's
    _check_tensorboard(model_dir, records, trained_to=14)  # the resumed call's start dropped none of its
    _check_against_reference(model_dir, records)


def test_a_stalled_store_ends_the_follower_within_its_deadline_and_it_resumes_where_it_was(gcs, tmp_path):
    model_dir = f"gs://bkt/follow-stall-{tmp_path.name}"
    code, out, err = _finished(_start("train", model_dir, 8, 10))  # trained to its end: the follower catches up
    assert code == 0, err
    follower = _following(model_dir, SLOW_RESTORE=1, ESTIMAX_STORE_DEADLINE_SECONDS=8)
    _wait_for_records(model_dir, 1, follower)
    with gcs.stalled():
        code, out, err = _finished(follower, timeout=60)
    assert code == 74, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(ERROR) and "expected a store that answers within 8 s" in last, err
    done = [r["step"] for r in _records(model_dir)]
    code, out, err = _finished(_start("follow", model_dir))
    assert code == 0, err
    records = _records(model_dir)
    assert [r["step"] for r in records] == [2, 4, 6, 8], records
    assert [r["step"] for r in json.loads(out.strip().splitlines()[-1])] == [s for s in (2, 4, 6, 8) if s not in done]


def test_a_hold_keeps_steps_until_it_expires_and_refuses_a_second_follower(tmp_path):
    model_dir = str(tmp_path / "run")
    hold = Hold(model_dir, "eval", seconds=1.0)
    hold.take(6)
    assert live_floors(model_dir) == [6]
    with pytest.raises(ex.ModelDirLockedError, match="Another follower of .* for 'eval' is running"):
        Hold(model_dir, "eval", seconds=1.0).take(0)
    Hold(model_dir, "test", seconds=1.0).take(2)  # another set: a hold of its own
    assert sorted(live_floors(model_dir)) == [2, 6]
    time.sleep(1.1)  # neither renewed: both expired
    assert live_floors(model_dir) == []
    Hold(model_dir, "eval", seconds=1.0).take(8)  # an expired hold is taken over
    assert live_floors(model_dir) == [8]


def test_the_command_line_follows_a_run_to_its_end(tmp_path):
    model_dir = str(tmp_path / "run")
    env = user_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(JOB)), env.get("PYTHONPATH")]))

    def cli(*args):
        command = [sys.executable, "-m", "estimax.cli", *args, "--example", "lstm", "--model-dir", model_dir]
        return warm.run(command, capture_output=True, text=True, env=env, timeout=300)

    wrong = cli("evaluate", "--newest-only")
    assert wrong.returncode == 2 and "--newest-only without --follow" in wrong.stderr, wrong.stderr
    trained = cli("train", "--max-steps", "4")
    assert trained.returncode == 0, trained.stderr
    followed = cli("evaluate", "--follow", "--eval-set", "held-out", "--poll-seconds", "0.1", "--hold-seconds", "5")
    assert followed.returncode == 0, followed.stderr
    records = [json.loads(line) for line in open(f"{model_dir}/evaluations/held-out.jsonl")]
    assert [r["step"] for r in records] == [4]  # the checkpoint at the end of the call
    assert json.loads(followed.stdout.strip().splitlines()[-1]) == records[-1]


@pytest.mark.parametrize("store", ["disk", "gs"])
def test_the_follower_keeps_the_best_and_exports_it_as_whole_versions(store, request, tmp_path):
    model_dir = _model_dir(store, request, tmp_path)
    base = str(tmp_path / "base") if store == "disk" else f"gs://bkt/base-{tmp_path.name}"
    follower = _following(model_dir, EXPORT_BASE=base)
    assert _finished(_start("train", model_dir, 10, 1))[0] == 0
    code, out, err = _finished(follower)
    assert code == 0, err
    records = _records(model_dir)
    losses = [r["loss"] for r in records]
    improved = [r["step"] for i, r in enumerate(records) if r["loss"] < min(losses[:i], default=math.inf)]
    assert [r["step"] for r in records if r.get("best")] == improved  # each new best by loss, in order
    assert versions(base) == improved[-2:]  # the newest two kept
    assert all(name.isdigit() for name in storage.listdir(base))  # no staging or half version left
    best_step = improved[-1]
    best_dir = f"{model_dir}/evaluations/eval-best/{best_step}"
    assert storage.listdir(f"{model_dir}/evaluations/eval-best") == [str(best_step)]
    # The exported version answers as the kept best checkpoint predicts, without the model's code.
    features = {"x": eval_input().features["x"][:8]}
    served = ex.serving.load(f"{base}/{best_step}")(features)["class"]
    rows = list(estimator(model_dir).predict(ex.data.from_arrays(features), checkpoint=best_dir))
    assert list(served) == [row["class"] for row in rows]
    _check_against_reference(model_dir, records)


def test_the_trainers_keep_spares_the_steps_a_live_hold_holds_and_deletes_them_once_it_is_gone(model_dir):
    from follow_job import blobs

    hold = Hold(model_dir, "eval", seconds=3.0)
    hold.take(4)  # a follower that has read up to step 3, alive: its hold renewed meanwhile
    est = estimator(model_dir, steps_per_loop=2, checkpoint=ex.CheckpointPolicy(every_steps=2, keep=1))
    with hold.keep_alive():
        est.train(ex.data.from_arrays(*blobs(256)), max_steps=8)
    assert est.run_dir.checkpoints.steps() == [4, 6, 8]  # step 2 went; 4 and 6 are held
    assert live_floors(model_dir) == []  # released at the block's end (an expired one reads the same)
    est.train(ex.data.from_arrays(*blobs(256)), max_steps=10)
    assert est.run_dir.checkpoints.steps() == [10]
