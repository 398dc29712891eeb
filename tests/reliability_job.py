"""A small job for the reliability tests: `python tests/reliability_job.py MODEL_DIR MAX_STEPS [slow]`.

Trains the tests' MLP on 8 simulated devices, 2 steps per loop, saving every 2
steps and keeping 3 checkpoints; ``slow`` sleeps 0.1 s per loop, so that a test
can act while it trains. Prints "trained to step N" at the end.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from models import blobs, estimator  # noqa: E402

import estimax as ex  # noqa: E402


class Slow(ex.Hook):
    def after_loop(self, loop):
        time.sleep(0.1)


if __name__ == "__main__":
    model_dir, max_steps = sys.argv[1], int(sys.argv[2])
    est = estimator(model_dir, loop="step", steps_per_loop=2, log_every_steps=2, save_every_steps=2)
    est.train(ex.data.from_arrays(*blobs(256)), max_steps=max_steps, hooks=[Slow()] if "slow" in sys.argv else [])
    print(f"trained to step {est.step}", flush=True)
