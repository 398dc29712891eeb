"""``estimax serve BASE``: a real server process following an export base on disk and in buckets,
called over real HTTP while versions arrive, break, and leave."""

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import optax
import pytest
from flax import nnx
from helpers import user_env
from stores import free_port

import estimax as ex
from estimax import serving, storage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION_HEADER = "Estimax-Model-Version"
CLIENTS = 32
WAIT = 120  # seconds: a bound on a wait that normally takes a second or two, never waited out


class Net(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


def model_fn(model, features, labels, mode, params):
    return ex.Spec(predictions=model(features))


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """Five artifacts with different weights (seeds 0-4), exported once for the module."""
    root = tmp_path_factory.mktemp("staged")
    paths = []
    for seed in range(5):
        config = ex.RunConfig(seed=seed, quiet=True)
        est = ex.Estimator(lambda rngs, params: Net(rngs), model_fn, optax.sgd(0.1), config=config)
        with pytest.warns(UserWarning, match="initial, untrained weights"):
            paths.append(est.export(str(root / f"seed{seed}"), example_features=np.zeros((1, 4), np.float32)))
    return paths


def publish(artifact: str, base: str, number: int) -> str:
    """Places a copy of ``artifact`` at ``base/number`` as export's ``publish`` does: staged under a
    dot-name then renamed on disk; uploaded with signature.json last to a bucket."""
    target = storage.join(base, str(number))
    if storage.is_url(base):
        storage.upload(artifact, target, last="signature.json")
        return target
    staging = os.path.join(base, f".incoming-{number}")
    shutil.copytree(artifact, staging)
    os.rename(staging, target)
    return target


class Server:
    """``estimax serve BASE`` in a process of its own; its stderr goes to a file read as it runs."""

    def __init__(self, base: str, log_dir, *options, before_ready=None):
        self.port, self.base = free_port(), base
        self.name = storage.name(base)
        self.log = os.path.join(log_dir, f"serve-{self.port}.log")
        env = user_env("PYTHONPATH")
        env["PYTHONPATH"] = ROOT
        command = [sys.executable, "-m", "estimax.cli", "serve", base, "--port", str(self.port), *options]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
        if before_ready is not None:
            before_ready(self)
        wait_for(lambda: self._answers() or self.process.poll() is not None, "the server to start")
        assert self.process.poll() is None, self.stderr()

    def _answers(self) -> bool:
        try:
            return self.request("GET", f"/v1/models/{self.name}")[0] == 200
        except OSError:
            return False

    def request(self, method, path, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body).encode())
            response = conn.getresponse()
            return response.status, json.loads(response.read()), response.getheader(VERSION_HEADER)
        finally:
            conn.close()

    def predict(self, x, version=None):
        route = f"/v1/models/{self.name}" + (f"/versions/{version}" if version is not None else "") + ":predict"
        return self.request("POST", route, {"instances": x.tolist()})

    def status(self) -> dict:
        return self.request("GET", f"/v1/models/{self.name}")[1]

    def states(self) -> dict[int, str]:
        return {int(v["version"]): v["state"] for v in self.status()["model_version_status"]}

    def wait_polls(self, count: int) -> None:
        """Waits until the server has polled the base ``count`` more times."""
        target = self.status()["estimax"]["polls"] + count
        wait_for(lambda: self.status()["estimax"]["polls"] >= target, f"{count} polls")

    def stderr(self) -> str:
        with open(self.log) as f:
            return f.read()

    def stop(self) -> str:
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0, self.stderr()
        return self.stderr()


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"waited {WAIT} s for {what}"
        time.sleep(0.05)


def _rows(seed: int, n: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)


def _close(answer, expected) -> bool:
    return np.allclose(answer, expected, rtol=1e-5, atol=1e-6)


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "base" / "demo"
    path.mkdir(parents=True)
    return str(path)


def test_half_copied_and_broken_versions_are_never_served(staged, base, tmp_path):
    publish(staged[1], base, 1)
    os.makedirs(os.path.join(base, "5"))  # a copy under way: no signature.json yet
    shutil.copy(os.path.join(staged[4], "model.jaxexport"), os.path.join(base, "5"))
    shutil.copytree(staged[2], os.path.join(base, ".incoming-6"))  # dot-names and other names are no versions
    shutil.copytree(staged[2], os.path.join(base, "latest"))
    publish(staged[2], base, 3)
    arrays = os.path.join(base, "3", "params", "d")
    damaged = os.path.join(arrays, sorted(os.listdir(arrays))[0])
    with open(damaged, "r+b") as f:
        f.write(b"\0" * 64)  # a file corrupt
    x = _rows(0)
    server = Server(base, tmp_path, "--poll-seconds", "0.05", "--no-calibration", "--max-batch-size", "4")
    try:
        assert server.states() == {3: "END", 1: "AVAILABLE"}
        broken = os.path.join(base + "-copies", "4")
        shutil.copytree(staged[3], broken)
        os.remove(os.path.join(broken, "model.jaxexport"))  # a file missing
        os.rename(broken, os.path.join(base, "4"))
        wait_for(lambda: 4 in server.states(), "version 4 tried")
        server.wait_polls(10)
        status, answer, version = server.predict(x)
        assert (status, version) == (200, "1") and _close(answer["predictions"], serving.load(staged[1])(x))
        entries = {int(v["version"]): v for v in server.status()["model_version_status"]}
        assert {n: v["state"] for n, v in entries.items()} == {4: "END", 3: "END", 1: "AVAILABLE"}
        assert "model.jaxexport" in entries[4]["status"]["error_message"]
        assert os.path.join(base, "3", "params") in entries[3]["status"]["error_message"]
        assert entries[3]["status"]["error_code"] == "DATA_LOSS" and entries[1]["status"]["error_code"] == "OK"
        refused = [line for line in server.stderr().splitlines() if " refused: " in line]
        assert len(refused) == 2, refused  # one line each, not one per poll
        assert refused[0].startswith("Version 3 (") and "no version is serving yet" in refused[0]
        assert refused[1].startswith("Version 4 (") and "version 1 keeps serving" in refused[1]
        assert server.predict(x, version=3)[0] == 404

        # The missing file arrives: the files changed, so version 4 is tried again, and served.
        shutil.copy(os.path.join(staged[3], "model.jaxexport"), os.path.join(base, "4"))
        wait_for(lambda: server.predict(x)[2] == "4", "version 4 once written again")
        assert _close(server.predict(x)[1]["predictions"], serving.load(staged[3])(x))
        for name in ("params", "signature.json"):  # the copy of version 5 completes, signature.json last
            copy = shutil.copytree if name == "params" else shutil.copy
            copy(os.path.join(staged[4], name), os.path.join(base, "5", name))
        wait_for(lambda: server.predict(x)[2] == "5", "version 5 once complete")
        assert _close(server.predict(x)[1]["predictions"], serving.load(staged[4])(x))
        assert server.states()[5] == "AVAILABLE"
    finally:
        log = server.stop()
    assert sum(" refused: " in line for line in log.splitlines()) == 2, log


def test_swaps_under_load_drop_no_request_and_answer_with_each_version(staged, base, tmp_path):
    publish(staged[0], base, 10)
    server = Server(base, tmp_path, "--poll-seconds", "0.05", "--no-calibration", "--max-batch-size", "8",
                    "--num-versions", "2")  # fmt: skip
    references = {10 * (k + 1): serving.load(staged[k]) for k in range(4)}
    answers = [[] for _ in range(CLIENTS)]
    failures, done = [], threading.Event()

    def client(i):
        x = _rows(100 + i, n=1 + i % 3)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = json.dumps({"instances": x.tolist()}).encode()
        while not done.is_set():
            try:
                conn.request("POST", "/v1/models/demo:predict", body)
                response = conn.getresponse()
                answer = json.loads(response.read())
            except (OSError, http.client.HTTPException) as error:
                failures.append(f"client {i}: {error!r}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
                continue
            if response.status != 200:
                failures.append(f"client {i}: HTTP {response.status} {answer}")
                continue
            answers[i].append((int(response.getheader(VERSION_HEADER)), x, answer["predictions"]))
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        for number in (20, 30, 40):
            publish(staged[number // 10 - 1], base, number)
            wait_for(lambda: any(a and a[-1][0] == number for a in answers), f"a request answered by {number}")  # noqa: B023
        wait_for(lambda: all(a and a[-1][0] == 40 for a in answers), "every client answered by 40")
        done.set()
        for t in threads:
            t.join()
        assert failures == []
        for i, client_answers in enumerate(answers):
            numbers = [n for n, _, _ in client_answers]
            assert numbers == sorted(numbers), f"client {i} went back to an older version"
            for number, x, predictions in client_answers:
                assert _close(predictions, references[number](x)), (i, number)
        assert {n for a in answers for n, _, _ in a} == {10, 20, 30, 40}
        assert server.states() == {40: "AVAILABLE", 30: "AVAILABLE", 20: "END", 10: "END"}
        x = _rows(7)
        for number in (40, 30):  # the two newest, each at /versions/N
            status, answer, version = server.predict(x, version=number)
            assert (status, version) == (200, str(number)) and _close(answer["predictions"], references[number](x))
            metadata = server.request("GET", f"/v1/models/demo/versions/{number}/metadata")[1]
            assert metadata["model_spec"]["version"] == str(number)
        assert server.predict(x, version=20)[0] == 404
        assert server.request("GET", "/v1/models/demo/versions/20")[1]["model_version_status"][0]["state"] == "END"
    finally:
        done.set()
        log = server.stop()
    assert all(f"Version {n} AVAILABLE" in log for n in (20, 30, 40)) and "refused" not in log, log


def test_the_old_version_answers_what_it_holds_while_unloading(staged, base, tmp_path):
    publish(staged[0], base, 1)
    # A one-row request waits up to 10 s in the batcher for a second row: it is in flight across the swap.
    server = Server(base, tmp_path, "--poll-seconds", "0.05", "--no-calibration", "--max-batch-size", "2",
                    "--batch-timeout-ms", "10000")  # fmt: skip
    try:
        x = _rows(6, n=1)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/models/demo:predict", json.dumps({"instances": x.tolist()}).encode())
        wait_for(lambda: server.status()["estimax"]["requests_in_flight"] == 1, "the request to wait in the batcher")
        publish(staged[1], base, 2)
        wait_for(lambda: server.states() == {2: "AVAILABLE", 1: "UNLOADING"}, "version 1 unloading")
        response = conn.getresponse()
        answer = json.loads(response.read())
        conn.close()
        assert (response.status, response.getheader(VERSION_HEADER)) == (200, "1")
        assert _close(answer["predictions"], serving.load(staged[0])(x))
        wait_for(lambda: server.states() == {2: "AVAILABLE", 1: "END"}, "version 1 unloaded")
    finally:
        server.stop()


def test_a_version_removed_from_the_base_is_unloaded_unless_it_is_the_last(staged, base, tmp_path):
    publish(staged[0], base, 1)
    publish(staged[1], base, 2)
    x = _rows(3)
    server = Server(base, tmp_path, "--poll-seconds", "0.05", "--no-calibration", "--max-batch-size", "2")
    try:
        assert server.states() == {2: "AVAILABLE"} and server.predict(x)[2] == "2"
        shutil.rmtree(os.path.join(base, "2"))
        wait_for(lambda: server.states() == {1: "AVAILABLE"}, "version 2 unloaded and forgotten, 1 loaded")
        status, answer, version = server.predict(x)
        assert (status, version) == (200, "1") and _close(answer["predictions"], serving.load(staged[0])(x))
        shutil.rmtree(os.path.join(base, "1"))  # the only one: it keeps serving
        server.wait_polls(5)
        assert server.states() == {1: "AVAILABLE"} and server.predict(x)[2] == "1"
    finally:
        server.stop()


def test_an_empty_base_is_waited_on_until_its_first_version(staged, base, tmp_path):
    def first_version_arrives(server):
        wait_for(lambda: "Waiting for a first complete version" in server.stderr(), "the server to wait")
        assert not server._answers()  # the port opens once a version is AVAILABLE
        publish(staged[2], base, 7)

    server = Server(base, tmp_path, "--poll-seconds", "0.05", "--no-calibration", "--max-batch-size", "2",
                    before_ready=first_version_arrives)  # fmt: skip
    try:
        x = _rows(4)
        status, answer, version = server.predict(x)
        assert (status, version) == (200, "7") and _close(answer["predictions"], serving.load(staged[2])(x))
    finally:
        server.stop()


@pytest.mark.parametrize("store", ["gcs", "s3"])
def test_a_base_in_a_bucket(staged, tmp_path, request, store):
    request.getfixturevalue(store)
    base = f"{'gs' if store == 'gcs' else 's3'}://bkt/bases-{uuid.uuid4().hex[:8]}/demo"
    publish(staged[0], base, 1)
    x = _rows(5)
    server = Server(base, tmp_path, "--poll-seconds", "0.1", "--no-calibration", "--max-batch-size", "2")
    try:
        assert server.predict(x)[2] == "1"
        artifact = storage.join(base, "3")  # an upload cut off before signature.json: never served
        storage.upload(os.path.join(staged[2], "params"), storage.join(artifact, "params"))
        publish(staged[1], base, 2)
        wait_for(lambda: server.predict(x)[2] == "2", "version 2 from the bucket")
        status, answer, _ = server.predict(x)
        assert status == 200 and _close(answer["predictions"], serving.load(staged[1])(x))
        server.wait_polls(3)
        assert server.states() == {2: "AVAILABLE", 1: "END"}
    finally:
        server.stop()
