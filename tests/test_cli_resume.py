"""`estimax train` with its default flags (loop="auto"), killed and resumed, ends bitwise where an
uninterrupted run ends; the persistent compilation cache serves the later processes."""

import os
import signal
import subprocess
import sys

import helpers
import numpy as np
import orbax.checkpoint as ocp
import warm

MAX_STEPS = "60"  # 3 loops of STEPS_PER_LOOP: a kill in each of the first two, the last one resumed
STEPS_PER_LOOP = "20"  # the default 50 only costs time here (8 devices on 2 cores run some 50 steps a second)
BATCH_SIZE = "16"  # 2 examples on each of the 8 devices: the default 128 only costs time here


def _start(model_dir, env):
    command = [sys.executable, "-m", "estimax.cli", "train", "--model-dir", model_dir, "--max-steps", MAX_STEPS]
    command += ["--batch-size", BATCH_SIZE, "--steps-per-loop", STEPS_PER_LOOP]
    return warm.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _until(process, text) -> str:
    """The output of ``process`` up to the first line that contains ``text``."""
    seen = []
    while not seen or text not in seen[-1]:
        seen.append(process.stdout.readline())
        assert seen[-1], "".join(seen)  # ended without printing it
    return "".join(seen)


def _finish(process) -> str:
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out
    return out


def _params(model_dir):
    manager = ocp.CheckpointManager(os.path.join(model_dir, "checkpoints"))
    step = manager.latest_step()
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
    manager.close()
    leaves, _ = __import__("jax").tree_util.tree_flatten_with_path(state["params"])
    return step, {str(path): np.asarray(x) for path, x in leaves}


def test_default_cli_killed_twice_resumes_bitwise_and_reuses_compiled_programs(tmp_path):
    cache = tmp_path / "xdg" / "estimax" / "jax"
    env = helpers.user_env(
        *helpers.SHARED_CACHE,  # the command's own cache, not the session's
        PYTHONPATH=os.getcwd(),
        XLA_FLAGS="--xla_force_host_platform_device_count=8",  # 8 devices, compiled as a user's process does
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
        JAX_DEBUG_LOG_MODULES="jax._src.compiler",  # logs each persistent cache hit and miss
    )
    reference = str(tmp_path / "uninterrupted")
    first = _finish(_start(reference, env))
    assert "loop=auto: using scan: no convolution in the training step" in first  # the digits CNN: matrix products
    assert "PERSISTENT COMPILATION CACHE MISS for 'jit_train_loop'" in first and os.listdir(cache)

    run = str(tmp_path / "run")
    process = _start(run, env)  # preempted at the end of a loop before the last: a checkpoint
    _until(process, "loop=auto: using scan")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 75
    process = _start(run, env)  # killed as soon as it has resumed
    _until(process, "loop=auto: using scan, the loop the checkpoint of step")
    process.kill()
    process.wait()
    process = _start(run, env)  # killed in the middle of training
    _until(process, "train step ")
    process.kill()
    process.wait()
    last = _finish(_start(run, env))
    assert "the loop the checkpoint of step" in last and "no convolution" not in last
    # The train step compiled by the first process is read back, not compiled again.
    assert "Persistent compilation cache hit for 'jit_train_loop'" in last
    assert "PERSISTENT COMPILATION CACHE MISS for 'jit_train_loop'" not in last

    (step, params), (ref_step, ref_params) = _params(run), _params(reference)
    assert step == ref_step == int(MAX_STEPS)
    for name, value in ref_params.items():
        np.testing.assert_array_equal(params[name], value)  # bitwise
