"""What more than one test module uses: the companion jobs' launchers and readers, small estimators, hooks.

Test modules import from here, never from each other (importing a test module runs its module-level setup
and ties the two together). Tiny models and data live in tests/models.py; the storage servers in
tests/stores.py; fixtures in tests/conftest.py.
"""

import contextlib
import itertools
import json
import os
import signal
import struct
import subprocess
import sys
import time

import fsspec
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import psutil
import pytest
import warm
from models import blobs, mlp, model_fn
from stores import OWNER, SESSION

import estimax as ex

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

_marks = itertools.count()
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@contextlib.contextmanager
def processes_killed_on_exit():
    """Kills, on leaving (normally or by an exception), each process started inside and what those started:
    the new descendants of this process, and any process anywhere (an orphan, a group member started in a
    session of its own) that inherited this block's mark in its environment. Servers started for the whole
    session carry the mark ``SESSION`` instead and stay, as do the warm interpreters (tests/warm.py)."""
    me, began = psutil.Process(), time.time()
    before = {p.pid for p in me.children(recursive=True)}
    mark = f"{os.getpid()}-{next(_marks)}"
    saved = os.environ.get(OWNER)
    os.environ[OWNER] = mark
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(OWNER, None)
        else:
            os.environ[OWNER] = saved
        left = {p.pid: p for p in me.children(recursive=True) if p.pid not in before}
        for p in psutil.process_iter():
            if p.pid not in left and p.pid != me.pid and _created_after(p, began) and _owner(p) == mark:
                left[p.pid] = p
        kept = warm.interpreter_pids()
        doomed = [p for p in left.values() if _owner(p) != SESSION and not _interpreter_helper(p) and p.pid not in kept]
        for p in doomed:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(doomed, timeout=30)


def _created_after(process: psutil.Process, began: float) -> bool:
    try:
        return process.create_time() >= began - 1  # create_time is rounded to clock ticks
    except psutil.Error:
        return False


def _owner(process: psutil.Process) -> str | None:
    try:
        return process.environ().get(OWNER)
    except psutil.Error:
        return None


def _interpreter_helper(process: psutil.Process) -> bool:
    """multiprocessing's resource tracker or fork server: started once, used by every later test."""
    try:
        return any("multiprocessing" in part for part in process.cmdline())
    except psutil.Error:
        return False


# tests/multihost_job.py: one job, run by 1 process on 8 devices or by a group of processes.
MULTIHOST_JOB = os.path.join(TESTS, "multihost_job.py")
MULTIHOST_STEPS = 24


def compiler_flags() -> str:
    """How the tests compile (conftest.py): this process's XLA_FLAGS without the simulated device count."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG))


def user_env(*left_out: str, **extra) -> dict[str, str]:
    """This process's environment for a child that runs as on a user's machine: its real devices and XLA's
    default flags (no XLA_FLAGS). ``left_out``: variables it does not get; ``extra``: variables set."""
    return {**{k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", *left_out)}, **extra}


CACHE_MAX_SIZE = 2**34  # a limit on the session's compilation cache: JAX then locks the folder for each entry


def shared_cache_env(directory: str) -> dict[str, str]:
    """The variables of the session's compilation cache (conftest.py) in ``directory``: JAX's, which a child
    reads on import, and the ``estimax`` command's, which names the same folder."""
    return {
        "JAX_COMPILATION_CACHE_DIR": directory,
        "JAX_COMPILATION_CACHE_MAX_SIZE": str(CACHE_MAX_SIZE),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        "ESTIMAX_COMPILATION_CACHE": directory,
    }


SHARED_CACHE = tuple(shared_cache_env(""))  # a test of the cache itself leaves these out (``user_env``)


def job_env(**extra):
    """A job's environment: this checkout's package and the tests' models, no estimax variables but the
    session's compilation cache, compiled as the tests are (``compiler_flags``, conftest.py)."""
    env = {k: v for k, v in user_env().items() if not k.startswith("ESTIMAX_") or k in SHARED_CACHE}
    # This checkout's package (not whichever estimax is installed) and the tests' models.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, TESTS, env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = compiler_flags()
    env.update(extra)
    return env


def launch_group(*job_args, max_restarts=0):
    """`estimax launch` of tests/multihost_job.py: 2 processes x 4 devices, in a process group of its own."""
    command = [sys.executable, "-m", "estimax.cli", "launch", "--num-processes", "2", "--devices-per-process", "4"]
    command += ["--max-restarts", str(max_restarts), "--", sys.executable, MULTIHOST_JOB, *job_args]
    return subprocess.Popen(
        command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(process, timeout=120):
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and its group: none outlives a failed test
        raise
    assert process.returncode == 0, out
    return out


def run_one_process(*job_args):
    result = warm.run(
        [sys.executable, MULTIHOST_JOB, *job_args],
        env=job_env(JAX_NUM_CPU_DEVICES="8"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def read_result(out_dir):
    with open(os.path.join(out_dir, "result.json")) as f:
        result = json.load(f)
    result["losses"] = {int(k): v for k, v in result["losses"].items()}
    return result


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) for k in a)


def checkpoint_steps(model_dir):
    root = os.path.join(model_dir, "checkpoints")
    return [int(n) for n in os.listdir(root) if n.isdigit()] if os.path.isdir(root) else []


# tests/resumable_job.py: a run killed and resumed.
RESUMABLE_JOB = os.path.join(TESTS, "resumable_job.py")
RESUMABLE_STEPS = 40


def start_resumable(model_dir, max_steps=RESUMABLE_STEPS, *extra):
    return warm.Popen(
        [sys.executable, RESUMABLE_JOB, model_dir, str(max_steps), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def saved_checkpoints(model_dir):
    """``(steps, unfinished)``: the steps saved under model_dir/checkpoints, and the names of unfinished saves."""
    root = os.path.join(model_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(n) for n in names if n.isdigit()), [n for n in names if "tmp" in n]


def wait_for(process, condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def final_params(model_dir):
    manager = ocp.CheckpointManager(os.path.join(model_dir, "checkpoints"))
    step = manager.latest_step()
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
    leaves, _ = __import__("jax").tree_util.tree_flatten_with_path(state["params"])
    return step, {str(path): np.asarray(x) for path, x in leaves}


def train_losses(model_dir):
    """The last logged loss of every step (a resumed run logs the steps it redoes again)."""
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


# tests/lease_job.py: a run that pauses while holding its model_dir's lease.
LEASE_JOB = os.path.join(TESTS, "lease_job.py")
CLI_ERROR = "estimax: error: "


def resume_paused(process) -> float:
    process.stdin.write("go\n")
    process.stdin.flush()
    process.send_signal(signal.SIGCONT)
    return time.monotonic()


def ended(process, since: float) -> tuple[str, float, float]:
    """``(stderr, seconds until its error line, seconds until it exited)`` of a job, from ``since``."""
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.startswith(CLI_ERROR):
            break
    said = time.monotonic() - since
    lines.append(process.stderr.read())  # until it exits
    process.wait()
    return "".join(lines), said, time.monotonic() - since


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(CLI_ERROR)]


def run_estimax(*args, cwd=None):
    """`python -m estimax.cli ARGS` as on a user's machine (real devices); its stdout."""
    env = user_env()
    # This checkout's package, not whichever estimax is installed in the environment.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    result = warm.run(
        [sys.executable, "-m", "estimax.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


class SigtermAfter(ex.Hook):
    """Sends this process a real SIGTERM at the end of the loop that reaches ``step``."""

    def __init__(self, step: int):
        self.step = step

    def after_loop(self, loop):
        if loop.step_before < self.step <= loop.step_after:
            os.kill(os.getpid(), signal.SIGTERM)


class Outputs(ex.Hook):
    """Every step's outputs of every loop, concatenated."""

    def __init__(self):
        self.loops = []

    def after_loop(self, loop):
        self.loops.append(dict(loop.outputs))

    def __getitem__(self, name):
        return np.concatenate([o[name] for o in self.loops])


# model_fns and estimators that the checks of a user's model_fn and the error messages share.
def sgd_estimator(fn=model_fn, model=mlp, **config):
    config.setdefault("train_batch_size", 32)
    return ex.Estimator(model=model, model_fn=fn, optimizer=optax.sgd(0.1), config=ex.RunConfig(**config))


def mean_loss_fn(model, features, labels, mode, params):
    spec = model_fn(model, features, labels, mode, params)
    return spec if mode == ex.PREDICT else spec._replace(loss=spec.loss.mean())


def no_predict_branch_fn(model, features, labels, mode, params):
    logits = model(features["x"])
    return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def write_idx(directory, split, images, labels):
    """MNIST's IDX files of ``split`` in ``directory``."""
    for kind, array, magic in (("images", images, 2051), ("labels", labels, 2049)):
        header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
        suffix = "idx3-ubyte" if kind == "images" else "idx1-ubyte"
        (directory / f"{split}-{kind}-{suffix}").write_bytes(header + array.astype(np.uint8).tobytes())


@contextlib.contextmanager
def read_only(directory):
    """``directory`` read-only: a read-only bind mount (root), else permissions (other users)."""
    os.makedirs(directory, exist_ok=True)
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        try:
            yield
        finally:
            os.chmod(directory, 0o755)
        return
    if subprocess.run(["mount", "--bind", directory, directory], capture_output=True).returncode != 0:
        pytest.skip("root cannot bind-mount here, and permissions do not bind root")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", directory], check=True, capture_output=True)
        yield
    finally:
        subprocess.run(["umount", directory], check=True)


# Object stores (tests/test_storage.py, tests/test_s3.py).
STORE_DATA = blobs(256)


def store_estimator(model_dir, **config):
    settings = dict(model_dir=model_dir, train_batch_size=32, steps_per_loop=4, tensorboard=False, quiet=True)
    settings.update(config)
    return ex.Estimator(mlp, model_fn, optax.adam(1e-2), ex.RunConfig(**settings))


def assert_same_params(a, b):
    """The parameters of two states (``Estimator.state()``) are equal, bit for bit."""
    for x, y in zip(jax.tree.leaves(jax.device_get(a.params)), jax.tree.leaves(jax.device_get(b.params)), strict=True):
        np.testing.assert_array_equal(x, y)


def bucket_names(url: str) -> list[str]:
    fs, inner = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return sorted(p[len(inner) + 1 :] for p in fs.find(inner))
