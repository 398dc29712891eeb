"""A LoRA fine-tuning job for the kill/resume tests:
`python tests/lora_job.py MODEL_DIR MAX_STEPS [fsdp]`.

The tiny byte-level transformer of ``estimax.examples.lm`` with adapters on its attention
projections, one step per loop, a checkpoint every step, on the 8 simulated devices the tests
use; with ``fsdp``, the parameters, adapters and Adam's state are sharded over ``fsdp=8``.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import estimax as ex  # noqa: E402
from estimax.examples import lm  # noqa: E402

TINY = {"seq_len": 16, "dim": 32, "num_heads": 2, "num_layers": 1, "mlp_ratio": 2}
LORA = ex.LoRA(layers=[r"blocks/\d+/attn/(query|value)"], rank=4, alpha=8)

if __name__ == "__main__":
    model_dir, max_steps = sys.argv[1], int(sys.argv[2])
    sharded = {"mesh": {"fsdp": 8}, "fsdp_min_bytes": 0} if sys.argv[3:] == ["fsdp"] else {}
    config = ex.RunConfig(
        model_dir=model_dir, train_batch_size=16, steps_per_loop=1, loop="scan", log_every_steps=1,
        save_every_steps=1, lora=LORA, **sharded,
    )  # fmt: skip
    train, _ = lm.load(seq_len=TINY["seq_len"], train_bytes=20_000, held_out_bytes=1_024)
    lm.estimator(config, decay_steps=max_steps, **TINY).train(train, max_steps=max_steps)
