"""``estimax serve``: TF Serving's REST predict API over an exported model or an export base.

Owns HTTP (on aiohttp, the ``estimax[serve]`` extra): the command's options,
the routes under ``/v1/models/NAME`` (``:predict``, the status and metadata,
``/versions/N``), HTTP 400/404/413 for bad requests, and draining the requests
in flight on SIGTERM. The JSON formats are ``rest.py``'s, batching is
``batching.py``'s, which version answers (and following an export base) is
``versions.py``'s, loading and validating inputs ``artifact.py``'s; this module
never imports Flax.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import logging
import re
import signal
import sys

from estimax import storage
from estimax.errors import ConfigError
from estimax.serving import versions as versions_
from estimax.serving.rest import BodyTooLarge, dumps, format_response, parse_request, signature_def

logger = logging.getLogger("estimax.server")

DEFAULT_PORT = 8501
DEFAULT_MAX_BATCH = 64
DEFAULT_BATCH_TIMEOUT_MS = 0.0
DEFAULT_MAX_BODY_MB = 64
DEFAULT_POLL_SECONDS = 1.0  # TF Serving's --file_system_poll_wait_seconds
DRAIN_SECONDS = 30.0
VERSION_HEADER = "Estimax-Model-Version"  # which version answered a predict request
_ROUTE = re.compile(r"^(?P<name>[^/:]+)(?:/versions/(?P<version>\d+))?(?::(?P<verb>[a-z]+)|/(?P<metadata>metadata))?$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``estimax serve``."""
    parser.add_argument(
        "path",
        help="an exported model directory (estimax export --output PATH), or an export base: a directory whose "
        "integer-named subdirectories are exported versions (BASE/<step>/), followed as new ones appear",
    )
    parser.add_argument(
        "--base-artifact",
        metavar="DIR",
        help="an adapters-only export (estimax export --base-artifact): where its base export is now (default: "
        "the path recorded at export, then the same place relative to PATH)",
    )
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
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=DEFAULT_POLL_SECONDS,
        help=f"an export base: how often to look for new versions (default: {DEFAULT_POLL_SECONDS:g})",
    )
    parser.add_argument(
        "--num-versions",
        type=int,
        default=1,
        help="an export base: how many of its newest versions to hold, each at /versions/N (default: 1; "
        "2 keeps the previous one loaded beside the newest)",
    )


@dataclasses.dataclass(frozen=True)
class Options:
    """What ``serve`` needs beyond the versions: where to listen and how large a request may be."""

    name: str
    host: str
    port: int
    max_body: int  # bytes
    poll_seconds: float  # an export base: how often it is listed
    num_versions: int  # an export base: how many of its newest versions are held


def main(args: argparse.Namespace) -> int:
    """Runs ``estimax serve`` until SIGTERM or SIGINT; returns the exit status."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("estimax serve needs aiohttp, which is not installed. Fix: pip install 'estimax[serve]'", file=sys.stderr)
        return 2
    if (
        args.max_batch_size < 1
        or args.batch_timeout_ms < 0
        or args.max_body_mb <= 0
        or args.poll_seconds <= 0
        or args.num_versions < 1
    ):
        print(
            f"estimax serve: --max-batch-size {args.max_batch_size}, --batch-timeout-ms {args.batch_timeout_ms}, "
            f"--max-body-mb {args.max_body_mb}, --poll-seconds {args.poll_seconds}, --num-versions "
            f"{args.num_versions}; expected >= 1, >= 0, > 0, > 0 and >= 1.",
            file=sys.stderr,
        )
        return 2
    from estimax import compile_cache

    # A restart, and a new version of the same model (its weights are arguments, not constants), do not compile again.
    compile_cache.enable(compile_cache.default_directory())
    path = storage.resolve(args.path)
    batching = versions_.Batching(
        1 if args.no_batching else args.max_batch_size, args.batch_timeout_ms / 1e3, not args.no_calibration
    )
    max_body = int(args.max_body_mb * 2**20)
    name = args.name or default_name(path)
    options = Options(name, args.host, args.port, max_body, args.poll_seconds, args.num_versions)
    if versions_.is_base(path):
        if args.base_artifact:
            print(
                f"estimax serve {path} --base-artifact {args.base_artifact}: PATH is an export base; expected "
                "one adapters-only export with --base-artifact (a base's versions find their base themselves).",
                file=sys.stderr,
            )
            return 2
        asyncio.run(serve(path, None, batching, options))
        return 0
    from estimax.serving import artifact
    from estimax.serving.batching import calibrate

    try:
        model = artifact.load(path, args.base_artifact)
    except ValueError as error:
        print(f"estimax serve: {error}", file=sys.stderr)
        return 2
    if batching.calibrate:
        batching = dataclasses.replace(batching, max_batch=calibrate(model, batching.max_batch), calibrate=False)
    asyncio.run(serve(path, model, batching, options))
    return 0


def default_name(path: str) -> str:
    """The directory's name; its parent's when it is a step number (exports/digits/400 -> digits)."""
    path = storage.resolve(path)
    return storage.name(storage.parent(path)) if storage.name(path).isdigit() else storage.name(path)


async def serve(path: str, model, batching: versions_.Batching, options: Options) -> None:
    """Serves ``model``, the artifact at ``path``; or, when ``model`` is None, follows the export base ``path``."""
    from aiohttp import web

    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="estimax-predict")
    versions = versions_.Versions(None if model is not None else path, batching, executor, options.num_versions)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    following = None
    if model is not None:
        versions.hold(model.step, path, model)
    else:
        following = asyncio.create_task(versions.follow(options.poll_seconds))
        if not await _first_version(versions, stop, path):
            await _close(following, versions, executor)
            return
    app = web.Application(client_max_size=options.max_body)
    handler = Handler(versions, options.name, options.max_body, path if model is None else None)
    app.router.add_route("*", "/v1/models/{route:.*}", handler.route)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=DRAIN_SECONDS)
    await runner.setup()
    try:
        await web.TCPSite(runner, options.host, options.port).start()
    except OSError as error:
        await runner.cleanup()
        await _close(following, versions, executor)
        raise ConfigError(
            f"estimax serve --host {options.host} --port {options.port}: cannot listen there "
            f"({error.strerror or error}); expected a free port. Fix: stop the process that listens on it, or "
            "pass another --port."
        ) from None
    what = f"step {model.step}" if model is not None else f"version {versions.pick().number}, following {path}"
    print(
        f"Serving {options.name} ({what}) at http://{options.host}:{options.port}/v1/models/{options.name}:predict; "
        f"up to {versions.max_batch} rows per call, waiting up to {batching.max_wait * 1e3:g} ms for more",
        file=sys.stderr,
        flush=True,
    )
    await stop.wait()
    print("Stopping: no new connections; answering the requests in flight.", file=sys.stderr, flush=True)
    await runner.cleanup()  # closes the listener, then waits for every request being handled
    await _close(following, versions, executor)
    print("Stopped.", file=sys.stderr, flush=True)


async def _first_version(versions: versions_.Versions, stop: asyncio.Event, base: str) -> bool:
    """Waits until a version of the base is AVAILABLE (True) or a signal came first (False)."""
    available = asyncio.create_task(versions.wait_available())
    signalled = asyncio.create_task(stop.wait())
    said = False
    while True:
        done, _ = await asyncio.wait([available, signalled], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        if done:
            break
        loading = any(v.state in (versions_.START, versions_.LOADING) for v in versions.table.values())
        if versions.polls and not loading and not said:
            print(f"Waiting for a first complete version under {base} (BASE/<step>/signature.json)", file=sys.stderr)
            said = True
    for task in (available, signalled):
        task.cancel()
    return available in done


async def _close(following, versions: versions_.Versions, executor) -> None:
    if following is not None:
        following.cancel()
    await versions.close()
    executor.shutdown()


class Handler:
    """The endpoints under ``/v1/models/``."""

    def __init__(self, versions: versions_.Versions, name: str, max_body: int, base: str | None):
        self.versions, self.name, self.max_body, self.base = versions, name, max_body, base

    async def route(self, request):
        from aiohttp import web

        match = _ROUTE.match(request.match_info["route"])
        if match is None or match["name"] != self.name:
            return _error(404, f"No model at {request.path}; this server serves /v1/models/{self.name}.")
        number = None if match["version"] is None else int(match["version"])
        verb = match["verb"]
        if verb is None:
            if request.method != "GET":
                return _error(405, f"{request.method} {request.path}: expected GET.")
            if match["metadata"]:
                version = self.versions.pick(number)
                return web.json_response(self.metadata(version)) if version else self._no_version(number)
            statuses = self.versions.statuses(number)
            return web.json_response(self.status(statuses)) if statuses else self._no_version(number)
        if verb != "predict":
            return _error(404, f"{request.path}: this server answers :predict only (not :{verb}).")
        if request.method != "POST":
            return _error(405, f"{request.method} {request.path}: expected POST with a JSON body.")
        return await self.predict(request, number)

    async def predict(self, request, number: int | None):
        from aiohttp import web

        try:
            body = await self._body(request)
        except BodyTooLarge as error:
            return _error(413, str(error))
        version = self.versions.pick(number)  # picked and entered at once: it cannot unload in between
        if version is None:
            return self._no_version(number)
        version.enter()
        try:
            model = version.model
            try:
                features, rows = parse_request(body, model)
                prepared = model.prepare(features)
            except (ValueError, TypeError) as error:
                return _error(400, str(error))
            try:
                outputs = await version.batcher.predict(prepared)
            except Exception as error:  # the program failed: the server keeps serving
                logger.exception("Prediction failed")
                return _error(500, f"Prediction failed: {type(error).__name__}: {error}")
        finally:
            version.leave()
        headers = {VERSION_HEADER: str(version.number)}
        return web.json_response(format_response(outputs, model, rows), dumps=dumps, headers=headers)

    def _no_version(self, number: int | None):
        held = [v["version"] for v in self.versions.statuses() if v["state"] == versions_.AVAILABLE]
        received = "no version" if number is None else f"version {number}"
        return _error(404, f"Model {self.name} has versions {held} available; received {received}.")

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

    def status(self, statuses: list[dict]) -> dict:
        """TF Serving's status answer, with the requests estimax is working on (and the base) alongside."""
        extra = {"requests_in_flight": self.versions.in_flight()}
        if self.base is not None:
            extra.update(base=self.base, polls=self.versions.polls)
        return {"model_version_status": statuses, "estimax": extra}

    def metadata(self, version) -> dict:
        """TF Serving's metadata answer, with estimax's signature.json alongside."""
        signature = version.model.signature
        return {
            "model_spec": {"name": self.name, "signature_name": "", "version": str(version.number)},
            "metadata": {"signature_def": signature_def(signature), "estimax_signature": signature},
        }


def _error(status: int, message: str):
    from aiohttp import web

    return web.json_response({"error": message}, status=status)
