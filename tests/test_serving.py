"""``estimax serve``: a real server process on 127.0.0.1 called over real HTTP (TF Serving's REST API)."""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import user_env

import estimax as ex
from estimax import serving
from estimax.state import leaf_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs the CLI, then reports whether Flax was ever imported by `estimax serve`.
SERVE = (
    "import sys; from estimax import cli; rc = cli.main(sys.argv[1:]); "
    "print('flax', 'flax' in sys.modules); sys.exit(rc)"
)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.dense(x))


def model_fn(model, features, labels, mode, params):
    logits = model(features["x"] * features["scale"][:, None])
    return ex.Spec(predictions={"logits": logits, "class": logits.argmax(-1)})


def single_model_fn(model, features, labels, mode, params):
    return ex.Spec(predictions=model(features))


def _export(tmp_path_factory, fn, example) -> str:
    est = ex.Estimator(lambda rngs, params: Net(rngs), fn, optax.sgd(0.1))
    return est.export(str(tmp_path_factory.mktemp("serving") / "demo"), example_features=example)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return _export(tmp_path_factory, model_fn, {"x": np.zeros((1, 4), np.float32), "scale": np.ones(1, np.float32)})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, path, *options):
        self.port = _free_port()
        env = user_env("PYTHONPATH")
        env["PYTHONPATH"] = ROOT
        command = [sys.executable, "-c", SERVE, "serve", path, "--port", str(self.port), *options]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                if self.request("GET", "/v1/models/demo")[0] == 200:
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"server did not start: {self.process.communicate()}")
            time.sleep(0.2)

    def request(self, method, path, body=None, timeout=60):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def predict(self, body):
        return self.request("POST", "/v1/models/demo:predict", body)

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        out, err = self.process.communicate(timeout=60)
        return self.process.returncode, out, err


@pytest.fixture(scope="module")
def server(artifact):
    server = Server(artifact, "--max-body-mb", "0.5")
    yield server
    server.stop()


def _inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 4)).astype(np.float32), "scale": rng.uniform(1, 2, size=n).astype(np.float32)}


def test_row_format(server, artifact):
    inputs = _inputs(5)
    expected = serving.load(artifact)(inputs)
    instances = [{"x": inputs["x"][i].tolist(), "scale": float(inputs["scale"][i])} for i in range(5)]
    status, answer = server.predict({"instances": instances})
    assert status == 200 and len(answer["predictions"]) == 5 and set(answer["predictions"][0]) == {"logits", "class"}
    np.testing.assert_allclose([p["logits"] for p in answer["predictions"]], expected["logits"], rtol=1e-5, atol=1e-6)
    assert [p["class"] for p in answer["predictions"]] == expected["class"].tolist()
    assert server.predict({"instances": []}) == (200, {"predictions": []})


def test_columnar_format(server, artifact):
    inputs = _inputs(3, seed=1)
    expected = serving.load(artifact)(inputs)
    status, answer = server.predict({"inputs": {k: v.tolist() for k, v in inputs.items()}})
    assert status == 200 and set(answer) == {"outputs"}
    np.testing.assert_allclose(answer["outputs"]["logits"], expected["logits"], rtol=1e-5, atol=1e-6)
    assert answer["outputs"]["class"] == expected["class"].tolist()


def test_status_and_metadata(server):
    assert server.request("GET", "/v1/models/demo") == (
        200,
        {
            "model_version_status": [
                {"version": "0", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}
            ],
            "estimax": {"requests_in_flight": 0},
        },
    )
    status, metadata = server.request("GET", "/v1/models/demo/metadata")
    signature = metadata["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert status == 200 and metadata["model_spec"]["version"] == "0"
    assert signature["inputs"]["x"] == {
        "dtype": "DT_FLOAT",
        "tensor_shape": {"dim": [{"size": "-1"}, {"size": "4"}]},
        "name": "x",
    }
    assert server.request("GET", "/v1/models/demo/versions/0")[0] == 200


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b'{"instances": [', 400, r"Malformed JSON body"),
        ({"instances": [{"x": [1, 2, 3, 4], "scales": 1.0}]}, 400, r"instances\[0\] has features \['scales', 'x'\]"),
        ({"inputs": {"x": [[1, 2, 3]], "scale": [1.0]}}, 400, r"Feature 'x' has shape \(1, 3\); the signature says"),
        ({"inputs": {"x": [[1, 2], [3]], "scale": [1.0, 2.0]}}, 400, r"Feature 'x' is not a rectangular array"),
        ({"inputs": {"x": [[1.5, 2, 3, 4]], "scale": ["a"]}}, 400, r"Feature 'scale' has dtype <U1"),
        ({"instances": [[1, 2, 3, 4]]}, 400, r"'instances' holds values; this model takes \['scale', 'x'\]"),
        ({"examples": []}, 400, r"exactly one of 'instances' and 'inputs'"),
        (b"[" + b"0," * 400_000 + b"0]", 413, r"Request body of 800003 bytes; expected at most 524288.*Fix:"),
    ],
    ids=[
        "malformed-json",
        "wrong-feature",
        "wrong-shape",
        "ragged",
        "wrong-dtype",
        "values-for-two-inputs",
        "no-instances",
        "too-large",
    ],
)
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, body, status, message):
    answer = server.predict(body)
    assert answer[0] == status and re.search(message, answer[1]["error"]), answer
    assert server.predict({"instances": [{"x": [1, 2, 3, 4], "scale": 1}]})[0] == 200


def test_unknown_model_or_version_is_404(server):
    assert server.request("POST", "/v1/models/other:predict", {"instances": []})[0] == 404
    assert server.request("GET", "/v1/models/demo/versions/7")[0] == 404


def test_concurrent_requests_are_each_answered_with_their_own_rows(server, artifact):
    model = serving.load(artifact)
    answers, expected = {}, {}

    def client(i):
        inputs = _inputs(1 + i % 5, seed=100 + i)
        expected[i] = model(inputs)["logits"]
        answers[i] = server.predict({"inputs": {k: v.tolist() for k, v in inputs.items()}})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(24):
        assert answers[i][0] == 200
        np.testing.assert_allclose(answers[i][1]["outputs"]["logits"], expected[i], rtol=1e-5, atol=1e-6)


def test_one_input_one_output_rows_are_plain_values(tmp_path_factory):
    path = _export(tmp_path_factory, single_model_fn, np.zeros((1, 4), np.float32))
    server = Server(path)
    try:
        x = _inputs(2)["x"]
        status, answer = server.predict({"instances": x.tolist()})
        assert status == 200
        np.testing.assert_allclose(answer["predictions"], serving.load(path)(x), rtol=1e-5, atol=1e-6)
        status, answer = server.predict({"inputs": x.tolist()})
        np.testing.assert_allclose(answer["outputs"], serving.load(path)(x), rtol=1e-5, atol=1e-6)
    finally:
        assert server.stop()[0] == 0


def test_sigterm_answers_the_requests_in_flight_and_exits_0(artifact):
    # A long batching wait keeps every request in flight when the signal arrives.
    server = Server(artifact, "--batch-timeout-ms", "3000", "--max-batch-size", "1000", "--no-calibration")
    connections = []
    for i in range(6):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = json.dumps({"inputs": {k: v.tolist() for k, v in _inputs(2, seed=i).items()}})
        conn.request("POST", "/v1/models/demo:predict", body=body, headers={"Content-Type": "application/json"})
        connections.append(conn)
    while server.request("GET", "/v1/models/demo")[1]["estimax"]["requests_in_flight"] < 6:
        time.sleep(0.01)  # until the server has read them all (they wait in the batcher); not a spin on its cores
    server.process.send_signal(signal.SIGTERM)
    for conn in connections:
        response = conn.getresponse()
        assert response.status == 200 and len(json.loads(response.read())["outputs"]["class"]) == 2
        conn.close()
    out, err = server.process.communicate(timeout=60)
    assert server.process.returncode == 0, err
    assert "answering the requests in flight" in err and "Stopped." in err
    assert "flax False" in out  # estimax serve never imported Flax
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2)


def test_lora_adapters_are_served_on_their_base_artifact(tmp_path):
    """An adapters-only export served on a base moved away from its recorded path: refused without
    --base-artifact (one line, exit 2), answered with it, without importing Flax."""
    from models import blobs, estimator

    features = blobs(8, seed=3)[0]
    plain = estimator(None)
    params = jax.device_get(plain.state().params)
    np.savez(tmp_path / "base.npz", **dict(zip(leaf_names(params), jax.tree.leaves(params), strict=True)))
    with pytest.warns(ex.UntrainedWarning):  # the initial parameters: the base
        base = plain.export(str(tmp_path / "base"), example_features=features)
    lora = ex.LoRA(layers=["l1", "l2"], rank=4, alpha=8)
    est = estimator(None, optimizer=optax.adam(1e-2), lora=lora, warm_start=ex.WarmStart(str(tmp_path / "base.npz")))
    est.train(ex.data.from_arrays(*blobs(128)), max_steps=4)
    path = est.export(str(tmp_path / "demo"), example_features=features, base_artifact=base)
    moved = str(tmp_path / "moved-base")
    os.rename(base, moved)
    env = {**os.environ, "PYTHONPATH": ROOT}
    result = subprocess.run(
        [sys.executable, "-m", "estimax.cli", "serve", path], capture_output=True, text=True, env=env
    )  # fmt: skip
    assert result.returncode == 2 and "whose base artifact is not at" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    server = Server(path, "--base-artifact", moved, "--no-calibration")
    try:
        status, answer = server.predict({"inputs": {"x": features["x"].tolist()}})
        expected = serving.load(path, base_artifact=moved)(features)["logits"]
        assert status == 200
        np.testing.assert_allclose(answer["outputs"]["logits"], expected, rtol=1e-5, atol=1e-6)
    finally:
        returncode, out, _ = server.stop()
    assert returncode == 0 and "flax False" in out  # estimax serve never imported Flax


def test_missing_artifact_is_a_clear_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    result = subprocess.run(
        [sys.executable, "-m", "estimax.cli", "serve", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 2 and "is not a directory; expected the directory written by" in result.stderr


def test_without_aiohttp_the_extra_is_named(artifact):
    blocked = "import sys; sys.modules['aiohttp'] = None; from estimax import cli; sys.exit(cli.main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-c", blocked, "serve", artifact], capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "pip install 'estimax[serve]'" in result.stderr


def test_nan_and_inf_in_answers_are_valid_json(server):
    def strict(constant):
        raise AssertionError(f"not JSON: {constant}")

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"instances": [{"x": [1e38, -1e38, 0, 0], "scale": 1e38}, {"x": [1, 2, 3, 4], "scale": 1}]}
    conn.request("POST", "/v1/models/demo:predict", json.dumps(body).encode(), {"Content-Type": "application/json"})
    response = conn.getresponse()
    answer = json.loads(response.read(), parse_constant=strict)  # NaN, Infinity as bare words would fail here
    conn.close()
    assert response.status == 200
    first = answer["predictions"][0]["logits"]
    assert any(v in ("NaN", "Infinity", "-Infinity") for v in first), first
    assert all(isinstance(v, float) for v in answer["predictions"][1]["logits"])


def test_serve_on_a_busy_port_is_one_line(artifact):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": ROOT}
        command = [sys.executable, "-m", "estimax.cli", "serve", artifact, "--host", "127.0.0.1", "--port", str(port)]
        result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"estimax serve --host 127.0.0.1 --port {port}: cannot listen there" in result.stderr
    assert "Fix: stop the process that listens on it, or pass another --port." in result.stderr
