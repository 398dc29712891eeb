"""One writer per model_dir on a bucket, also across a pause: the lease is fenced, every call to the
store has a deadline, and a lock object that holds no lease says what it holds and how to delete it.
A later attempt of a run (``ESTIMAX_RUN_ID``) takes the lock over at once, on a bucket and on a disk;
the earlier attempt, if it still runs, writes nothing more.

Real processes and real signals against the GCS emulator and moto's S3 server on 127.0.0.1:
``lease_job.py`` trains on gs:// and is paused (SIGSTOP) past its lease, or loses its store (SIGKILL).
Lease times are seconds here (``ESTIMAX_LEASE_SECONDS``); a minute by default, as in the tests of
attempts, where nothing waits for a lease to expire.
"""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import fsspec
import pytest
import warm
from helpers import LEASE_JOB, ended, error_lines, resume_paused
from stores import GCSEmulator

from estimax import storage
from estimax.errors import LeaseLostError, ModelDirLockedError, StoreUnavailableError
from estimax.run.holder import LOCK_FILE, Holder, this_process
from estimax.run.lease import LeaseLock
from estimax.run.lease_proof import PAUSE_SECONDS
from estimax.run.lock import Lock, read_holder

LEASE = 4.0  # seconds: the pauses below last a little longer than this


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


def _take_over(url: str) -> tuple[LeaseLock, float]:
    """This process takes the lease once it has expired (a long lease of its own: it is not under test)."""
    began = time.monotonic()
    while True:
        try:
            return LeaseLock(url, lease_seconds=60).acquire(), time.monotonic() - began
        except ModelDirLockedError as error:
            assert "being written by another process" in str(error), error
            time.sleep(0.1)


def test_a_trainer_paused_past_its_lease_writes_nothing_more_and_names_the_process_that_took_over(gcs):
    url = "gs://bkt/paused"
    job = warm.Popen(
        [sys.executable, LEASE_JOB, url, "6", "40"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "ESTIMAX_LEASE_SECONDS": str(LEASE)},
    )  # fmt: skip
    ready = job.stdout.readline()
    assert ready.startswith("waiting at step"), job.communicate()
    _pause(job)
    taker, waited = _take_over(url)
    before = _listing(url)
    stderr, said, exited = ended(job, resume_paused(job))
    lines = error_lines(stderr)
    assert job.returncode == 74 and len(lines) == 1 and "Traceback" not in stderr, stderr
    step = max(int(p.split("/checkpoints/")[1].split("/")[0]) for p in before if "/checkpoints/" in p)
    assert f"another process took over the lock {url}/estimax.lock" in lines[0]
    assert f"pid {os.getpid()}" in lines[0] and f"resume from step {step}" in lines[0], lines[0]
    # Nothing written after the pause: no checkpoint step, no record, no event file. The records up to
    # the last checkpoint were written before it was saved (the job's flush intervals are past the run).
    assert _listing(url) == before and "train step 6" in stderr
    records = [json.loads(line) for line in storage.read_bytes(f"{url}/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(2, step + 1, 2))
    assert json.loads(storage.read_bytes(taker.path))["pid"] == os.getpid()  # its release left ours alone
    taker.release()
    print(f"lease taken over {waited:.1f} s after SIGSTOP; after SIGCONT the paused trainer said so in "
          f"{said:.2f} s and exited in {exited:.2f} s")  # fmt: skip


HOLDER = """
import socket, sys, time
from estimax.run.locks import lock_for

if len(sys.argv) > 2:  # as if on another host: the host its record names, where its pid cannot be checked
    socket.gethostname = lambda: sys.argv[2]

began = time.monotonic()
try:
    lock = lock_for(sys.argv[1]).acquire(training=True)
except Exception as error:
    print(f"estimax: error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)
print(f"holding, taken in {time.monotonic() - began:.2f} s", flush=True)
while sys.stdin.readline() == "go\\n":
    try:
        lock.check()
    except Exception as error:
        print(f"estimax: error: {error}", file=sys.stderr, flush=True)
        lock.release()
        sys.exit(error.exit_code)
    print("holding", flush=True)
lock.release()
"""


def _holder(url: str, env: dict, *host: str) -> tuple[subprocess.Popen, float]:
    """A process holding the lock of ``url`` as training does (``HOLDER``; on ``host`` if one is given),
    and how long taking it took."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, *host], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    line = holder.stdout.readline()
    assert line.startswith("holding, taken in "), (line, holder.communicate())
    return holder, float(line.split()[3])


def test_a_paused_holder_on_s3_goes_on_when_nobody_took_its_lease_and_stops_when_somebody_did(s3):
    url, lease = "s3://bkt/held", 2.0  # gs:// is the trainer's test above
    holder, _ = _holder(url, {**os.environ, "ESTIMAX_LEASE_SECONDS": str(lease)})
    _pause(holder)
    lock = f"{url}/estimax.lock"
    while time.time() - json.loads(storage.read_bytes(lock))["renewed_at"] <= lease:  # until it has expired
        time.sleep(0.1)
    resume_paused(holder)
    assert holder.stdout.readline() == "holding\n", holder.communicate()  # proven again: it goes on
    _pause(holder)
    taker, _ = _take_over(url)
    resume_paused(holder)
    _, stderr = holder.communicate(timeout=60)
    lines = error_lines(stderr)
    assert holder.returncode == LeaseLostError.exit_code == 74 and len(lines) == 1, stderr
    assert "nobody took the lease over: writing goes on" in stderr  # the first pause
    assert f"another process took over the lock {lock}" in lines[0] and f"pid {os.getpid()}" in lines[0]
    assert json.loads(storage.read_bytes(lock))["pid"] == os.getpid()
    taker.release()
    assert not storage.exists(lock)


def test_a_store_that_goes_away_mid_run_ends_it_within_its_lease_with_one_line(tmp_path):
    emulator = GCSEmulator(str(tmp_path / "gcs"))
    settings = {"ESTIMAX_LEASE_SECONDS": str(LEASE), "ESTIMAX_STORE_DEADLINE_SECONDS": str(2 * LEASE)}
    try:
        job = warm.Popen(
            [sys.executable, LEASE_JOB, "gs://bkt/cut", "6", "40"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**os.environ, **emulator.env, **settings},
        )  # fmt: skip
        assert job.stdout.readline().startswith("waiting at step"), job.communicate()
        with urllib.request.urlopen(f"{emulator.url}/storage/v1/b/bkt/o?prefix=cut/checkpoints/") as answer:
            names = [item["name"] for item in json.load(answer)["items"]]
        step = max(int(name.split("/")[2]) for name in names)
        emulator.process.kill()
        emulator.process.wait()
        stderr, said, exited = ended(job, resume_paused(job))
    finally:
        emulator.stop()
    lines = error_lines(stderr)
    assert job.returncode == 74 and len(lines) == 1, stderr
    # The lease's renewal or the records' upload before the next checkpoint finds it first: either says so.
    assert re.search(r"gs://bkt/cut/(estimax.lock: renewing the lease|metrics.jsonl: writing): the store did not "
                     r"answer for \d+ s", lines[0]), lines[0]  # fmt: skip
    assert f"resume from step {step}" in lines[0], lines[0]
    print(f"the store was killed; the trainer said so {said:.1f} s later and exited {exited:.1f} s later")


def test_taking_and_releasing_the_lock_on_a_stalled_store_wait_a_bounded_time(gcs, estimax_log):
    url = "gs://bkt/stalled"
    # A lease long next to the deadline: on a loaded machine the keeper thread must not reach the end of
    # its proven window (and stop quietly) while release() waits for it.
    lease, deadline = 2 * LEASE, 3  # each call waits lease / 4 = 2 s: one try, a warning, a second try
    lock = LeaseLock(url, lease_seconds=lease, deadline_seconds=deadline).acquire()
    with gcs.stalled():  # the store stalls: it accepts connections, answers nothing
        began = time.monotonic()
        lock.release()  # never raises: it runs in a finally, where the error in flight is the one to report
        released = time.monotonic() - began
        with pytest.raises(StoreUnavailableError) as raised:
            LeaseLock(url, lease_seconds=lease, deadline_seconds=deadline).acquire()
        refused = time.monotonic() - began - released
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


def test_a_write_the_store_applied_after_its_call_timed_out_leaves_the_lease_its_own(gcs, estimax_log):
    """A conditional write cut off by its call's timeout may still be applied: the next one then fails its
    condition. The holder knows its own write by its bytes and goes on, instead of taking itself for another
    process (before: taking refused the model_dir as "being written by another process" naming this one, and a
    renewal lost the lease to "another process", this one). Made for real: the emulator is stopped while the
    write waits in its queue and resumed after the call timed out and before the retry; it then applies the
    write (fake-gcs-server does; moto drops a request whose client has gone)."""
    url = "gs://bkt/answered-late"
    lease = 2 * LEASE  # each call waits lease / 4 = 2 s; a retry of a take follows 2 s later, of a renewal 1 s
    took = {}

    def stalled_until_timed_out(operation, call):
        """``call()`` while the store stands still until the holder's write has timed out (its warning for
        ``operation``), and then answers: it applies that write before the holder tries again."""
        timed_out = f"{url}/{LOCK_FILE}: {operation}: the store did not answer"

        def resume():
            while timed_out not in estimax_log.text and time.monotonic() < deadline:
                time.sleep(0.02)
            gcs.resume()

        gcs.stall()
        began = time.monotonic()
        deadline = began + 3 * lease
        resumer = threading.Thread(target=resume)
        resumer.start()
        try:
            return call()
        finally:
            took[operation] = round(time.monotonic() - began, 1)
            deadline = 0.0
            resumer.join()
            gcs.resume()

    lock = LeaseLock(url, lease_seconds=lease, deadline_seconds=30)
    stalled_until_timed_out("taking the lock", lock.acquire)  # the create times out, is applied, is tried again
    try:
        lock.prove(saving=1)  # a renewal now
        stalled_until_timed_out("renewing the lease", lambda: lock.prove(saving=2))  # the same for a renewal
        lock.check()
        found = Holder.from_json(storage.read_bytes(f"{url}/{LOCK_FILE}"))
        assert (found.host, found.pid, found.saving) == (this_process().host, os.getpid(), 2), found
    finally:
        lock.release()
    assert not storage.exists(f"{url}/{LOCK_FILE}")  # released: its own to delete
    for operation in ("taking the lock", "renewing the lease"):  # one timeout each; ``took``: each call's seconds
        timed_out = f"{url}/{LOCK_FILE}: {operation}: the store did not answer"
        assert estimax_log.text.count(timed_out) == 1, (took, estimax_log.text)


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


ATTEMPTS = {"ESTIMAX_LEASE_SECONDS": "60"}  # a lease that nothing in these tests waits for


def test_a_later_attempt_of_a_run_takes_its_lease_over_at_once_and_other_runs_are_refused(s3, monkeypatch):
    url = "s3://bkt/attempts"
    lock = f"{url}/{LOCK_FILE}"
    env = {**os.environ, **ATTEMPTS, "ESTIMAX_RUN_ID": "job-7"}
    first, _ = _holder(url, env, "node-b")  # on another host: that it is gone cannot be seen from here
    first.kill()  # SIGKILL: its lease stands, renewed a moment ago, for another minute
    first.wait()
    killed = time.monotonic()
    for run in ("job-8", ""):  # another run, and none: refused as before, the holder named
        monkeypatch.setenv("ESTIMAX_RUN_ID", run)
        held_by = rf"being written by another process: .*pid {first.pid}, started .*, run job-7, command"
        with pytest.raises(ModelDirLockedError, match=held_by):
            LeaseLock(url).acquire(training=True)
    # This process started before the first attempt: as an attempt of job-7, it is an earlier one.
    monkeypatch.setenv("ESTIMAX_RUN_ID", "job-7")
    later = (
        rf"(?s)by a later attempt of this process's run \(ESTIMAX_RUN_ID=job-7\): .*pid {first.pid}, .*started before"
    )
    with pytest.raises(ModelDirLockedError, match=later):
        LeaseLock(url).acquire(training=True)
    second, taken = _holder(url, env)  # the next attempt: a process started after the first
    held = time.monotonic() - killed
    record = json.loads(storage.read_bytes(lock))
    assert (record["pid"], record["run"]) == (second.pid, "job-7") and taken < 10, (record, taken)
    _, stderr = second.communicate("\n", timeout=60)  # it releases the lock
    assert second.returncode == 0 and not storage.exists(lock), stderr
    took = f"Took over the lock of model_dir {url}: it is held by an earlier attempt of this run (ESTIMAX_RUN_ID=job-7)"
    assert took in stderr and f"pid {first.pid}" in stderr, stderr
    print(f"a 60 s lease of a killed attempt taken over by the next in {taken:.2f} s ({held:.1f} s from the kill, "
          "the new process's start included)")  # fmt: skip


def test_a_paused_attempt_of_a_run_finds_its_lease_taken_by_the_next_one_and_writes_nothing(gcs):
    url = "gs://bkt/next-attempt"
    env = {**os.environ, **ATTEMPTS, "ESTIMAX_RUN_ID": "job-9"}
    job = warm.Popen([sys.executable, LEASE_JOB, url, "6", "40"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert job.stdout.readline().startswith("waiting at step"), job.communicate()
    _pause(job)
    paused = time.monotonic()
    before = _listing(url)
    second, taken = _holder(url, env)
    # A pause that it can tell from a busy machine (a shorter one: see PAUSE_SECONDS).
    time.sleep(max(0.0, paused + 2 * PAUSE_SECONDS - time.monotonic()))
    stderr, said, exited = ended(job, resume_paused(job))
    lines = error_lines(stderr)
    assert job.returncode == 74 and len(lines) == 1 and "Traceback" not in stderr, stderr
    step = max(int(p.split("/checkpoints/")[1].split("/")[0]) for p in before if "/checkpoints/" in p)
    took = f"a later attempt of this process's run (ESTIMAX_RUN_ID=job-9) took over the lock {url}/estimax.lock: host "
    assert took in lines[0] and f"pid {second.pid}" in lines[0], lines[0]
    assert f"carries the run on from its last committed checkpoint (step {step})" in lines[0], lines[0]
    assert _listing(url) == before  # nothing written after the pause
    assert taken < 10  # well within the 60 s lease
    assert json.loads(storage.read_bytes(f"{url}/{LOCK_FILE}"))["pid"] == second.pid  # its release left it alone
    second.communicate("\n", timeout=60)
    print(f"the paused attempt's 60 s lease taken over in {taken:.2f} s; after SIGCONT it said so in {said:.2f} s "
          f"and exited in {exited:.2f} s")  # fmt: skip


def _appended(path: str, step: int, deadline_seconds: float = 60) -> None:
    """Returns once the train record of ``step`` is in ``path``."""
    began = time.monotonic()
    while not any(r["split"] == "train" and r["step"] == step for r in map(json.loads, _lines(path))):
        assert time.monotonic() - began < deadline_seconds, f"no train record of step {step} in {path}"
        time.sleep(0.05)


def _lines(path: str) -> list[str]:
    """The whole lines of a file being appended to (none while it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line for line in f if line.endswith("\n")]


def _files(directory) -> dict:
    """Every file under ``directory`` but the lock, with its size and modification time."""
    return {
        os.path.relpath(os.path.join(root, name), directory): (os.path.getsize(p), os.path.getmtime(p))
        for root, _, names in os.walk(directory)
        for name in names
        if name != LOCK_FILE and (p := os.path.join(root, name))
    }


def test_on_a_disk_a_later_attempt_takes_a_live_holders_lock_over_and_the_paused_holder_writes_nothing(tmp_path):
    model_dir = str(tmp_path / "run")
    env = {**os.environ, "ESTIMAX_RUN_ID": "job-11"}
    job = warm.Popen([sys.executable, LEASE_JOB, model_dir, "6", "40"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    waiting = job.stdout.readline()
    assert waiting.startswith("waiting at step"), job.communicate()
    _appended(os.path.join(model_dir, "metrics.jsonl"), int(waiting.split()[-1]))  # no record is being written
    _pause(job)  # alive on this host: only a later attempt of its run takes its lock
    before = _files(model_dir)
    second, _ = _holder(model_dir, env)
    stderr, _, _ = ended(job, resume_paused(job))
    lines = error_lines(stderr)
    assert job.returncode == 74 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "a later attempt of this process's run (ESTIMAX_RUN_ID=job-11) took over the lock" in lines[0]
    assert _files(model_dir) == before
    assert json.loads(storage.read_bytes(os.path.join(model_dir, LOCK_FILE)))["pid"] == second.pid
    second.communicate("\n", timeout=60)


def test_a_check_while_a_later_attempt_takes_the_lock_over_on_a_disk_names_that_attempt(tmp_path, monkeypatch):
    """A taker moves the lock aside, then writes its own record: a check in between waits for the record
    (it named nobody, "another process took over", when the taker was slow under load)."""
    monkeypatch.setenv("ESTIMAX_RUN_ID", "job-13")
    lock = Lock(str(tmp_path / "run")).acquire(training=True)
    mine = read_holder(lock.path)
    later = dataclasses.replace(mine, pid=mine.pid + 1, attempt_started=mine.attempt_started + 1)
    os.rename(lock.path, lock.path + ".stale")  # the taker's first move
    writer = threading.Timer(0.5, lambda: storage.write_bytes(lock.path, later.to_json().encode()))
    writer.start()
    with pytest.raises(LeaseLostError, match=r"a later attempt of this process's run \(ESTIMAX_RUN_ID=job-13\)"):
        lock.check()
    writer.join()


def test_on_a_shared_disk_another_hosts_earlier_attempt_is_taken_over_and_another_run_is_not(
    tmp_path, monkeypatch, estimax_log
):
    model_dir = str(tmp_path / "run")
    os.makedirs(model_dir)
    path = os.path.join(model_dir, LOCK_FILE)
    monkeypatch.setenv("ESTIMAX_RUN_ID", "job-12")
    mine = this_process(training=True)
    earlier = dataclasses.replace(mine, host="elsewhere", pid=4242, attempt_started=mine.attempt_started - 30)
    later = dataclasses.replace(earlier, attempt_started=mine.attempt_started + 30)
    for holder, run, refused in [
        (earlier, "job-13", "being written by another process: host elsewhere"),  # a pid there cannot be checked
        (later, "job-12", "by a later attempt of this process"),
    ]:
        with open(path, "w") as f:
            f.write(holder.to_json())
        monkeypatch.setenv("ESTIMAX_RUN_ID", run)
        with pytest.raises(ModelDirLockedError, match=refused):
            Lock(model_dir).acquire(training=True)
    with open(path, "w") as f:
        f.write(earlier.to_json())
    monkeypatch.setenv("ESTIMAX_RUN_ID", "job-12")
    lock = Lock(model_dir).acquire(training=True)
    assert json.loads(storage.read_bytes(path))["pid"] == os.getpid()
    assert "it is held by an earlier attempt of this run (ESTIMAX_RUN_ID=job-12) (host elsewhere" in estimax_log.text
    lock.check()
    lock.release()
    assert not os.path.exists(path)


def test_a_lock_record_of_an_earlier_release_reads_and_is_written_the_same(tmp_path):
    earlier = (
        '{"host": "elsewhere", "pid": 4242, "process_start": 17, "started_at": "2026-01-02 03:04:05 UTC", '
        '"command": "python train.py", "run": "job-1", "attempt_started": 1700000000.5, "lease_seconds": 60.0, '
        '"left": [8], "saving": 12, "renewed_at": 1700000100.25}'
    )
    holder = Holder.from_json(earlier)
    assert holder.to_json() == earlier  # byte for byte what that release wrote
    assert (holder.run, holder.left, holder.saving, holder.lease_seconds) == ("job-1", (8,), 12, 60.0)
    oldest = Holder.from_json('{"host": "elsewhere", "pid": 4242}')  # what a record lacks reads as None
    assert (oldest.host, oldest.pid, oldest.process_start, oldest.run, oldest.renewed_at) == (
        "elsewhere",
        4242,
        *[None] * 3,
    )
    assert Holder.from_json(b"[1, 2]") is None and Holder.from_json(b"\xff") is None  # no record: not ours
    (tmp_path / LOCK_FILE).write_text(
        '{"host": "elsewhere", "pid": 4242, "started_at": "x", "command": "python old.py"}'
    )
    with pytest.raises(
        ModelDirLockedError, match="by another process: host elsewhere, pid 4242, started x, command `py"
    ):
        Lock(str(tmp_path)).acquire()
