"""``estimax serve``: TF Serving's REST predict API over an exported model.

Owns HTTP (on aiohttp, the ``estimax[serve]`` extra): the request and response
formats of TF Serving (``{"instances": [...]}`` rows or ``{"inputs": {...}}``
columns in, ``{"predictions": ...}`` or ``{"outputs": ...}`` out), the status
and metadata endpoints, dynamic batching of concurrent requests, HTTP 400
for bad requests, and draining in-flight requests on SIGTERM. Loading and
validating inputs is ``artifact.py``'s; this module never imports Flax.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import logging
import math
import re
import signal
import sys
import time
from typing import TYPE_CHECKING

from estimax import storage
from estimax.errors import ConfigError

if TYPE_CHECKING:  # numpy is imported only to serve: `estimax --help` stays light
    import numpy as np

logger = logging.getLogger("estimax.server")

DEFAULT_PORT = 8501
DEFAULT_MAX_BATCH = 64
DEFAULT_BATCH_TIMEOUT_MS = 0.0
CALIBRATION_REPEATS = 3
DEFAULT_MAX_BODY_MB = 64
DRAIN_SECONDS = 30.0
SIGNATURE_NAME = "serving_default"
_TF_DTYPES = {"float32": "DT_FLOAT", "float64": "DT_DOUBLE", "float16": "DT_HALF"}  # the others match TF's names
_ROUTE = re.compile(r"^(?P<name>[^/:]+)(?:/versions/(?P<version>\d+))?(?::(?P<verb>[a-z]+)|/(?P<metadata>metadata))?$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``estimax serve``."""
    parser.add_argument("path", help="an exported model directory (estimax export --output PATH)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default: {DEFAULT_PORT}")
    parser.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (0.0.0.0: every interface)")
    parser.add_argument("--name", help="the model name in /v1/models/NAME (default: the directory's name)")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help=f"dynamic batching: most rows joined into one call (default: {DEFAULT_MAX_BATCH})",
    )
    parser.add_argument(
        "--batch-timeout-ms",
        type=float,
        default=DEFAULT_BATCH_TIMEOUT_MS,
        help="dynamic batching: longest wait for more requests when the model is idle (default: 0, join "
        "only the requests that arrived while the previous batch ran)",
    )
    parser.add_argument(
        "--no-calibration",
        action="store_true",
        help="keep --max-batch-size as given (default: lower it to the batch size with the best rows/s on "
        "this machine, timed at startup)",
    )
    parser.add_argument("--no-batching", action="store_true", help="run every request on its own")
    parser.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_MB,
        help=f"largest request (default: {DEFAULT_MAX_BODY_MB})",
    )


def main(args: argparse.Namespace) -> int:
    """Runs ``estimax serve`` until SIGTERM or SIGINT; returns the exit status."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("estimax serve needs aiohttp, which is not installed. Fix: pip install 'estimax[serve]'", file=sys.stderr)
        return 2
    if args.max_batch_size < 1 or args.batch_timeout_ms < 0 or args.max_body_mb <= 0:
        print(
            f"estimax serve: --max-batch-size {args.max_batch_size}, --batch-timeout-ms {args.batch_timeout_ms}, "
            f"--max-body-mb {args.max_body_mb}; expected >= 1, >= 0 and > 0.",
            file=sys.stderr,
        )
        return 2
    from estimax.serving import artifact

    try:
        model = artifact.load(args.path)
    except ValueError as error:
        print(f"estimax serve: {error}", file=sys.stderr)
        return 2
    name = args.name or default_name(args.path)
    max_batch = 1 if args.no_batching else args.max_batch_size
    max_batch = max_batch if args.no_calibration else calibrate(model, max_batch)
    asyncio.run(serve(model, name, args.host, args.port, max_batch, args.batch_timeout_ms / 1e3, args.max_body_mb))
    return 0


def default_name(path: str) -> str:
    """The directory's name; its parent's when it is a step number (exports/digits/400 -> digits)."""
    path = storage.resolve(path)
    return storage.name(storage.parent(path)) if storage.name(path).isdigit() else storage.name(path)


async def serve(model, name: str, host: str, port: int, max_batch: int, max_wait: float, max_body_mb: float) -> None:
    from aiohttp import web

    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="estimax-predict")
    batcher = Batcher(model, max_batch, max_wait, executor)
    batching = asyncio.create_task(batcher.run())
    max_body = int(max_body_mb * 2**20)
    app = web.Application(client_max_size=max_body)
    app.router.add_route("*", "/v1/models/{route:.*}", Handler(model, name, batcher, max_body).route)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=DRAIN_SECONDS)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as error:
        await runner.cleanup()
        batching.cancel()
        executor.shutdown()
        raise ConfigError(
            f"estimax serve --host {host} --port {port}: cannot listen there ({error.strerror or error}); expected "
            "a free port. Fix: stop the process that listens on it, or pass another --port."
        ) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"Serving {name} (step {model.step}) at http://{host}:{port}/v1/models/{name}:predict; "
        f"up to {max_batch} rows per call, waiting up to {max_wait * 1e3:g} ms for more",
        file=sys.stderr,
        flush=True,
    )
    await stop.wait()
    print("Stopping: no new connections; answering the requests in flight.", file=sys.stderr, flush=True)
    await runner.cleanup()  # closes the listener, then waits for every request being handled
    batching.cancel()
    executor.shutdown()
    print("Stopped.", file=sys.stderr, flush=True)


def calibrate(model, max_batch: int) -> int:
    """The batch size up to ``max_batch`` (powers of two) with the most rows per second here.

    Compiles every size the batcher can use before the port opens, so no
    request waits for a compilation. Larger batches are not always faster
    per row: on CPUs, convolutions can cost more per row at batch 64 than at 1.
    """
    best, best_rate, size = 1, 0.0, 1
    while True:
        batch = {k: _empty(size, s) for k, s in model.inputs.items()}
        model.run(batch)  # compiles
        seconds = []
        for _ in range(CALIBRATION_REPEATS):
            start = time.perf_counter()
            model.run(batch)
            seconds.append(time.perf_counter() - start)
        rate = size / min(seconds)
        if rate > best_rate * 1.1:  # a larger batch must be clearly faster: it costs latency
            best, best_rate = size, rate
        if size >= max_batch:
            break
        size = min(size * 2, max_batch)
    print(f"Calibrated batch sizes 1 to {max_batch}: {best} rows per call ({best_rate:.0f} rows/s)", file=sys.stderr)
    return best


class RequestError(ValueError):
    """A request the server cannot answer: HTTP 400 with this message."""


class BodyTooLarge(RequestError):
    """A request body beyond ``--max-body-mb``: HTTP 413, read no further."""


class Handler:
    """The endpoints under ``/v1/models/``."""

    def __init__(self, model, name: str, batcher: Batcher, max_body: int):
        self.model, self.name, self.batcher, self.max_body = model, name, batcher, max_body
        self.in_flight = 0  # predict requests received and not yet answered

    async def route(self, request):
        from aiohttp import web

        match = _ROUTE.match(request.match_info["route"])
        if match is None or match["name"] != self.name:
            return _error(404, f"No model at {request.path}; this server serves /v1/models/{self.name}.")
        version, verb = match["version"], match["verb"]
        if version is not None and int(version) != self.model.step:
            return _error(404, f"Model {self.name} has version {self.model.step} only; received version {version}.")
        if verb is None:
            if request.method != "GET":
                return _error(405, f"{request.method} {request.path}: expected GET.")
            return web.json_response(self.metadata() if match["metadata"] else self.status())
        if verb != "predict":
            return _error(404, f"{request.path}: this server answers :predict only (not :{verb}).")
        if request.method != "POST":
            return _error(405, f"{request.method} {request.path}: expected POST with a JSON body.")
        return await self.predict(request)

    async def predict(self, request):
        from aiohttp import web

        try:
            features, rows = parse_request(await self._body(request), self.model)
            prepared = self.model.prepare(features)
        except BodyTooLarge as error:
            return _error(413, str(error))
        except (ValueError, TypeError) as error:
            return _error(400, str(error))
        self.in_flight += 1
        try:
            outputs = await self.batcher.predict(prepared)
        except Exception as error:  # the program failed: the server keeps serving
            logger.exception("Prediction failed")
            return _error(500, f"Prediction failed: {type(error).__name__}: {error}")
        finally:
            self.in_flight -= 1
        return web.json_response(format_response(outputs, self.model, rows), dumps=_dumps)

    async def _body(self, request) -> bytes:
        from aiohttp import web

        if request.content_length is not None and request.content_length > self.max_body:
            raise BodyTooLarge(
                f"Request body of {request.content_length} bytes; expected at most {self.max_body} "
                "(--max-body-mb). Fix: send fewer rows per request."
            )
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge(
                f"Request body larger than {self.max_body} bytes; expected at most that (--max-body-mb). "
                "Fix: send fewer rows per request."
            ) from None

    def status(self) -> dict:
        """TF Serving's status answer, with the requests estimax is working on alongside."""
        return {
            "model_version_status": [
                {
                    "version": str(self.model.step),
                    "state": "AVAILABLE",
                    "status": {"error_code": "OK", "error_message": ""},
                }
            ],
            "estimax": {"requests_in_flight": self.in_flight},
        }

    def metadata(self) -> dict:
        """TF Serving's metadata answer, with estimax's signature.json alongside."""

        def tensors(entries):
            return {
                k: {
                    "dtype": _TF_DTYPES.get(v["dtype"], "DT_" + v["dtype"].upper()),
                    "tensor_shape": {"dim": [{"size": str(d if isinstance(d, int) else -1)} for d in v["shape"]]},
                    "name": k,
                }
                for k, v in entries.items()
            }

        signature = self.model.signature
        return {
            "model_spec": {"name": self.name, "signature_name": "", "version": str(self.model.step)},
            "metadata": {
                "signature_def": {
                    "signature_def": {
                        SIGNATURE_NAME: {
                            "inputs": tensors(signature["inputs"]),
                            "outputs": tensors(signature["outputs"]),
                            "method_name": "tensorflow/serving/predict",
                        }
                    }
                },
                "estimax_signature": signature,
            },
        }


def parse_request(body: bytes, model) -> tuple[dict, bool]:
    """``(features, row_format)`` of a TF Serving predict request; raises RequestError."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(
            f'Malformed JSON body ({error}); expected {{"instances": [...]}} or {{"inputs": ...}}.'
        ) from None
    if not isinstance(request, dict) or ("instances" in request) == ("inputs" in request):
        keys = sorted(request) if isinstance(request, dict) else type(request).__name__
        raise RequestError(f"Request has {keys}; expected a JSON object with exactly one of 'instances' and 'inputs'.")
    extra = sorted(set(request) - {"instances", "inputs", "signature_name"})
    if extra:
        raise RequestError(
            f"Request has unknown keys {extra}; expected 'instances' or 'inputs' (and 'signature_name')."
        )
    if request.get("signature_name", SIGNATURE_NAME) not in (SIGNATURE_NAME, ""):
        raise RequestError(f"signature_name {request['signature_name']!r}; this model has {SIGNATURE_NAME!r} only.")
    names = list(model.inputs)
    if "inputs" in request:
        inputs = request["inputs"]
        if not isinstance(inputs, dict) or (len(names) == 1 and names[0] not in inputs):
            if len(names) != 1:
                raise RequestError(f"'inputs' is {type(inputs).__name__}; expected an object with {names}.")
            inputs = {names[0]: inputs}
        return inputs, False
    instances = request["instances"]
    if not isinstance(instances, list):
        raise RequestError(f"'instances' is {type(instances).__name__}; expected a list, one entry per example.")
    if not instances:
        return {k: _empty(0, s) for k, s in model.inputs.items()}, True
    if not all(isinstance(row, dict) for row in instances):
        if len(names) != 1:
            raise RequestError(f"'instances' holds values; this model takes {names}: expected one object per example.")
        return {names[0]: instances}, True
    for i, row in enumerate(instances):
        if set(row) != set(names):
            raise RequestError(f"instances[{i}] has features {sorted(row)}; expected {sorted(names)}.")
    return {k: [row[k] for row in instances] for k in names}, True


def format_response(outputs: dict[str, np.ndarray], model, rows: bool) -> dict:
    """TF Serving's answer: ``predictions`` as rows, or ``outputs`` as columns."""
    single = model.signature["single_output"]
    if not rows:
        return {"outputs": model.unwrap(outputs).tolist() if single else {k: v.tolist() for k, v in outputs.items()}}
    if single:
        return {"predictions": model.unwrap(outputs).tolist()}
    lists = {k: v.tolist() for k, v in outputs.items()}
    count = len(next(iter(lists.values())))
    return {"predictions": [{k: v[i] for k, v in lists.items()} for i in range(count)]}


class Batcher:
    """Dynamic batching: requests waiting while the model runs are joined into one call.

    A call takes up to ``max_batch`` rows; when fewer are waiting it waits up
    to ``max_wait`` seconds for more. The joined batch is padded to a power of
    two rows (or ``max_batch``), the sizes ``calibrate`` compiled.
    """

    def __init__(self, model, max_batch: int, max_wait: float, executor):
        self.model, self.max_batch, self.max_wait, self.executor = model, max_batch, max_wait, executor
        self._waiting: collections.deque = collections.deque()
        self._arrived = asyncio.Event()

    async def predict(self, prepared: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((prepared, _rows(prepared), future))
        self._arrived.set()
        return await future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            batch = [self._waiting.popleft()]
            rows, deadline = batch[0][1], time.monotonic() + self.max_wait
            while rows < self.max_batch:
                if not self._waiting:
                    if self.max_batch == 1 or time.monotonic() >= deadline:
                        break
                    self._arrived.clear()
                    try:
                        await asyncio.wait_for(self._arrived.wait(), deadline - time.monotonic())
                    except TimeoutError:
                        break
                    continue
                if rows + self._waiting[0][1] > self.max_batch:
                    break
                item = self._waiting.popleft()
                batch.append(item)
                rows += item[1]
            try:
                outputs = await loop.run_in_executor(self.executor, self._run, [item[0] for item in batch], rows)
            except Exception as error:
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            start = 0
            for _, count, future in batch:
                if not future.done():  # a client that went away cancelled its future
                    future.set_result({k: v[start : start + count] for k, v in outputs.items()})
                start += count

    def _run(self, parts: list[dict], rows: int) -> dict[str, np.ndarray]:
        import numpy as np

        if len(parts) == 1 and (rows == 0 or self.max_batch == 1):
            return self.model.run(parts[0])
        padded = rows if rows > self.max_batch else min(1 << (rows - 1).bit_length(), self.max_batch)
        joined = {
            k: np.concatenate(
                [p[k] for p in parts] + [np.zeros((padded - rows, *parts[0][k].shape[1:]), parts[0][k].dtype)]
            )
            for k in parts[0]
        }
        return {k: v[:rows] for k, v in self.model.run(joined).items()}


def _empty(rows: int, spec):
    """Zeros of one input: ``rows`` examples of its trailing shape and dtype."""
    import numpy as np

    return np.zeros((rows, *spec.trailing), spec.dtype)


def _rows(prepared: dict) -> int:
    return len(next(iter(prepared.values())))


def _error(status: int, message: str):
    from aiohttp import web

    return web.json_response({"error": message}, status=status)


def _dumps(value) -> str:
    """Strict JSON: NaN and infinities, which JSON has no numbers for, become the strings "NaN",
    "Infinity" and "-Infinity" (as the protobuf JSON mapping writes them)."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a non-finite value somewhere: only then walk the answer
        return json.dumps(_finite(value), separators=(",", ":"), allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
