"""A training job for the lease tests: `python tests/lease_job.py MODEL_DIR WAIT_STEP MAX_STEPS`.

Trains the tests' MLP, 2 steps per loop, saving every 2 steps without async saves
(so that no save is under way while it waits). When the loop that reaches
WAIT_STEP has been read, it prints "waiting at step N" and waits for a line on
stdin: meanwhile the test pauses it, or takes the store away. The flush
intervals of metrics.jsonl on a store and of the event files are set past the
run, so that their records are only held in memory until the end: what the job
wrote before it waited is known (on a disk, metrics.jsonl's records are
appended as they come: the test waits for the last one before it pauses). An
estimax error ends it as it ends the ``estimax`` command: one line, and the
error's exit code.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from models import blobs, estimator  # noqa: E402

import estimax as ex  # noqa: E402
from estimax.records.writers import JsonlWriter, TensorBoardWriter  # noqa: E402


class WaitAt(ex.Hook):
    def __init__(self, step: int):
        self.step, self.waited = step, False

    def after_loop(self, loop):
        if loop.step_after >= self.step and not self.waited:
            self.waited = True
            print(f"waiting at step {loop.step_after}", flush=True)
            sys.stdin.readline()


if __name__ == "__main__":
    model_dir, wait_step, max_steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    JsonlWriter.STORE_FLUSH_SECONDS = TensorBoardWriter.STORE_FLUSH_SECONDS = TensorBoardWriter.FLUSH_SECONDS = 3600.0
    est = estimator(
        model_dir, steps_per_loop=2, log_every_steps=2, checkpoint=ex.CheckpointPolicy(every_steps=2, async_save=False)
    )
    try:
        est.train(ex.data.from_arrays(*blobs(256)), max_steps=max_steps, hooks=[WaitAt(wait_step)])
    except ex.EstimaxError as error:
        print(f"estimax: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        sys.exit(getattr(error, "exit_code", 2))
    print(f"trained to step {est.step}", flush=True)
