"""A LoRA fine-tuning job for the kill/resume tests:
`python tests/lora_job.py MODEL_DIR MAX_STEPS [fsdp]`.

The tests' MLP with adapters on both its layers (Adam), one step per loop, a checkpoint every
step, on the 8 simulated devices the tests use; with ``fsdp``, the parameters, adapters and
Adam's state are sharded over ``fsdp=8`` where a dimension divides.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import optax  # noqa: E402
from models import blobs, estimator  # noqa: E402

import estimax as ex  # noqa: E402

LORA = ex.LoRA(layers=["l1", "l2"], rank=8, alpha=16)

if __name__ == "__main__":
    model_dir, max_steps = sys.argv[1], int(sys.argv[2])
    sharded = {"mesh": {"fsdp": 8}, "fsdp_min_bytes": 0} if sys.argv[3:] == ["fsdp"] else {}
    est = estimator(
        model_dir, optimizer=optax.adam(1e-2), lora=LORA, loop="scan", steps_per_loop=1, log_every_steps=1,
        save_every_steps=1, **sharded,
    )  # fmt: skip
    est.train(ex.data.from_arrays(*blobs(256)), max_steps=max_steps)
