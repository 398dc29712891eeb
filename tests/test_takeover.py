"""Never two writers, whatever is in flight and however attempts race; a checkpoint never ahead of the records.

Real processes and real signals (``takeover_job.py``), on a disk shared by two hosts (the
processes' lock records name two hosts), on the GCS emulator and on moto's S3 server on
127.0.0.1. Each attempt of a run names it (``ESTIMAX_RUN_ID``): a later attempt takes the
lock over at once. The trained parameters are compared with an uninterrupted run's.
"""

import json
import os
import signal
import subprocess
import sys
import time

import fsspec
import pytest
import warm

from estimax import storage

JOB = os.path.join(os.path.dirname(__file__), "takeover_job.py")
ERROR = "estimax: error: "
STEPS = 20


def _model_dir(store: str, request, tmp_path, name: str) -> str:
    if store == "disk":
        return str(tmp_path / name)
    request.getfixturevalue("gcs" if store == "gs" else "s3")
    return f"{store}://bkt/{name}-{tmp_path.name}"


def _start(model_dir: str, *args, run: str | None = None, host: str = "host-a", slow: float = 0) -> subprocess.Popen:
    env = {**os.environ, "ESTIMAX_LEASE_SECONDS": "8", "AS_HOST": host, "SLOW_SECONDS": str(slow)}
    if run is not None:
        env["ESTIMAX_RUN_ID"] = run
    return warm.Popen(
        [sys.executable, JOB, model_dir, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip


def _finished(process: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def _digest(out: str) -> str:
    return out.rsplit("parameters ", 1)[1].strip()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(steps)``: the parameters of an uninterrupted run (no name, no takeover) on a disk."""
    digests = {}

    def digest(steps: int) -> str:
        if steps not in digests:
            code, out, err = _finished(_start(str(tmp_path_factory.mktemp("reference") / "run"), steps))
            assert code == 0, err
            digests[steps] = _digest(out)
        return digests[steps]

    return digest


def _committed(model_dir: str) -> dict:
    """Every file of every committed step, with what tells a rewrite (size and version or mtime)."""
    root = storage.join(model_dir, "checkpoints")
    if not storage.is_url(model_dir):
        found = {}
        for name in os.listdir(root):
            if name.isdigit():
                for folder, _, files in os.walk(os.path.join(root, name)):
                    for file in files:
                        stat = os.stat(os.path.join(folder, file))
                        found[os.path.join(folder, file)] = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
        return found
    fs, inner = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    objects = fs.find(inner, detail=True)
    steps = {p.split("/")[-2] for p in objects if p.endswith("/commit_success.txt")}
    return {
        p: (i["size"], i.get("generation") or i.get("ETag"))
        for p, i in objects.items()
        if p[len(inner) :].split("/")[1] in steps
    }


def _steps(committed: dict) -> set[int]:
    return {int(path.split("/checkpoints/")[1].split("/")[0]) for path in committed}


def _records(model_dir: str) -> list[dict]:
    return [json.loads(line) for line in storage.read_bytes(storage.join(model_dir, "metrics.jsonl")).splitlines()]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(ERROR)]


def _one_history(model_dir: str, steps: int) -> None:
    """The train records read as one history: each logged step once, in order, none missing."""
    train = [r["step"] for r in _records(model_dir) if r["split"] == "train"]
    assert train == list(range(2, steps + 1, 2)), train


@pytest.mark.parametrize("store", ["disk", "gs", "s3"])
def test_a_holder_paused_with_a_save_in_flight_writes_nothing_once_a_later_attempt_took_over(
    store, request, tmp_path, reference
):
    model_dir = _model_dir(store, request, tmp_path, "in-flight")
    first = _start(model_dir, STEPS, 6, run=f"in-flight-{store}")
    assert first.stdout.readline() == "stopped in the save of step 6\n", first.stderr.read()
    os.waitpid(first.pid, os.WUNTRACED)  # stopped, its step 6 being written

    code, out, err = _finished(_start(model_dir, STEPS, run=f"in-flight-{store}", host="host-b"))
    assert code == 0 and f"trained to step {STEPS}" in out, err
    assert _digest(out) == reference(STEPS)
    if store != "disk":  # in place on a bucket: the step the paused holder was writing is left to it
        assert "Step 6 is not saved" in err, err
    assert "Could not determine bucket type" not in err  # gcsfs's warning without credentials (the emulator)
    committed = _committed(model_dir)

    first.send_signal(signal.SIGCONT)
    code, _, err = _finished(first)
    lines = _error_lines(err)
    assert code == 74 and len(lines) == 1 and "Traceback" not in err, err
    # Taken over by the later attempt, whose lock is gone by now: it says so, and the last committed step.
    assert "took over the lock" in lines[0] and "nobody holds it now" in lines[0], lines[0]
    assert f"resume from step {max(_steps(committed))}" in lines[0], lines[0]
    assert _committed(model_dir) == committed  # its commit was refused: no step, no file of one, written
    _one_history(model_dir, STEPS)


RACE_STEPS = 40


@pytest.mark.parametrize(
    "store, gap, first_state",
    [
        ("disk", 0.1, "running"),
        ("disk", 3.0, "killed"),
        ("gs", 0.5, "running"),
        ("gs", 0.1, "killed"),
        ("s3", 3.0, "running"),
        ("s3", 0.5, "killed"),
    ],
)
def test_racing_attempts_leave_one_writer_and_one_history(store, gap, first_state, request, tmp_path, reference):
    """A first attempt trains; two later attempts start ``gap`` seconds apart (the first one SIGKILLed just
    before, or still running). The run ends trained as an uninterrupted run; an attempt either trains to
    the end or ends with one line and exit 74, having written nothing more; the history reads as one."""
    model_dir = _model_dir(store, request, tmp_path, "race")
    run = f"race-{store}-{gap}-{first_state}"
    first = _start(model_dir, RACE_STEPS, run=run, slow=0.25)  # still training when the others start
    while not storage.exists(storage.join(model_dir, "metrics.jsonl")):  # it trained and saved
        assert first.poll() is None, first.communicate()
        time.sleep(0.05)
    if first_state == "killed":
        first.send_signal(signal.SIGKILL)
    second = _start(model_dir, RACE_STEPS, run=run, host="host-b")
    time.sleep(gap)
    third = _start(model_dir, RACE_STEPS, run=run, host="host-c")
    results = {"second": _finished(second), "third": _finished(third)}
    if first_state == "running":
        results["first"] = _finished(first)
    finished = [name for name, (code, out, _) in results.items() if code == 0]
    assert "third" in finished, results["third"][2]  # the latest attempt carries the run to its end
    for name, (code, out, err) in results.items():
        if code == 0:
            assert f"trained to step {RACE_STEPS}" in out and _digest(out) == reference(RACE_STEPS), f"{name}: {err}"
            continue
        lines = _error_lines(err)
        # A text, not a tuple: pytest prints a text whole, and cuts a tuple's repr in the middle.
        assert code == 74 and len(lines) == 1 and "Traceback" not in err, f"{name} (exit {code}): {err}"
        assert "later attempt" in lines[0], (name, lines[0])
    _one_history(model_dir, RACE_STEPS)
