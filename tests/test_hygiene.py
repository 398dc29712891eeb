"""The suite's own guarantee: no process a test starts outlives it (tests/helpers.py, tests/conftest.py)."""

import os
import subprocess
import sys
import textwrap

import psutil
import pytest
import warm
from helpers import processes_killed_on_exit
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
