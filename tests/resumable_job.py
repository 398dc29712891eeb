"""A training job for the kill/resume tests: `python tests/resumable_job.py MODEL_DIR MAX_STEPS`.

Saves every step (so that a save is nearly always in flight) and logs every
step, one step per loop, on the 8 simulated devices the tests use.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from models import blobs, estimator  # noqa: E402

import estimax as ex  # noqa: E402

if __name__ == "__main__":
    model_dir, max_steps = sys.argv[1], int(sys.argv[2])
    est = estimator(model_dir, loop="scan", steps_per_loop=1, log_every_steps=1, save_every_steps=1)
    est.train(ex.data.from_arrays(*blobs(256)), max_steps=max_steps)
