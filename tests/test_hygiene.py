"""The suite's own guarantee: no process a test starts outlives it (tests/helpers.py, tests/conftest.py)."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import warm
from helpers import job_env, processes_killed_on_exit
from stores import OWNER

pytestmark = pytest.mark.quick

# A child that starts a grandchild in a session of its own, prints both pids and waits; the grandchild waits too.
FAMILY = textwrap.dedent("""
    import subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    print(grandchild.pid, flush=True)
    if sys.argv[1] == "orphan":
        sys.exit(0)  # the grandchild is left to init: no longer a descendant of the test
    time.sleep(600)
""")


@pytest.mark.parametrize("start", [subprocess.Popen, warm.Popen], ids=["cold", "warm"])
@pytest.mark.parametrize("child", ["waiting", "orphan"])
def test_what_a_failing_block_started_is_killed_on_leaving_it_orphans_too(child, start):
    with pytest.raises(AssertionError), processes_killed_on_exit():
        parent = start([sys.executable, "-c", FAMILY, child], stdout=subprocess.PIPE, text=True)
        grandchild = psutil.Process(int(parent.stdout.readline()))
        if child == "orphan":
            parent.wait(timeout=60)
        assert grandchild.is_running() and grandchild.status() != psutil.STATUS_ZOMBIE
        raise AssertionError("the test fails here")
    assert parent.wait(timeout=30) is not None
    with pytest.raises(psutil.NoSuchProcess):  # killed and reaped, by its parent or by init
        psutil.wait_procs([grandchild], timeout=30)
        grandchild.status()


def test_a_server_kept_for_the_session_is_left_running():
    with processes_killed_on_exit():
        server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                  env={**os.environ, OWNER: "session"})  # fmt: skip
        assert warm.run([sys.executable, "-c", "pass"], timeout=60).returncode == 0
    try:
        assert server.poll() is None
        assert warm.interpreter_pids() and all(psutil.pid_exists(pid) for pid in warm.interpreter_pids())
    finally:
        server.kill()
        server.wait()


# A process of a launched group: its pid, then it waits; SIGTERM ends it with 75.
LAUNCHED = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
    print(os.getpid(), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("fault", ["sigkill-of-a-process", "sigterm-to-the-launcher"])
def test_a_launched_process_runs_warm_passes_signals_on_and_ends_as_its_child(fault):
    command = [sys.executable, "-m", "estimax.cli", "launch", "--num-processes", "2", "--max-restarts", "0"]
    launcher = subprocess.Popen([*command, "--", sys.executable, "-c", LAUNCHED], env=job_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    said, children = [], {}
    while len(children) < 2 and (line := launcher.stdout.readline()):
        said.append(line)
        if found := re.fullmatch(r"\[(\d)\] (\d+)", line.strip()):
            children[int(found[1])] = int(found[2])
    assert len(children) == 2, "".join(said)
    if warm.WARM_CHILDREN:  # forked from a warm interpreter, then handed up: the test's own children
        deadline = time.monotonic() + 10
        while not {p.pid for p in psutil.Process().children()} >= set(children.values()):
            assert time.monotonic() < deadline, children
            time.sleep(0.1)
    if fault == "sigkill-of-a-process":
        os.kill(children[1], signal.SIGKILL)
        out = launcher.communicate(timeout=60)[0]
        assert launcher.returncode == 128 + signal.SIGKILL and "process 1 was killed by SIGKILL; stopping" in out, out
    else:
        launcher.send_signal(signal.SIGTERM)
        out = launcher.communicate(timeout=60)[0]
        assert launcher.returncode == 75 and "was killed" not in out, out  # each process's own exit code
    for pid in children.values():  # process 0 too: its launched process was killed, and it went along
        with pytest.raises(psutil.NoSuchProcess):
            psutil.wait_procs([psutil.Process(pid)], timeout=30)
            psutil.Process(pid).status()


# Programs that end in each way a Python process ends: their statuses, outputs and last lines of stderr.
ENDINGS = {
    "status": "import sys; sys.exit(3)",
    "status-over-255": "import sys; sys.exit(300)",
    "message": "import sys; sys.exit('stopped')",
    "exception": "raise ValueError('bad')",
    "interrupt": "raise KeyboardInterrupt",
    "thread": "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.3), print('joined'))).start()",
    "atexit": "import atexit; atexit.register(print, 'at exit')",
    "unflushed": "print('no newline', end='')",
}


@pytest.mark.parametrize("program", ENDINGS.values(), ids=ENDINGS.keys())
def test_a_warm_child_ends_as_a_cold_one(program):
    # A warm child ends without tearing down the heap it shares with its interpreter (tests/warm.py): the rest
    # of the interpreter's ending (threads joined, atexit, streams flushed, the exit status) is the same.
    def ending(start):
        child = start([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = child.communicate(timeout=60)
        return child.returncode, out, err.strip().splitlines()[-1:]

    assert ending(warm.Popen) == ending(subprocess.Popen)


@pytest.mark.parametrize("path", ["{root}:{tests}", "{tests}:{root}", "{tmp}::{root}:{tmp}", "rel:{root}", "{tests}"])
def test_a_warm_child_has_the_sys_path_and_packages_of_a_cold_one(tmp_path, path):
    # PYTHONPATH is the child's own: folders that hold none of the warm interpreter's packages do not choose it.
    # Without the checkout on it ("{tests}"), estimax is the installed one, from another warm interpreter.
    (tmp_path / "task_module.py").write_text("")
    where = {"tests": os.path.dirname(__file__), "root": os.path.dirname(os.path.dirname(__file__)), "tmp": tmp_path}
    env = job_env(PYTHONPATH=path.format(**where))
    # Which estimax the child has (the warm one's is imported already; a cold one's is found, not imported).
    program = "import importlib.util, sys, task_module; print(sys.path, importlib.util.find_spec('estimax').origin)"

    def seen(start):
        child = start([sys.executable, "-c", program], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        return child.communicate(timeout=60)[0]

    assert seen(warm.Popen) == seen(subprocess.Popen)
