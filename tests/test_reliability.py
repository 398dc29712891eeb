"""Nothing lost, nothing silent: healing damaged checkpoints, one writer per model_dir, Ctrl-C at a
prompt, no silent initial weights, checks before the first step, and estimax's own errors.

Real processes, real files and real signals: ``reliability_job.py`` and ``python -m estimax.cli``
run as subprocesses, a read-only bind mount and a small tmpfs where this machine allows mounting.
"""

import contextlib
import dataclasses
import gzip
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import optax
import pytest
import warm
from helpers import job_env, read_only
from models import blobs, estimator

import estimax as ex
from estimax.errors import EvaluationError, LeaseLostError, ModelDirLocked, ModelDirNotWritable
from estimax.estimator import UntrainedWarning
from estimax.run.checkpoint import Checkpointer
from estimax.run.holder import LOCK_FILE, RUN_ID, process_start, this_process
from estimax.run.lock import Lock

TESTS = os.path.dirname(__file__)
JOB = os.path.join(TESTS, "reliability_job.py")
DATA = ex.data.from_arrays(*blobs(256))


def _steps(model_dir):
    root = os.path.join(model_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(root) if n.isdigit()) if os.path.isdir(root) else []


def _job(model_dir, max_steps, *extra, expect=0):
    done = warm.run(
        [sys.executable, JOB, model_dir, str(max_steps), *extra], capture_output=True, text=True, timeout=180
    )
    out = done.stdout + done.stderr
    assert done.returncode == expect, out
    return out


def _wait_for(condition, process, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _truncate_arrays(model_dir, step):
    root = os.path.join(model_dir, "checkpoints", str(step), "state")
    for r, _, files in os.walk(root):
        for f in files:
            if os.path.basename(r) == "d":
                path = os.path.join(r, f)
                os.truncate(path, os.path.getsize(path) // 2)


# -- 1: heal, don't loop -----------------------------------------------------------


def test_a_damaged_checkpoint_is_moved_aside_and_saved_again(model_dir):
    estimator(model_dir, loop="step", steps_per_loop=2, save_every_steps=2).train(DATA, max_steps=8)
    assert _steps(model_dir) == [4, 6, 8]
    _truncate_arrays(model_dir, 8)
    out = _job(model_dir, 8)  # falls back to 6, moves 8 aside, retrains 7-8 and saves 8 again
    assert "checkpoints/8 cannot be used" in out and "Restored step 6" in out
    assert "Moved the damaged checkpoint" in out and "Saved step 8 again" in out
    names = os.listdir(os.path.join(model_dir, "checkpoints"))
    aside = [n for n in names if n.startswith("8.corrupt-")]
    assert len(aside) == 1 and _steps(model_dir) == [4, 6, 8]
    assert os.listdir(os.path.join(model_dir, "checkpoints", aside[0], "state"))  # kept, for inspection
    out = _job(model_dir, 8)  # the third run restores the newest step, without falling back
    assert "Restored checkpoint step 8" in out and "cannot be used" not in out
    reader = estimator(model_dir)
    reader.evaluate(DATA)
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f][-1] == 8  # evaluate used the newest step


def test_a_writer_taken_over_while_it_restores_moves_nothing_aside_and_ends_with_the_locks_error(
    model_dir, monkeypatch
):
    estimator(model_dir, loop="step", steps_per_loop=2, save_every_steps=2).train(DATA, max_steps=8)
    _truncate_arrays(model_dir, 8)
    monkeypatch.setenv(RUN_ID, "run-a")  # an attempt of a run: a later one takes its lock over at once
    restore = Checkpointer.restore

    def taken_over_meanwhile(self, abstract_state, step=None):
        path = os.path.join(model_dir, LOCK_FILE)
        with open(path) as f:
            record = json.load(f)
        record["attempt_started"] += 1  # a later attempt's record: what a takeover writes
        with open(path, "w") as f:
            json.dump(record, f)
        return restore(self, abstract_state, step)

    monkeypatch.setattr(Checkpointer, "restore", taken_over_meanwhile)
    with pytest.raises(LeaseLostError, match="took over"):  # the lock's error (exit 74), not damage
        estimator(model_dir, loop="step", steps_per_loop=2, save_every_steps=2).train(DATA, max_steps=10)
    names = os.listdir(os.path.join(model_dir, "checkpoints"))
    assert _steps(model_dir) == [4, 6, 8] and not [n for n in names if ".corrupt-" in n], names  # the new writer's


# -- 2: one writer per model_dir ---------------------------------------------------


def test_a_second_estimax_train_on_the_same_model_dir_fails_naming_the_first(tmp_path):
    model_dir = str(tmp_path / "run")
    command = [sys.executable, "-m", "estimax.cli", "train", "--model-dir", model_dir, "--loop", "step"]
    command += ["--batch-size", "16", "--steps-per-loop", "2"]
    # Far more steps than the second process needs to start: the first one is still writing then.
    first = warm.Popen([*command, "--max-steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _wait_for(lambda: os.path.exists(os.path.join(model_dir, LOCK_FILE)), first)
    second = warm.run([*command, "--max-steps", "12"], capture_output=True, text=True, timeout=180)
    out = second.stdout + second.stderr
    assert first.poll() is None, "the first writer ended before the second started"
    assert second.returncode == 2 and "estimax: error: " in out and "Traceback" not in out, out  # one line
    assert f"model_dir {model_dir} is being written by another process: host {socket.gethostname()}, " in out
    assert f"pid {first.pid}" in out and "estimax.cli train" in out and "Training steps" not in out
    first.send_signal(signal.SIGTERM)  # the first writer saves where it is and exits for requeue
    first_out = first.communicate(timeout=180)[0].decode()
    assert first.returncode == 75, first_out
    assert _steps(model_dir) and not os.path.exists(os.path.join(model_dir, LOCK_FILE))
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train_steps = [r["step"] for r in records if r["split"] == "train"]
    assert train_steps == sorted(set(train_steps))  # one writer: no step twice


def test_the_stale_lock_of_a_killed_writer_is_taken_over(model_dir):
    process = warm.Popen([sys.executable, JOB, model_dir, "400", "slow"], stdout=subprocess.PIPE, text=True)
    _wait_for(lambda: _steps(model_dir), process)
    process.kill()
    process.wait()
    with open(os.path.join(model_dir, LOCK_FILE)) as f:
        assert json.load(f)["pid"] == process.pid  # left behind by the killed process
    out = _job(model_dir, max(_steps(model_dir)) + 2)
    assert f"Took over the stale lock of model_dir {os.path.abspath(model_dir)}: its holder is gone" in out
    assert f"pid {process.pid}" in out and not os.path.exists(os.path.join(model_dir, LOCK_FILE))


def test_a_reused_pid_is_stale_and_another_hosts_lock_is_not(tmp_path, caplog):
    path = tmp_path / LOCK_FILE
    alive = dataclasses.replace(this_process(), process_start=process_start(os.getpid()) - 1)  # this pid, earlier
    path.write_text(alive.to_json())
    with Lock(str(tmp_path)) as lock:
        assert json.loads(path.read_text())["process_start"] == process_start(os.getpid()) and lock.held
    assert "Took over the stale lock" in caplog.text and not path.exists()
    path.write_text(dataclasses.replace(this_process(), host="elsewhere", pid=12345).to_json())
    with pytest.raises(ModelDirLocked, match=r"being written by another process: host elsewhere, pid 12345.*delete"):
        estimator(str(tmp_path)).train(DATA, max_steps=2)


def test_a_group_of_processes_takes_one_lock_and_fails_together(tmp_path):
    model_dir, holder = str(tmp_path / "run"), dataclasses.replace(this_process(), host="elsewhere", pid=4242).to_json()
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, LOCK_FILE), "w") as f:
        f.write(holder)
    env = job_env()
    command = [sys.executable, "-m", "estimax.cli", "launch", "--num-processes", "2", "--devices-per-process", "4"]
    command += ["--", sys.executable, os.path.join(TESTS, "multihost_job.py"), model_dir, str(tmp_path / "out")]
    done = subprocess.run([*command, "train", "8"], env=env, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    # Process 0 tried the lock; process 1 learnt the outcome from it: both stop with the same error.
    assert out.count("ModelDirLockedError: model_dir") >= 2 and "host elsewhere, pid 4242" in out, out
    assert _steps(model_dir) == [] and open(os.path.join(model_dir, LOCK_FILE)).read() == holder


def test_evaluate_of_a_run_in_training_writes_nothing_into_it(model_dir, caplog):
    estimator(model_dir).train(DATA, max_steps=4)
    with Lock(model_dir):  # another writer
        results = estimator(model_dir).evaluate(DATA)
    assert results["num_examples"] == 256
    assert "evaluation of step 4 is not written" in caplog.text
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        assert all(json.loads(line)["split"] != "eval" for line in f)


# -- 3: Ctrl-C at an interactive prompt --------------------------------------------


def _read_until(fd, text, timeout=120):
    seen, deadline = b"", time.monotonic() + timeout
    while text.encode() not in seen:
        assert time.monotonic() < deadline, f"no {text!r} in {seen.decode(errors='replace')}"
        if select.select([fd], [], [], 0.5)[0]:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
    return seen.decode(errors="replace")


def test_ctrl_c_at_an_interactive_prompt_keeps_the_trained_state():
    main, terminal = os.openpty()  # `python -i` on a terminal: the prompt a person types at
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), TESTS])}
    python = subprocess.Popen(
        [sys.executable, "-i", "-q"], stdin=terminal, stdout=terminal, stderr=terminal, env=env, close_fds=True
    )
    os.close(terminal)
    try:
        code = (
            "import sys, time, estimax as ex; from models import blobs, estimator; "
            "est = estimator(None, loop='step', steps_per_loop=1); "
            "Slow = type('Slow', (ex.Hook,), {'after_loop': lambda self, loop: "
            "(print('TRAIN' + 'ING', flush=True), time.sleep(0.05))}); "
            "est.train(ex.data.from_arrays(*blobs(256)), max_steps=10**6, hooks=[Slow()])\n"
        )
        _read_until(main, ">>> ")
        os.write(main, code.encode())
        _read_until(main, "TRAINING")
        python.send_signal(signal.SIGINT)  # what Ctrl-C on the terminal sends
        out = _read_until(main, ">>> ")  # the prompt is back
        os.write(
            main,
            b"print('STEP', est.step, type(sys.last_value).__name__, isinstance(sys.last_value, KeyboardInterrupt))\n",
        )
        out += _read_until(main, "Interrupted True")
    finally:
        with contextlib.suppress(OSError):
            os.write(main, b"exit()\n")
        python.wait(timeout=60)
        os.close(main)
    assert "SIGINT received: finishing the current loop, then returning to the prompt (no model_dir" in out
    stopped = int(out.split("training stopped at step ")[1].split()[0])
    assert f"training stopped at step {stopped} without saving (no model_dir)" in out
    assert "after saving" not in out and "SystemExit" not in out
    assert f"STEP {stopped} Interrupted True" in out and stopped > 0


# -- 4: no silent initial weights ------------------------------------------------------


def test_evaluate_predict_and_model_warn_once_about_initial_weights(model_dir):
    est = estimator(model_dir)
    with pytest.warns(
        UntrainedWarning,
        match=rf"evaluate\(\) uses the initial, untrained weights: model_dir '{model_dir}' has no checkpoint",
    ):
        est.evaluate(DATA)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntrainedWarning)  # once per Estimator
        next(iter(est.predict(DATA)))
        est.train(DATA, max_steps=2)
        estimator(model_dir).evaluate(DATA)  # restored: no warning
    with pytest.warns(UntrainedWarning, match=r"predict\(\) uses .*model_dir=None"):
        next(iter(estimator().predict(DATA)))
    with pytest.warns(UntrainedWarning, match=r"model\(\) uses"):
        estimator().model()


# -- 5 and 6: checks before the first step; read-only model_dir ----------------------------


def test_mistakes_are_found_before_the_first_step(model_dir):
    est = estimator(model_dir, eval_batch_size=12)
    with pytest.raises(ValueError, match=r"eval_batch_size=12\) does not divide the 8 devices.*use 8 or 16"):
        est.train_and_evaluate(DATA, DATA, max_steps=8, eval_every=4)
    with pytest.raises(ValueError, match=r"predict_batch_size=4\) does not divide"):
        estimator(model_dir, predict_batch_size=4).train(DATA, max_steps=4)
    with pytest.raises(
        ValueError,
        match=r"Best\(metric='acc'\): not among the evaluation's metrics \['accuracy', 'loss', 'num_examples'\]",
    ):
        estimator().train_and_evaluate(DATA, DATA, max_steps=8, eval_every=4, best=ex.Best("acc"))
    stopping = ex.EarlyStopping("val_loss")
    with pytest.raises(ValueError, match=r"EarlyStopping\(metric='val_loss'\): not among the evaluation's metrics"):
        estimator(model_dir).train_and_evaluate(DATA, DATA, max_steps=8, eval_every=4, hooks=[stopping])
    with pytest.raises(TypeError, match=r"hooks\[0\] is function .*expected an estimax.hooks.Hook"):
        estimator(model_dir).train(DATA, max_steps=4, hooks=[lambda loop: None])
    assert _steps(model_dir) == [] and not os.path.exists(os.path.join(model_dir, "metrics.jsonl"))


def test_a_late_mistake_keeps_the_checkpoint_that_was_due(model_dir):
    features, labels = blobs(64)
    plain = [({"x": features["x"][i : i + 32]}, labels[i : i + 32]) for i in (0, 32)]

    class Breaks:  # its second batch raises: a mistake only the evaluation itself meets
        def __iter__(self):
            yield plain[0]
            raise OSError("the evaluation files went away")

    est = estimator(model_dir, save_every_steps=4)
    with pytest.raises(EvaluationError, match=r"raised OSError: the evaluation files went away reading batch 2"):
        est.train_and_evaluate(iter(plain * 8), Breaks(), max_steps=8, eval_every=4)
    assert _steps(model_dir) == [4] and estimator(model_dir).step == 4
    # The end of training is saved also when its last loop was evaluated at the boundary.
    estimator(model_dir, save_every_steps=None).train_and_evaluate(DATA, DATA, max_steps=8, eval_every=8)
    assert _steps(model_dir) == [4, 8]


def test_a_read_only_model_dir(model_dir, caplog):
    estimator(model_dir).train(DATA, max_steps=4)
    with read_only(model_dir):
        est = estimator(model_dir)
        with pytest.raises(
            ModelDirNotWritable,
            match=rf"model_dir {model_dir} is not writable \((Read-only file system|Permission denied)\).*Fix:",
        ):
            est.train(DATA, max_steps=8)
        assert est.step == 4 and _steps(model_dir) == [4]  # nothing trained
        results = est.evaluate(DATA)  # the results come back; that they were not written is said
        assert results["num_examples"] == 256
        assert "evaluation of step 4 is not written" in caplog.text and "is not writable" in caplog.text


# -- the setup of a model_dir changed -----------------------------------------------------


def test_another_model_is_an_error_naming_the_arrays_another_setup_a_warning(model_dir, caplog):
    estimator(model_dir).train(DATA, max_steps=4)
    with pytest.raises(
        ex.CheckpointError,
        match=r"saved by another model or optimizer; arrays other shape: params/l2/bias \(5,\) now, \(3,\) saved, "
        r"params/l2/kernel \(32, 5\) now, \(32, 3\) saved\..*WarmStart\(",
    ):
        _ = estimator(model_dir, classes=5).step
    with pytest.raises(ex.CheckpointError, match=r"arrays added: opt_state/0/count.*opt_state/0/mu/l1/bias"):
        _ = estimator(model_dir, optimizer=optax.adam(1e-3)).step
    changed = estimator(model_dir, train_batch_size=64, lr=0.05, seed=3)
    assert changed.step == 4
    assert (
        "Resuming step 4 of" in caplog.text
        and "train_batch_size 32 when saved, 64 now; seed 0 when saved, 3 now; "
        "optimizer hyper-parameters (1.step_size -0.1 -> -0.05)"
        in caplog.text
    )


# -- 7: errors are estimax's -----------------------------------------------------------


def test_model_fn_and_input_mistakes_are_estimax_errors(tmp_path):
    features, labels = blobs(64)
    with pytest.raises(
        ex.ModelFnError,
        match=r"model_fn raised in train mode, and the input has no labels \(labels is None\): .*Fix: give",
    ):
        estimator().train(ex.data.from_arrays(features), max_steps=1)
    with pytest.raises(
        ex.ModelFnError,
        match=r"in train mode: TypeError: .*integer.* labels \{array: float32 \(32,\)\}. Fix: .*class ids",
    ):
        estimator().train(ex.data.from_arrays(features, labels.astype(np.float32)), max_steps=1)
    with pytest.raises(
        ex.ModelFnError,
        match=r"model_fn read features\['x'\] in train mode, which the input lacks; the input has features \['pixels",
    ):
        estimator().train(ex.data.from_arrays({"pixels": features["x"]}, labels), max_steps=1)
    with pytest.raises(ValueError, match=r"features\['x'\] has dtype <U\d+; expected numbers"):
        estimator().train([({"x": features["x"].astype(str)[:32]}, labels[:32])], max_steps=1)

    class DataLoader:  # what torch.utils.data.DataLoader is, as far as the check sees (torch is not installed)
        __module__ = "torch.utils.data.dataloader"

        def __iter__(self):
            return iter([])

    with pytest.raises(TypeError, match=r"Input is a PyTorch DataLoader.*Fix: iterate it as numpy"):
        estimator().train(DataLoader(), max_steps=1)
    images = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(images, "wb") as f:
        f.write(np.zeros(16 + 5 * 28 * 28, np.uint8).tobytes())
    images.write_bytes(images.read_bytes()[:-20])
    with pytest.raises(
        ValueError,
        match=rf"{images}: not a complete gzip file \(EOFError: .*\); expected the whole download\. Fix: download",
    ):
        ex.data.idx.read_idx(images, ex.data.idx.IMAGES_MAGIC)


def test_a_full_disk_during_a_save_is_one_line_naming_the_last_good_checkpoint(tmp_path):
    disk = str(tmp_path / "disk")
    os.makedirs(disk)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", disk]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        model_dir = os.path.join(disk, "run")
        estimator(model_dir, save_every_steps=2).train(DATA, max_steps=4)
        free = os.statvfs(disk)
        with open(os.path.join(disk, "filler"), "wb") as f:  # leave 16 KiB: the lock and logs fit, a checkpoint not
            f.write(bytes(free.f_bavail * free.f_frsize - 16 * 1024))
        out = _job(model_dir, 8, expect=1)
        # One line; on Python 3.13 a library thread may still print a line of its own at interpreter shutdown.
        assert (
            f"estimax.errors.CheckpointError: A checkpoint save in {model_dir}/checkpoints failed: "
            f"No space left on device; the last good checkpoint is step 4 "
            f"({model_dir}/checkpoints/4). Fix: free space there (or raise the quota), then run the same command "
            "again to resume from it."
        ) in out.splitlines()
        assert "Event loop is closed" not in out and "absl" not in out
    finally:
        subprocess.run(["umount", disk], check=True)


# -- evaluation failures keep the work ------------------------------------------------------


def _eval_outputs_model_fn(model, features, labels, mode, params):
    logits = model(features["x"])
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"logits": logits})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return ex.Spec(loss=loss, metrics={"fragile": _Fragile.of(loss)}, eval_outputs={"y": labels, "logits": logits})


class _Fragile(ex.metrics.Metric):
    """A metric whose compute() reads a field it never wrote, unless told otherwise by its input's sign."""

    total: object

    @classmethod
    def from_batch(cls, values, *, mask):
        import jax.numpy as jnp

        return cls(jnp.sum(jnp.where(mask, values, 0.0)))

    @classmethod
    def empty(cls):
        return cls(np.float32(0))

    def merge(self, other):
        return type(self)(self.total + other.total)

    def compute(self):
        if FRAGILE["broken"]:
            return {"sum": self.total}["mean"]
        return float(self.total)


FRAGILE = {"broken": False}


def _reads_labels(outputs):
    return {"agreement": float((outputs["logits"].argmax(-1) == outputs["labels"]).mean())}


def _est(model_dir, host_metrics=None):
    from models import mlp

    return ex.Estimator(
        mlp, _eval_outputs_model_fn, optax.sgd(0.1), ex.RunConfig(model_dir=model_dir, train_batch_size=32,
        steps_per_loop=2), params={"dropout": 0.0}, host_metrics=host_metrics,
    )  # fmt: skip


def test_a_failing_evaluation_saves_the_trained_steps_then_names_what_failed(tmp_path):
    # The default policy saves every 1000 steps: nothing is due at step 4 but the end of training.
    model_dir = str(tmp_path / "host_metrics")
    with pytest.raises(ex.errors.EstimaxError) as raised:
        _est(model_dir, _reads_labels).train_and_evaluate(DATA, DATA, max_steps=8, eval_every=4)
    message = str(raised.value)
    assert "host_metrics function _reads_labels (" in message and "test_reliability.py:" in message
    assert "KeyError: 'labels'" in message and "outputs hold the keys ['logits', 'y']" in message
    assert "Fix:" in message and "\n" not in message
    assert _steps(model_dir) == [4] and _est(model_dir).step == 4

    model_dir = str(tmp_path / "metric")
    FRAGILE["broken"] = True
    try:
        with pytest.raises(ex.errors.EstimaxError, match=r"compute\(\) of metric 'fragile' \(_Fragile\) raised Key"):
            _est(model_dir).train_and_evaluate(DATA, DATA, max_steps=8, eval_every=2)
    finally:
        FRAGILE["broken"] = False
    assert _steps(model_dir) == [2]

    model_dir = str(tmp_path / "input")
    features, labels = blobs(64)

    def failing_input():
        yield {"x": features["x"][:32]}, labels[:32]
        raise OSError("the evaluation shard is gone")

    with pytest.raises(ex.errors.EstimaxError, match=r"evaluation input raised OSError: the evaluation shard is gone "
                       r"reading batch 2 \(after 1 batches\)"):  # fmt: skip
        _est(model_dir).train_and_evaluate(DATA, failing_input(), max_steps=8, eval_every=4)
    assert _steps(model_dir) == [4]


# -- stop means stop; the profiler traces what it says ------------------------------------------


class _StopAt(ex.Hook):
    def __init__(self, step, may_stop=True):
        self.step, self.may_stop, self.seen = step, may_stop, []

    def after_loop(self, loop):
        self.seen.append(loop.step_after)
        return loop.step_after >= self.step


def test_a_hooks_stop_takes_effect_at_the_boundary_it_was_asked_at(tmp_path, estimax_log):
    model_dir = str(tmp_path / "exact")
    hook = _StopAt(10)
    est = estimator(model_dir, steps_per_loop=5)
    est.train(DATA, max_steps=100, hooks=[hook])
    assert est.step == 10 and _steps(model_dir) == [10] and hook.seen == [5, 10]
    assert "Training stopped at step 10: _StopAt.after_loop asked to stop at step 10." in estimax_log.messages
    assert "Input ran out" not in estimax_log.text
    estimax_log.clear()
    # A hook that says it never stops keeps the overlap: a True it returns anyway stops one loop later.
    model_dir = str(tmp_path / "overlapped")
    est = estimator(model_dir, steps_per_loop=5)
    est.train(DATA, max_steps=100, hooks=[_StopAt(10, may_stop=False)])
    assert est.step == 15 and _steps(model_dir) == [15]
    assert "Training stopped at step 15: _StopAt.after_loop asked to stop at step 10." in estimax_log.messages


def test_the_profiler_traces_every_loop_with_a_step_of_the_window(tmp_path):
    model_dir = str(tmp_path / "run")
    estimator(model_dir, steps_per_loop=4, profile_steps=(1, 3)).train(DATA, max_steps=8)
    traces = os.path.join(model_dir, "profile", "**", "*.xplane.pb")
    import glob

    assert glob.glob(traces, recursive=True)  # the loop of steps 1-4 runs steps 1 and 2
    window = r"profile_steps=\(20, 30\)\) traces steps 20-29, and this call trains steps 9-12: no loop runs a step"
    with pytest.raises(ex.errors.ConfigError, match=window + r" of the window\. Fix: .*profile_steps=\(9, 13\)"):
        estimator(model_dir, steps_per_loop=4, profile_steps=(20, 30)).train(DATA, max_steps=12)
    assert _steps(model_dir) == [8]  # refused before the first step
    with pytest.raises(ex.errors.ConfigError, match=r"model_dir=None\) has none"):
        estimator(None, profile_steps=(1, 3)).train(DATA, max_steps=4)


# -- the unclear cases get one-line answers ---------------------------------------------------


def test_evaluate_of_a_missing_step_lists_the_steps_that_exist(model_dir):
    est = estimator(model_dir, steps_per_loop=2, save_every_steps=2)
    est.train(DATA, max_steps=4)
    with pytest.raises(ex.errors.CheckpointError, match=r"checkpoint=999\): model_dir has no checkpoint of step 999; "
                       r"it has steps \[2, 4\]\. Fix:"):  # fmt: skip
        est.evaluate(DATA, checkpoint=999)


def test_a_predict_generator_continued_after_train_is_an_error_naming_why(model_dir):
    est = estimator(model_dir, steps_per_loop=2, predict_batch_size=64)
    est.train(DATA, max_steps=2)
    predictions = est.predict(DATA)
    next(predictions)
    est.train(DATA, max_steps=4)
    with pytest.raises(ex.errors.EstimaxError, match=r"generator predicts with the state of step 2, whose arrays "
                       r"train\(\) has since given to training.*Fix: finish iterating before training"):  # fmt: skip
        list(predictions)
    assert len(list(est.predict(DATA))) == 256  # a new generator predicts with the new state


def test_save_every_steps_and_a_checkpoint_policy_that_disagree_are_refused():
    with pytest.raises(ex.errors.ConfigError, match=r"save_every_steps=5\) and checkpoint=CheckpointPolicy"
                       r"\(every_steps=10\) disagree.*Fix: give only one"):  # fmt: skip
        ex.RunConfig(save_every_steps=5, checkpoint=ex.CheckpointPolicy(every_steps=10))
    agreeing = ex.RunConfig(save_every_steps=10, checkpoint=ex.CheckpointPolicy(every_steps=10, keep=2))
    assert (agreeing.checkpoint.every_steps, agreeing.checkpoint.keep) == (10, 2)
    assert ex.RunConfig(save_every_steps=5).checkpoint.every_steps == 5


def test_an_estimator_used_from_two_threads_at_once_refuses_the_second():
    import threading

    est, inside, release, errors = estimator(steps_per_loop=2), threading.Event(), threading.Event(), []

    class Holds(ex.Hook):
        def begin(self, run):
            inside.set()
            release.wait()

    def other():
        inside.wait()
        try:
            est.evaluate(DATA)
        except ex.errors.ConfigError as error:
            errors.append(str(error))
        release.set()

    thread = threading.Thread(target=other, name="evaluator")
    thread.start()
    est.train(DATA, max_steps=4, hooks=[Holds()])
    thread.join()
    assert est.step == 4 and len(errors) == 1
    assert "Estimator.evaluate() was called from thread 'evaluator' while Estimator.train() runs" in errors[0]
    assert "Fix: give each thread its own Estimator" in errors[0]
    est.evaluate(DATA)  # one at a time is fine


@pytest.mark.parametrize("content", [b"", b"\x00\x00garbage{"])
def test_an_empty_or_garbage_lock_file_says_what_it_is_and_how_to_clear_it(tmp_path, content):
    model_dir = str(tmp_path / "run")
    os.makedirs(model_dir)
    path = os.path.join(model_dir, LOCK_FILE)
    with open(path, "wb") as f:
        f.write(content)
    os.utime(path, (time.time() - 60, time.time() - 60))  # left there a minute ago, not being written
    what = "is empty" if not content else r"holds 10 bytes that are not a lock record"
    with pytest.raises(ModelDirLocked, match=rf"has a lock file {path} that {what}.*Fix: if no estimax process "
                       rf"writes into this model_dir, delete {path}\.$"):  # fmt: skip
        estimator(model_dir).train(DATA, max_steps=2)
    os.remove(path)
    estimator(model_dir).train(DATA, max_steps=2)  # cleared as the message says
    assert _steps(model_dir) == [2]


def test_a_directory_where_the_lock_file_goes_is_one_line(tmp_path):
    path = tmp_path / "run" / LOCK_FILE
    path.mkdir(parents=True)
    with pytest.raises(ModelDirLocked, match=rf"has a directory {path} where estimax keeps its lock file.*Fix: move"):
        estimator(str(tmp_path / "run")).train(DATA, max_steps=2)
    assert not (tmp_path / "run" / "checkpoints").exists()


def _read_line_with(stream, text, lines):
    """Reads ``stream`` line by line (into ``lines``) until one holds ``text``; the child's readiness."""
    for line in stream:
        lines.append(line)
        if text in line:
            return
    raise AssertionError(f"no {text!r} in {''.join(lines)}")


def test_two_ctrl_c_in_a_row_save_and_exit_75_with_short_output(model_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), TESTS])}
    job = warm.Popen(
        [sys.executable, JOB, model_dir, "100000", "slow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    try:
        _read_line_with(job.stdout, "train step", lines)  # training runs
        job.send_signal(signal.SIGINT)
        _read_line_with(job.stdout, "SIGINT received", lines)  # the first is being acted on
        job.send_signal(signal.SIGINT)
        lines += job.stdout.readlines()
        assert job.wait(timeout=120) == 75, "".join(lines)
    finally:
        job.kill()
    out = "".join(lines)
    assert "SIGINT again: already stopping and saving; a third Ctrl-C quits without it." in out
    stopped = int(out.split("training stopped at step ")[1].split()[0])
    assert f"training stopped at step {stopped} after saving a checkpoint of it to" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert _steps(model_dir)[-1] == stopped and estimator(model_dir).step == stopped  # the save finished
