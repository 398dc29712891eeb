"""A training job for the takeover tests: `python tests/takeover_job.py MODEL_DIR MAX_STEPS [STOP_STEP]`.

Trains the tests' MLP, 2 steps per loop, logging and saving every 2 steps with
asynchronous saves; the run is named by ``ESTIMAX_RUN_ID`` where the caller sets it.
With STOP_STEP the process stops itself (SIGSTOP) inside its save of that step, on
Orbax's own thread, right after the step's temporary folder was created and before
any array is written: a save in flight, paused where a real pause would catch it.
With ``SLOW_SECONDS`` set, each loop takes at least that long.
The records' flush intervals are past the run: they reach the store only when a
checkpoint makes them durable (or at the end). At the end it prints
"trained to step N, parameters <sha256>". An estimax error ends it as the
``estimax`` command does: one line, and the error's exit code.
"""

import hashlib
import os
import signal
import socket
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from models import blobs, estimator  # noqa: E402
from orbax.checkpoint.path import atomicity  # noqa: E402

import estimax as ex  # noqa: E402
from estimax.records.writers import JsonlWriter, TensorBoardWriter  # noqa: E402


def stop_in_the_save_of(step: int) -> None:
    """Orbax's own step folders, on a disk and on a bucket: the process stops once that of ``step`` exists."""
    for kind in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        original = kind.create

        async def create(self, original=original):
            path = await original(self)
            if self.get_final().name == str(step):
                print(f"stopped in the save of step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            return path

        kind.create = create


class Slow(ex.Hook):
    """Each loop takes at least ``SLOW_SECONDS`` (the caller's): an attempt still training when others start."""

    def after_loop(self, loop):
        time.sleep(float(os.environ.get("SLOW_SECONDS", 0)))


def digest(model) -> str:
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()


if __name__ == "__main__":
    if "AS_HOST" in os.environ:  # as if on another host of a disk they share: its pid cannot be checked
        socket.gethostname = lambda: os.environ["AS_HOST"]
    model_dir, max_steps = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        stop_in_the_save_of(int(sys.argv[3]))
    JsonlWriter.STORE_FLUSH_SECONDS = TensorBoardWriter.STORE_FLUSH_SECONDS = TensorBoardWriter.FLUSH_SECONDS = 3600.0
    est = estimator(
        model_dir,
        steps_per_loop=2,
        log_every_steps=2,
        tensorboard=True,
        checkpoint=ex.CheckpointPolicy(every_steps=2, max_overhead=None, keep=2),
    )
    try:
        est.train(ex.data.from_arrays(*blobs(256)), max_steps=max_steps, hooks=[Slow()])
    except ex.EstimaxError as error:
        print(f"estimax: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        sys.exit(getattr(error, "exit_code", 2))
    print(f"trained to step {est.step}, parameters {digest(est.model())}", flush=True)
