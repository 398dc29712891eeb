"""On ``gs://`` the console holds estimax's lines only: the ``estimax`` command trained against the GCS
emulator on 127.0.0.1 (a private one, started here) prints no line of TensorStore's or gcsfs's, when the
store answers and when it is killed (SIGKILL) mid-run, where one ``StoreUnavailableError`` line ends it.
TensorStore's credentials line stays where it means something: on an endpoint that is not the emulator's.
"""

import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.request

from helpers import CLI_ERROR, ROOT, error_lines, user_env
from stores import GCSEmulator
from test_cli_runs import TASK

# An estimax line: a log line (the CLI's format, or logging's own before the CLI's is set), or its error line.
ESTIMAX_LINE = re.compile(rf"^(\d\d:\d\d:\d\d estimax  |WARNING:estimax:|{CLI_ERROR})")
LEASE = 44  # seconds
TRAIN_LOG = re.compile(r"^\d\d:\d\d:\d\d estimax  train step \d+ ")


def _cli(emulator: GCSEmulator, tmp_path, *args, **settings) -> subprocess.Popen:
    """``estimax train`` of the blobs task with no Google credentials anywhere (a user's machine without
    gcloud): TensorStore looks for them and, finding none, would say so."""
    (tmp_path / "blobs.py").write_text(TASK)
    (tmp_path / "gcloud").mkdir(exist_ok=True)
    env = user_env("GOOGLE_APPLICATION_CREDENTIALS")
    env.update(emulator.env, CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), **settings)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "estimax.cli", "train", "blobs.py", *args]
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _not_estimax(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not ESTIMAX_LINE.match(line)]


def test_a_healthy_run_on_the_emulator_prints_estimax_lines_only(tmp_path):
    emulator = GCSEmulator(str(tmp_path / "gcs"))
    try:
        job = _cli(emulator, tmp_path, "--model-dir", "gs://bkt/healthy", "--max-steps", "4")
        stdout, stderr = job.communicate(timeout=300)
        with urllib.request.urlopen(f"{emulator.url}/storage/v1/b/bkt/o?prefix=healthy/checkpoints/4/") as answer:
            saved = json.load(answer).get("items", [])  # TensorStore wrote the checkpoint's arrays there
    finally:
        emulator.stop()
    assert job.returncode == 0 and "Done at step 4" in stderr, stdout + stderr
    assert any("/state/" in item["name"] for item in saved), saved
    assert _not_estimax(stderr) == [], stderr


def test_a_killed_emulator_ends_the_run_with_estimax_lines_only(tmp_path):
    emulator = GCSEmulator(str(tmp_path / "gcs"))
    # A lease long enough for gcsfs to give up on its first requests to the dead store (about 31 s of retries,
    # each with a traceback of its own) before the lease ends the run; the deadline is longer, as by default.
    settings = {"ESTIMAX_LEASE_SECONDS": str(LEASE), "ESTIMAX_STORE_DEADLINE_SECONDS": str(2 * LEASE)}
    args = ("--model-dir", "gs://bkt/killed", "--max-steps", "100000", "--log-every-steps", "2")
    try:
        job = _cli(emulator, tmp_path, *args, **settings)
        before = []
        for line in job.stderr:  # training is under way ...
            before.append(line)
            if TRAIN_LOG.match(line):
                break
        emulator.process.kill()  # ... when the store goes away
        emulator.process.wait()
        killed = time.monotonic()
        stdout, after = job.communicate(timeout=3 * LEASE)
        exited = time.monotonic() - killed
    finally:
        emulator.stop()
    stderr = "".join(before) + after
    assert job.returncode == 74 and len(error_lines(stderr)) == 1, stderr
    assert "the store did not answer for" in error_lines(stderr)[0], stderr
    assert "Traceback" not in stderr and _not_estimax(stderr) == [], stderr
    said = [line for line in after.splitlines() if not TRAIN_LOG.match(line)]  # besides the steps it went on with
    assert exited > 36, exited  # gcsfs gave up on a request meanwhile
    assert len(said) <= 12, after  # the warnings while it waits, then the error line
    print(f"a killed store: {len(said)} lines on the console, the last {exited:.1f} s after the kill")


PROBE = """
import sys, tensorstore as ts
from estimax import storage
storage.quiet_tensorstore("gs://bkt/probe")
store = ts.KvStore.open({"driver": "gcs", "bucket": "bkt"}).result()
print(store.read("missing").result().state, flush=True)
"""


def test_tensorstore_credentials_line_stays_off_the_emulator_only(tmp_path):
    """Against the emulator's endpoint the line is noise (it takes anonymous requests); TensorStore pointed
    elsewhere without ``STORAGE_EMULATOR_HOST`` (a server that may want credentials) still says it."""
    emulator = GCSEmulator(str(tmp_path / "gcs"))
    (tmp_path / "gcloud").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST")}
    env.update(CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), TENSORSTORE_GCS_HTTP_URL=emulator.url)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    try:
        elsewhere = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
        on_emulator = subprocess.run([sys.executable, "-c", PROBE], env={**env, "STORAGE_EMULATOR_HOST": emulator.url},
                                     capture_output=True, text=True)  # fmt: skip
    finally:
        emulator.stop()
    for run in (elsewhere, on_emulator):
        assert run.returncode == 0 and run.stdout == "missing\n", run.stdout + run.stderr
    assert "Could not find the credentials file" in elsewhere.stderr, elsewhere.stderr
    assert on_emulator.stderr == "", on_emulator.stderr


def test_a_failed_read_ahead_is_said_by_its_reader_not_by_fsspecs_logger(caplog):
    """fsspec's read-ahead logs each read that failed with its traceback, then raises it to the reader
    (estimax says it as one line): its errors stay off the console, its warnings do not."""
    from estimax.storage import noise

    noise.quiet_libraries()
    log = logging.getLogger("fsspec.prefetcher")
    with caplog.at_level(logging.WARNING, logger="fsspec.prefetcher"):
        try:
            raise OSError("the store went away")
        except OSError:
            log.exception("Consumer caught an error.")
        log.error("Global error state set in BackgroundPrefetcher: %s", "the store went away")
        log.warning("BackgroundPrefetcher teardown did not complete within 5s; it will keep running in the background.")
    assert [r.levelname for r in caplog.records] == ["WARNING"]
