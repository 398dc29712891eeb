"""One writer per model_dir on a bucket, also across a pause: the lease is fenced, every call to the
store has a deadline, and a lock object that holds no lease says what it holds and how to delete it.

Real processes and real signals against the GCS emulator and moto's S3 server on 127.0.0.1:
``lease_job.py`` trains on gs:// and is paused (SIGSTOP) past its lease, or loses its store (SIGKILL).
Lease times are seconds here (``ESTIMAX_LEASE_SECONDS``); a minute by default.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import fsspec
import pytest
from stores import GCSEmulator

from estimax import storage
from estimax.errors import LeaseLostError, ModelDirLockedError, StoreUnavailableError
from estimax.lease import LeaseLock

JOB = os.path.join(os.path.dirname(__file__), "lease_job.py")
LEASE = 4.0  # seconds: the pauses below last a little longer than this
ERROR = "estimax: error: "


def _listing(url: str) -> dict:
    """Every object under ``url`` but the lock, with its size and version (generation or ETag)."""
    fs, inner = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    found = fs.find(inner, detail=True)
    return {
        path: (info["size"], info.get("generation") or info.get("ETag"))
        for path, info in found.items()
        if not path.endswith("/estimax.lock")
    }


def _pause(process) -> None:
    process.send_signal(signal.SIGSTOP)
    os.waitpid(process.pid, os.WUNTRACED)  # returns once it is stopped


def _resume(process) -> float:
    process.stdin.write("go\n")
    process.stdin.flush()
    process.send_signal(signal.SIGCONT)
    return time.monotonic()


def _take_over(url: str) -> tuple[LeaseLock, float]:
    """This process takes the lease once it has expired (a long lease of its own: it is not under test)."""
    began = time.monotonic()
    while True:
        try:
            return LeaseLock(url, lease_seconds=60).acquire(), time.monotonic() - began
        except ModelDirLockedError as error:
            assert "being written by another process" in str(error), error
            time.sleep(0.1)


def _ended(process, since: float) -> tuple[str, float, float]:
    """``(stderr, seconds until its error line, seconds until it exited)`` of a job, from ``since``."""
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.startswith(ERROR):
            break
    said = time.monotonic() - since
    lines.append(process.stderr.read())  # until it exits
    process.wait()
    return "".join(lines), said, time.monotonic() - since


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(ERROR)]


def test_a_trainer_paused_past_its_lease_writes_nothing_more_and_names_the_process_that_took_over(gcs):
    url = "gs://bkt/paused"
    job = subprocess.Popen(
        [sys.executable, JOB, url, "6", "40"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "ESTIMAX_LEASE_SECONDS": str(LEASE)},
    )  # fmt: skip
    ready = job.stdout.readline()
    assert ready.startswith("waiting at step"), job.communicate()
    _pause(job)
    taker, waited = _take_over(url)
    before = _listing(url)
    stderr, said, exited = _ended(job, _resume(job))
    lines = _error_lines(stderr)
    assert job.returncode == 74 and len(lines) == 1 and "Traceback" not in stderr, stderr
    step = max(int(p.split("/checkpoints/")[1].split("/")[0]) for p in before if "/checkpoints/" in p)
    assert f"another process took over the lock {url}/estimax.lock" in lines[0]
    assert f"pid {os.getpid()}" in lines[0] and f"resume from step {step}" in lines[0], lines[0]
    # Nothing written after the pause: no checkpoint step, no metrics.jsonl, no event file; the
    # job held train records in memory (it logged them) and would have written them at its end.
    assert _listing(url) == before and "train step 6" in stderr
    assert not any(p.endswith("metrics.jsonl") or "/tensorboard/" in p for p in before)
    assert json.loads(storage.read_bytes(taker.path))["pid"] == os.getpid()  # its release left ours alone
    taker.release()
    print(f"lease taken over {waited:.1f} s after SIGSTOP; after SIGCONT the paused trainer said so in "
          f"{said:.2f} s and exited in {exited:.2f} s")  # fmt: skip


HOLDER = """
import sys
from estimax.lease import LeaseLock

lock = LeaseLock(sys.argv[1]).acquire()
while True:
    print("holding", flush=True)
    sys.stdin.readline()
    try:
        lock.check()
    except Exception as error:
        print(f"estimax: error: {error}", file=sys.stderr, flush=True)
        lock.release()
        sys.exit(error.exit_code)
"""


def test_a_paused_holder_on_s3_goes_on_when_nobody_took_its_lease_and_stops_when_somebody_did(s3):
    url, lease = "s3://bkt/held", 2.0  # gs:// is the trainer's test above
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "ESTIMAX_LEASE_SECONDS": str(lease)},
    )  # fmt: skip
    assert holder.stdout.readline() == "holding\n", holder.communicate()
    _pause(holder)
    lock = f"{url}/estimax.lock"
    while time.time() - json.loads(storage.read_bytes(lock))["renewed_at"] <= lease:  # until it has expired
        time.sleep(0.1)
    _resume(holder)
    assert holder.stdout.readline() == "holding\n", holder.communicate()  # proven again: it goes on
    _pause(holder)
    taker, _ = _take_over(url)
    _resume(holder)
    _, stderr = holder.communicate(timeout=60)
    lines = _error_lines(stderr)
    assert holder.returncode == LeaseLostError.exit_code == 74 and len(lines) == 1, stderr
    assert "nobody took the lease over: writing goes on" in stderr  # the first pause
    assert f"another process took over the lock {lock}" in lines[0] and f"pid {os.getpid()}" in lines[0]
    assert json.loads(storage.read_bytes(lock))["pid"] == os.getpid()
    taker.release()
    assert not storage.exists(lock)


def test_a_store_that_goes_away_mid_run_ends_it_within_its_lease_with_one_line(tmp_path):
    emulator = GCSEmulator(str(tmp_path / "gcs"))
    settings = {"ESTIMAX_LEASE_SECONDS": str(LEASE), "ESTIMAX_STORE_DEADLINE_SECONDS": "2"}
    try:
        job = subprocess.Popen(
            [sys.executable, JOB, "gs://bkt/cut", "6", "40"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, **emulator.env, **settings},
        )  # fmt: skip
        assert job.stdout.readline().startswith("waiting at step"), job.communicate()
        with urllib.request.urlopen(f"{emulator.url}/storage/v1/b/bkt/o?prefix=cut/checkpoints/") as answer:
            names = [item["name"] for item in json.load(answer)["items"]]
        step = max(int(name.split("/")[2]) for name in names)
        emulator.process.kill()
        emulator.process.wait()
        stderr, said, exited = _ended(job, _resume(job))
    finally:
        emulator.stop()
    lines = _error_lines(stderr)
    assert job.returncode == 74 and len(lines) == 1, stderr
    assert re.search(r"gs://bkt/cut/estimax.lock: renewing the lease: the store did not answer for \d+ s", lines[0])
    assert f"resume from step {step} with the same command once the store answers" in lines[0], lines[0]
    print(f"the store was killed; the trainer said so {said:.1f} s later and exited {exited:.1f} s later")


def test_taking_and_releasing_the_lock_on_a_stalled_store_wait_a_bounded_time(gcs, estimax_log):
    url = "gs://bkt/stalled"
    # A lease long next to the deadline: on a loaded machine the keeper thread must not reach the end of
    # its proven window (and stop quietly) while release() waits for it.
    lease, deadline = 2 * LEASE, 3  # each call waits lease / 4 = 2 s: one try, a warning, a second try
    lock = LeaseLock(url, lease_seconds=lease, deadline_seconds=deadline).acquire()
    os.kill(gcs.process.pid, signal.SIGSTOP)  # the store stalls: it accepts connections, answers nothing
    try:
        began = time.monotonic()
        lock.release()  # never raises: it runs in a finally, where the error in flight is the one to report
        released = time.monotonic() - began
        with pytest.raises(StoreUnavailableError) as raised:
            LeaseLock(url, lease_seconds=lease, deadline_seconds=deadline).acquire()
        refused = time.monotonic() - began - released
    finally:
        os.kill(gcs.process.pid, signal.SIGCONT)
    assert re.fullmatch(
        rf"{url}/estimax.lock: taking the lock: the store did not answer for \d s \(.*\); expected a store "
        r"that answers within 3 s \(ESTIMAX_STORE_DEADLINE_SECONDS\)\. Fix: nothing was written; run the same "
        r"command again once the store answers\.",
        str(raised.value),
    ), raised.value
    assert "taking the lock: the store did not answer" in estimax_log.text and "trying again" in estimax_log.text
    assert f"{url}/estimax.lock: releasing the lock: the store did not answer for " in estimax_log.text
    expires = f"Fix: none needed: the next run takes the lock over once its lease expires ({lease:g} s)"
    assert expires in estimax_log.text
    storage.remove(f"{url}/estimax.lock")  # the store answers again: the next run would take it over
    print(f"release gave up after {released:.1f} s, taking the lock after {refused:.1f} s")


@pytest.mark.parametrize(
    "scheme, content, holds",
    [
        ("gs", b"", "is empty"),
        ("gs", b"\x00\xffnot json", r"holds 10 bytes that are not a lease record: b'\\x00\\xffnot json'"),
        ("gs", b'{"host": "h", "pid": 7}', r"holds 23 bytes that are not a lease record: b'\{\"host\""),
        ("s3", b"[1, 2]" * 20, r"holds 120 bytes that are not a lease record: b'\[1, 2\].*'\.\.\."),
    ],
)
def test_a_lock_object_that_holds_no_lease_says_what_it_holds_and_how_to_delete_it(scheme, content, holds, request):
    request.getfixturevalue({"gs": "gcs", "s3": "s3"}[scheme])
    path = f"{scheme}://bkt/not-a-lease-{len(content)}/estimax.lock"
    storage.write_bytes(path, content)
    command = f"gcloud storage rm {path}" if scheme == "gs" else f"aws s3 rm {path}"
    with pytest.raises(ModelDirLockedError, match=rf"^The lock {path} {holds}.*; expected the JSON record") as raised:
        LeaseLock(storage.parent(path)).acquire()
    assert str(raised.value).endswith(f"delete it: `{command}`.") and "\n" not in str(raised.value)
    assert storage.read_bytes(path) == content  # left as it was
