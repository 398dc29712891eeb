"""Many processes through jax.distributed: real processes on 127.0.0.1 (gloo CPU collectives).

The reference is always a 1-process run on 8 simulated devices of the same
job (tests/multihost_job.py); the group is 2 processes x 4 devices, started
by `estimax launch`.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import warm
from helpers import (
    MULTIHOST_STEPS,
    checkpoint_steps,
    finish,
    job_env,
    launch_group,
    max_difference,
    read_result,
    run_one_process,
)

from estimax import distributed
from estimax.cli import launch

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


@pytest.fixture(scope="module")
def runs(multihost_references):
    """The same job as 1 process x 8 devices and as 2 processes x 4 devices (conftest.py)."""
    return multihost_references.root, multihost_references.one, multihost_references.two, multihost_references.log


def test_two_processes_train_and_evaluate_like_one(runs):
    _, one, two, out = runs
    assert (one["processes"], one["devices"], two["processes"], two["devices"]) == (1, 8, 2, 8)
    assert sorted(two["losses"]) == list(range(1, MULTIHOST_STEPS + 1))
    loss_difference = max_difference(one["losses"], two["losses"])
    print(f"max |loss(2x4) - loss(1x8)| over {MULTIHOST_STEPS} steps: {loss_difference:.3g}")
    assert loss_difference <= 1e-5
    assert max_difference(one["params"], two["params"]) <= 1e-5
    assert one["eval"]["num_examples"] == two["eval"]["num_examples"] == 203  # exact, padded on both processes
    assert abs(one["eval"]["loss"] - two["eval"]["loss"]) <= 1e-5
    assert one["eval"]["accuracy"] == two["eval"]["accuracy"]
    # Only process 0 logs (the others keep to warnings); every line says where it came from.
    assert "[0] " in out and "Training steps 0 -> 24" in out
    assert not any(line.startswith("[1] ") and "estimax  train step" in line for line in out.splitlines())


def test_saves_decided_by_the_clock_are_made_by_every_process_at_once(runs, tmp_path):
    # every_seconds and max_overhead read each process's clock: process 0's answer is everyone's, or a
    # process that saves would wait at the save's barrier for one that trains on. Here the clocks
    # disagree on every loop (process 0 saves every loop by its policy, process 1 never by its own).
    _, one, _, _ = runs
    finish(launch_group(str(tmp_path / "run"), str(tmp_path / "out"), "train", str(MULTIHOST_STEPS), "0.0", "clock"))
    clocked = read_result(tmp_path / "out")
    assert clocked["step"] == MULTIHOST_STEPS and sorted(checkpoint_steps(str(tmp_path / "run"))) == list(
        range(4, MULTIHOST_STEPS + 1, 4)
    )
    assert max_difference(one["params"], clocked["params"]) <= 1e-5


def test_predict_yields_every_example_once(runs):
    root, one, two, _ = runs
    assert len(two["predictions"]) == len(one["predictions"]) == 203
    np.testing.assert_allclose(two["predictions"], one["predictions"], atol=1e-5)  # gathered in input order
    local = [json.load(open(root / "two-out" / f"local-{p}.json"))["classes"] for p in range(2)]
    assert [len(c) for c in local] == [102, 101]  # each process its own rows 0::2 and 1::2
    interleaved = [local[i % 2][i // 2] for i in range(203)]
    assert interleaved == [int(np.argmax(p)) for p in two["predictions"]]


def test_a_checkpoint_of_two_processes_restores_in_one(runs, tmp_path):
    root, _, two, _ = runs
    run_one_process(str(root / "two"), str(tmp_path), "evaluate")
    restored = read_result(tmp_path)
    assert restored["processes"] == 1 and restored["step"] == MULTIHOST_STEPS
    assert max_difference(restored["params"], two["params"]) == 0.0  # the very arrays saved
    assert restored["eval"]["num_examples"] == 203
    assert abs(restored["eval"]["loss"] - two["eval"]["loss"]) <= 1e-6


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """The same job with parameters and Adam's state sharded over fsdp=8: 1 x 8 devices and 2 x 4."""
    root = tmp_path_factory.mktemp("fsdp")
    run_one_process(str(root / "one"), str(root / "one-out"), "train", "8", "0", "fsdp")
    finish(launch_group(str(root / "two"), str(root / "two-out"), "train", "8", "0", "fsdp"))
    return root, read_result(root / "one-out"), read_result(root / "two-out")


def test_tensor_parallel_over_two_processes_matches_fsdp_in_one_process(fsdp_runs, tmp_path):
    _, one, _ = fsdp_runs
    finish(launch_group(str(tmp_path / "run"), str(tmp_path / "out"), "train", "8", "0", "tp"))
    two = read_result(tmp_path / "out")
    assert two["kernel_spec"] == [None, "model"]
    assert max_difference(one["losses"], two["losses"]) <= 1e-5
    assert max_difference(one["params"], two["params"]) <= 1e-5
    assert two["eval"]["num_examples"] == 203
    np.testing.assert_allclose(two["predictions"], one["predictions"], atol=1e-5)  # gathered, each row once
    local = [json.load(open(tmp_path / "out" / f"local-{p}.json"))["classes"] for p in range(2)]
    assert [len(c) for c in local] == [102, 101]  # rows held twice (over "model") are yielded once


def test_fsdp_over_two_processes_trains_evaluates_and_predicts_like_one_process(fsdp_runs):
    _, one, two = fsdp_runs
    assert one["kernel_spec"] == two["kernel_spec"] == [None, "fsdp"]  # spans both processes
    assert (one["processes"], two["processes"], two["step"]) == (1, 2, 8)
    assert max_difference(one["losses"], two["losses"]) <= 1e-5
    assert max_difference(one["params"], two["params"]) <= 1e-5
    assert one["eval"]["num_examples"] == two["eval"]["num_examples"] == 203
    assert abs(one["eval"]["loss"] - two["eval"]["loss"]) <= 1e-5
    np.testing.assert_allclose(two["predictions"], one["predictions"], atol=1e-5)


def test_a_fsdp_checkpoint_of_two_processes_restores_bitwise_in_one_replicated_process(fsdp_runs, tmp_path):
    root, _, two = fsdp_runs
    run_one_process(str(root / "two"), str(tmp_path), "evaluate", "8", "0", "adam")  # no mesh: everything replicated
    restored = read_result(tmp_path)
    assert restored["kernel_spec"] == [] and restored["step"] == 8
    assert max_difference(restored["params"], two["params"]) == 0.0


def test_sigkill_of_one_process_restarts_the_group_and_ends_like_an_uninterrupted_run(runs, tmp_path):
    _, _, two, _ = runs
    model_dir, out_dir = str(tmp_path / "run"), str(tmp_path / "out")
    launcher = launch_group(model_dir, out_dir, "train", str(MULTIHOST_STEPS), "1.0", max_restarts=1)
    deadline = time.monotonic() + 60
    while not checkpoint_steps(model_dir):  # the first checkpoint (step 4): five loops of at least a second remain
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0]
        time.sleep(0.05)
    with open(os.path.join(out_dir, "pid-1")) as f:
        os.kill(int(f.read()), signal.SIGKILL)
    out = finish(launcher)
    assert "process 1 was killed by SIGKILL; stopping the others" in out
    assert "restarting the group from its latest checkpoint (1 of 1)" in out
    assert out.count("Restored checkpoint step") == 1  # the second start resumed (process 0 logs)
    resumed = read_result(out_dir)
    assert resumed["step"] == MULTIHOST_STEPS and min(resumed["losses"]) > 1  # it did not start from scratch
    assert max_difference(resumed["params"], two["params"]) == 0.0
    assert max(abs(resumed["losses"][s] - two["losses"][s]) for s in resumed["losses"]) == 0.0
    assert resumed["eval"] == two["eval"]
    print(f"restarted from step {min(resumed['losses']) - 1}: final parameters bitwise equal to the uninterrupted run")


def test_sigterm_to_the_launcher_stops_every_process_at_one_step_with_exit_75(runs, tmp_path):
    _, _, two, _ = runs
    model_dir, out_dir = str(tmp_path / "run"), str(tmp_path / "out")
    launcher = launch_group(model_dir, out_dir, "train", str(MULTIHOST_STEPS), "1.0")
    deadline = time.monotonic() + 60
    while max(checkpoint_steps(model_dir) or [0]) < 8:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0]
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 75, out  # passed through, not restarted
    stopped = {
        int(line.split("training stopped at step ")[1].split()[0]) for line in out.splitlines() if "stopped at" in line
    }
    assert (
        len(stopped) == 1 and stopped.pop() == max(checkpoint_steps(model_dir)) < MULTIHOST_STEPS
    )  # the same step on both
    assert out.count("training stopped at step") == 2 and "restarting" not in out
    finish(launch_group(model_dir, out_dir, "train", str(MULTIHOST_STEPS)))  # the same command again resumes
    assert max_difference(read_result(out_dir)["params"], two["params"]) == 0.0


_LATE = textwrap.dedent(
    """
    import sys, time
    from estimax import distributed
    distributed.initialize()
    import jax
    sync = distributed.Sync(timeout_seconds=3)
    if jax.process_index() == 1:
        sync.status("reading a very slow input")
        time.sleep(8)
    sync.barrier("the first loop")
    """
)


def test_a_late_process_is_named_not_waited_for(tmp_path):
    port = distributed.free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _LATE],
            env=job_env(
                JAX_NUM_CPU_DEVICES="1",
                ESTIMAX_COORDINATOR=f"127.0.0.1:{port}",
                ESTIMAX_NUM_PROCESSES="2",
                ESTIMAX_PROCESS_ID=str(i),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        out, _ = processes[0].communicate(timeout=60)
    finally:
        for p in processes:
            p.kill()
            p.wait()
    assert processes[0].returncode != 0
    assert "SyncTimeout" in out
    assert re.search(r"Process 0 waited \d+ s at the barrier before 'the first loop' \(timeout 3 s\)", out)
    assert "1 of 2 processes did not arrive: process 1 was last: reading a very slow input" in out


def test_initialize_is_a_no_op_for_one_process(monkeypatch):
    for name in (distributed.COORDINATOR_ENV, distributed.NUM_PROCESSES_ENV, distributed.PROCESS_ID_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    assert distributed.initialize() is False
    assert distributed.initialize(num_processes=1) is False


def test_initialize_names_what_is_missing(monkeypatch):
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.setenv(distributed.NUM_PROCESSES_ENV, "two")
    with pytest.raises(ValueError, match=r"ESTIMAX_NUM_PROCESSES='two' is not an integer"):
        distributed.initialize()
    monkeypatch.delenv(distributed.NUM_PROCESSES_ENV)
    with pytest.raises(ValueError, match=r"Fix: also set num_processes, process_id"):
        distributed.initialize("127.0.0.1:1234")
    monkeypatch.setenv(distributed.PROCESS_ID_ENV, "5")
    with pytest.raises(ValueError, match=r"received process_id=5 with num_processes=2 .*expected a process_id from 0"):
        distributed.initialize("127.0.0.1:1234", 2)
    monkeypatch.setenv("ESTIMAX_PEER_TIMEOUT_SECONDS", "0")
    with pytest.raises(ValueError, match=r"received ESTIMAX_PEER_TIMEOUT_SECONDS='0'; expected a positive number"):
        distributed.initialize("127.0.0.1:1234", 2)


def test_launch_checks_its_arguments():
    with pytest.raises(ValueError, match=r"received no command"):
        launch.launch([], 2)
    with pytest.raises(ValueError, match=r"num_processes=0"):
        launch.launch(["true"], 0)


def test_the_launcher_starts_its_processes_without_importing_jax():
    # A fresh interpreter (not a warm child, which has JAX loaded): the launcher only starts and watches processes.
    probe = (
        "import sys\nfrom estimax import cli\n"
        "code = cli.main(['launch', '--num-processes', '2', '--', sys.executable, '-c', 'print(7 * 6)'])\n"
        "print('CODE', code, 'JAX', 'jax' in sys.modules, 'NUMPY', 'numpy' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=job_env(), timeout=60)
    assert "CODE 0 JAX False NUMPY False" in result.stdout, result.stdout + result.stderr
    assert "[0] 42" in result.stdout and "[1] 42" in result.stdout, result.stdout


_KILLS_ITS_PEER = textwrap.dedent(
    """
    import os, signal, sys, time
    pid_file = os.path.join(sys.argv[1], "pid-1")
    if os.environ["ESTIMAX_PROCESS_ID"] == "1":
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        time.sleep(60)
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    peer = int(open(pid_file).read())
    os.kill(peer, signal.SIGKILL)
    while open(f"/proc/{peer}/stat").read().split(")")[1].split()[0] != "Z":  # dead, not yet reaped
        time.sleep(0.001)
    os.abort()  # as a collective whose peer is gone aborts: milliseconds after the cause
    """
)


def test_the_launcher_names_the_process_that_failed_first_not_the_one_that_aborted_on_losing_it(tmp_path):
    command = [sys.executable, "-m", "estimax.cli", "launch", "--num-processes", "2", "--max-restarts", "0"]
    command += ["--", sys.executable, "-c", _KILLS_ITS_PEER, str(tmp_path)]
    # Real processes, not warm ones (tests/warm.py): a warm child's end reaches the launcher through a
    # relay, late by more than the milliseconds between the cause and the abort this test tells apart.
    env = {k: v for k, v in job_env().items() if k != warm.LAUNCH_ENV}
    launcher = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert launcher.returncode == 128 + signal.SIGKILL, launcher.stdout + launcher.stderr
    # Both have ended by the launcher's next look, usually: the cause is named either way.
    said = [line for line in launcher.stdout.splitlines() if "stopping the others" in line]
    assert said and said[0].startswith("[launch] process 1 was killed by SIGKILL; stopping the others"), said
    assert said[0].endswith("; stopping the others") or "(already ended: process 0 was killed by SIGABRT)" in said[0]


def test_the_cli_under_the_launcher_trains_and_predicts_every_example(tmp_path):
    def cli(*args):
        command = [sys.executable, "-m", "estimax.cli", "launch", "--num-processes", "2", "--devices-per-process", "4"]
        command += ["--", sys.executable, "-m", "estimax.cli", *args, "--model-dir", str(tmp_path / "run")]
        return finish(
            subprocess.Popen(command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )

    out = cli("train", "--max-steps", "10", "--steps-per-loop", "10", "--loop", "step", "--batch-size", "16")
    assert "[0] held-out accuracy" in out and "on 360 examples after 10 steps" in out
    assert "[1] held-out" not in out  # process 0 speaks for the group
    output = tmp_path / "predictions.jsonl"
    out = cli("predict", "--output", str(output))
    assert "[0] 360 predictions" in out and "[1] 360" not in out
    assert [json.loads(line)["index"] for line in output.read_text().splitlines()] == list(range(360))
