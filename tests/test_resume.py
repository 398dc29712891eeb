"""Killed and resumed runs end exactly where an uninterrupted run ends (real subprocesses)."""

import os
import signal
import sys

import numpy as np
import pytest
import warm
from helpers import (
    RESUMABLE_STEPS,
    final_params,
    job_env,
    saved_checkpoints,
    start_resumable,
    train_losses,
    wait_for,
)

from estimax.group.preemption import PreemptionWatch
from estimax.run.holder import LOCK_FILE


def _run(model_dir, max_steps=RESUMABLE_STEPS):
    process = start_resumable(model_dir, max_steps)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, out
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("uninterrupted") / "run")
    _run(model_dir)
    return final_params(model_dir), train_losses(model_dir)


def _assert_identical(model_dir, uninterrupted):
    (step, params), losses = final_params(model_dir), train_losses(model_dir)
    (ref_step, ref_params), ref_losses = uninterrupted
    assert step == ref_step == RESUMABLE_STEPS
    for name, value in ref_params.items():
        np.testing.assert_array_equal(params[name], value)  # bitwise
    assert losses == ref_losses and len(losses) == RESUMABLE_STEPS


def test_sigkill_at_three_points_then_resume_is_bitwise_identical(tmp_path, uninterrupted):
    model_dir = str(tmp_path / "run")
    # 1: soon after the first checkpoint.
    process = start_resumable(model_dir)
    wait_for(process, lambda: len(saved_checkpoints(model_dir)[0]) > 0)
    process.kill()
    process.wait()
    # 2: during an async save (a temporary directory is being written); retried until caught in the act.
    for _attempt in range(5):
        process = start_resumable(model_dir)
        wait_for(process, lambda: saved_checkpoints(model_dir)[1] and max(saved_checkpoints(model_dir)[0] or [0]) >= 12)
        process.kill()
        process.wait()
        if saved_checkpoints(model_dir)[1]:
            break
    assert saved_checkpoints(model_dir)[1], "no kill landed during a save"
    # 3: later on.
    process = start_resumable(model_dir)
    wait_for(process, lambda: max(saved_checkpoints(model_dir)[0] or [0]) >= 25)
    process.kill()
    process.wait()
    _run(model_dir)
    assert not saved_checkpoints(model_dir)[1]  # leftovers of the killed save were cleaned up
    _assert_identical(model_dir, uninterrupted)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_and_exits_for_requeue(tmp_path, uninterrupted, signum):
    model_dir = str(tmp_path / "run")
    process = start_resumable(model_dir)
    wait_for(process, lambda: max(saved_checkpoints(model_dir)[0] or [0]) >= 10)
    process.send_signal(signum)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 75, out
    stopped = int(out.split("training stopped at step ")[1].split()[0])
    assert max(saved_checkpoints(model_dir)[0]) == stopped and stopped < RESUMABLE_STEPS
    assert f"{signal.Signals(signum).name} received" in out
    _run(model_dir)
    _assert_identical(model_dir, uninterrupted)


def test_a_signal_during_evaluation_saves_and_exits_without_finishing_it(tmp_path):
    model_dir = str(tmp_path / "run")
    process = start_resumable(model_dir, RESUMABLE_STEPS, "evaluate")
    seen, trained = [], False
    # The first evaluation (after step 5) has begun; the input also says "evaluating" when the
    # call's start-of-call check reads its first batch, before training.
    while not (trained and seen[-1].strip() == "evaluating"):
        seen.append(process.stdout.readline())
        assert seen[-1], "".join(seen)
        trained = trained or "train step 5 " in seen[-1]
    process.send_signal(signal.SIGTERM)  # 200 slow evaluation batches (10 s) are still to come
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 75, "".join(seen) + out
    assert "evaluation input exhausted" not in out, "the evaluation was not interrupted"
    assert max(saved_checkpoints(model_dir)[0]) == 5 and "training stopped at step 5" in out


def test_a_plain_generator_resumed_from_a_checkpoint_is_said_to_start_again(model_dir, estimax_log):
    """estimax cannot position a plain iterable: a resumed run says so in one line instead of silently
    replaying the generator's first batches; within one process a generator goes on where it was."""
    from models import blobs, estimator

    features, labels = blobs(256)

    def batches():
        for i in range(0, 256, 32):
            yield {"x": features["x"][i : i + 32]}, labels[i : i + 32]

    first = estimator(model_dir, steps_per_loop=2)
    generator = batches()
    first.train(generator, max_steps=2)
    first.train(generator, max_steps=4)  # the same process: the generator goes on, nothing to say
    assert not [r for r in estimax_log.records if "cannot know where an iterable stood" in r.getMessage()]
    estimator(model_dir, steps_per_loop=2).train(batches(), max_steps=6)
    said = [r.getMessage() for r in estimax_log.records if "cannot know where an iterable stood" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("Resuming at step 4 from a checkpoint with a "), said


SIGNAL_BEFORE_THE_FIRST_LOOP = """
import os, signal, sys
from models import blobs, estimator
import estimax as ex

class SignalAtBegin(ex.Hook):
    def begin(self, info):  # the model_dir's lock is held and the state restored; no loop has run
        os.kill(os.getpid(), signal.SIGTERM)

estimator(sys.argv[1], steps_per_loop=2).train(ex.data.from_arrays(*blobs(64)), max_steps=10, hooks=[SignalAtBegin()])
"""


def test_a_sigterm_before_the_first_loop_saves_after_it_and_exits_for_requeue(tmp_path):
    """A signal while a call sets up (its lock taken) is answered as one during training, not by dying."""
    model_dir = str(tmp_path / "run")
    command = [sys.executable, "-c", SIGNAL_BEFORE_THE_FIRST_LOOP, model_dir]
    result = warm.run(command, env=job_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 75, result.stdout + result.stderr
    assert "SIGTERM: training stopped at step 2 after saving a checkpoint" in result.stderr, result.stderr
    assert saved_checkpoints(model_dir)[0] == [2] and not os.path.exists(os.path.join(model_dir, LOCK_FILE))


def test_a_signal_no_loop_answered_reaches_the_previous_handler_when_the_watch_ends():
    """A call with nothing to train still ends as the signal asks, once its watch is over."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        with PreemptionWatch() as watch:
            signal.raise_signal(signal.SIGTERM)
            assert watch.signal_name == "SIGTERM" and received == []  # remembered, not delivered
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
