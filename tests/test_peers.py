"""A lost process of a group, with real processes on 127.0.0.1: the survivors name it and stop.

The bound is short here (ESTIMAX_PEER_TIMEOUT_SECONDS=2); each test prints the time from the
signal to the last survivor's exit (benchmarks/peer_loss.py measures it for the clusters guide).
"""

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import warm
from helpers import MULTIHOST_JOB, checkpoint_steps, job_env

from estimax import distributed
from estimax.group import peers
from estimax.group.peers import PEER_LOST_EXIT_CODE

TIMEOUT = 2


def _process(command, port, rank, size):
    env = job_env(
        JAX_NUM_CPU_DEVICES="1",
        ESTIMAX_COORDINATOR=f"127.0.0.1:{port}",
        ESTIMAX_NUM_PROCESSES=str(size),
        ESTIMAX_PROCESS_ID=str(rank),
        ESTIMAX_PEER_TIMEOUT_SECONDS=str(TIMEOUT),
        ESTIMAX_LOG_ALL_PROCESSES="1",
    )
    return warm.Popen([sys.executable, *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _lost_line(out: str) -> str:
    lines = [line for line in out.splitlines() if "Stopping with exit code" in line]
    assert len(lines) == 1, out
    return lines[0]


def _lost_mid_run(tmp_path, victim: int, settle: float = 0.0):
    """Two processes train; once a checkpoint is committed (and ``settle`` seconds later), ``victim`` is
    SIGKILLed. Returns ``(model_dir, the survivor's process, its output, seconds from the kill to its exit)``."""
    model_dir, out_dir, port = str(tmp_path / "run"), str(tmp_path / "out"), distributed.free_port()
    group = [_process([MULTIHOST_JOB, model_dir, out_dir, "train", "100000", "0.5"], port, r, 2) for r in range(2)]
    survivor = group[1 - victim]
    try:
        deadline = time.monotonic() + 120
        while not checkpoint_steps(model_dir):  # a committed checkpoint (step 4); loops of half a second each follow
            assert survivor.poll() is None and time.monotonic() < deadline, survivor.communicate()[0]
            time.sleep(0.05)
        time.sleep(settle)
        with open(os.path.join(out_dir, f"pid-{victim}")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
        killed = time.monotonic()
        out = survivor.communicate(timeout=120)[0]
        seconds = time.monotonic() - killed
    finally:
        for p in group:
            p.kill()
            p.wait()
    return model_dir, survivor, out, seconds


def test_sigkill_of_one_process_mid_run_stops_the_other_naming_it_and_the_last_committed_step(tmp_path):
    model_dir, survivor, out, seconds = _lost_mid_run(tmp_path, victim=1)
    print(f"2 processes, process 1 SIGKILLed: process 0 exited {seconds:.1f} s later")
    assert survivor.returncode == PEER_LOST_EXIT_CODE, out
    line = _lost_line(out)
    assert f"Process 0: lost process 1 (host {socket.gethostname()}) of the group of 2: no sign of life for" in line
    silent = float(re.search(r"no sign of life for ([\d.]+) s", line).group(1))
    assert silent >= TIMEOUT
    # What a restart resumes from: the newest step on disk; or, if the kill came while a save waited for
    # every process at Orbax's barrier, the one before it, with a word about the one being saved.
    found = re.search(r"The last committed checkpoint is step (\d+)", line)
    if found is None:  # the save asked for no answer in time (Orbax's lock held at its barrier): said so
        assert "A checkpoint was being saved: the same command resumes from the latest committed one" in line, line
    else:
        named = int(found.group(1))
        assert named == max(checkpoint_steps(model_dir)) or "a later one was being saved" in line, line
        assert named in checkpoint_steps(model_dir) and f"resume from step {named} with the same command" in line
    assert "Check failure" not in out  # estimax's line, not JAX's abort


def test_sigkill_of_process_0_mid_run_stops_the_other_with_its_line_before_jax_aborts_it(tmp_path):
    """Process 0 hosts JAX's coordination service: JAX aborts the survivors about 0.1 s after it dies.
    The survivor's lifeline to process 0 closes at once, and its line and exit code come before the abort."""
    # A second after the checkpoint, a beat of process 1 has asked for the committed step.
    model_dir, survivor, out, seconds = _lost_mid_run(tmp_path, victim=0, settle=1.0)
    print(f"2 processes, process 0 SIGKILLed: process 1 exited {seconds:.2f} s later")
    assert survivor.returncode == PEER_LOST_EXIT_CODE, out
    line = _lost_line(out)
    assert "Process 1: lost process 0 (the coordinator, host 127.0.0.1) of the group of 2: " in line
    # Two watchers see the same death: the lifeline's connection closes, and the beat's wait on JAX's service
    # fails. Whichever speaks first names it; both say the process, its host and the step to resume from.
    assert re.search(
        r"of 2: (its connection to this process closed|JAX's coordination service it hosts does not answer)", line
    ), line
    named = int(re.search(r"The last committed checkpoint is step (\d+)", line).group(1))
    assert named in checkpoint_steps(model_dir) and f"resume from step {named} with the same command" in line
    # estimax's line and exit code, no abort by JAX. JAX's error thread wakes on the same closed connection:
    # on a loaded host it may log its last words before the line, but the process exits 69 before it aborts.
    assert "Check failure" not in out, out


READY = textwrap.dedent(
    """
    import sys, time
    from estimax import distributed
    distributed.initialize()
    import jax
    print("ready", jax.process_index(), flush=True)
    if jax.process_index() == 1:
        sys.exit(0)  # ends normally: not lost
    while True:
        time.sleep(0.1)
    """
)


def test_a_frozen_process_of_four_is_named_by_each_survivor_and_one_that_ended_normally_is_not():
    port = distributed.free_port()
    group = [_process(["-c", READY], port, r, 4) for r in range(4)]
    try:
        for p in group:  # every process has joined: readiness lines, not a sleep
            assert any(line.startswith("ready") for line in p.stdout), p.communicate()[0]
        group[2].send_signal(signal.SIGSTOP)  # frozen: its sockets stay open, only its silence tells
        stopped = time.monotonic()
        outs = {r: group[r].communicate(timeout=120)[0] for r in (0, 3)}
        seconds = time.monotonic() - stopped
    finally:
        for p in group:
            p.kill()
            p.wait()
    print(f"4 processes, process 2 SIGSTOPped: processes 0 and 3 exited within {seconds:.1f} s")
    for r, out in outs.items():
        assert group[r].returncode == PEER_LOST_EXIT_CODE, out
        line = _lost_line(out)
        assert f"Process {r}: lost process 2 (host {socket.gethostname()}) of the group of 4" in line
        assert "process 1" not in line  # it said it was leaving
        assert "No checkpoint was committed in this run" in line


class _HeldClient:
    """JAX's key-value client as the watch calls it, in memory; calls from other threads wait for ``opened``."""

    def __init__(self):
        self.values, self.opened = {}, threading.Event()

    def _hold(self):
        if threading.current_thread() is not threading.main_thread():
            self.opened.wait()

    def key_value_set(self, key, value, allow_overwrite=False):
        self._hold()
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        self._hold()
        time.sleep(timeout_in_ms / 1000)
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")


def test_a_process_says_its_host_before_initialize_returns_so_one_frozen_at_once_is_named(monkeypatch):
    """A process frozen right after ``initialize`` (before its beat thread ran) is named by its host."""
    monkeypatch.setattr(peers, "_this_process", None)
    client = _HeldClient()
    watch = peers.PeerWatch(client, process=2, num_processes=4, timeout=1.0)
    watch.start()
    try:  # nothing but start() has run: every other thread waits at the client
        assert client.values == {f"{peers._ALIVE}2": f"0 {socket.gethostname()}"}
    finally:
        client.opened.set()
        watch.leave()
