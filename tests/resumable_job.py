"""A training job for the kill/resume tests:
`python tests/resumable_job.py MODEL_DIR MAX_STEPS [evaluate|fsdp] [accum=A]`.

Saves every step (so that a save is nearly always in flight) and logs every
step, one step per loop, on the 8 simulated devices the tests use. With
``evaluate``, runs train_and_evaluate with a slow evaluation input that says
"evaluating" when it starts; with ``fsdp``, parameters and Adam's state are
sharded over ``fsdp=8``; with ``accum=A``, gradients accumulate over A micro-batches.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import optax  # noqa: E402
from models import blobs, estimator  # noqa: E402

import estimax as ex  # noqa: E402


def slow_evaluation(batches=200):
    features, labels = blobs(32 * batches)
    print("evaluating", flush=True)
    for i in range(batches):
        time.sleep(0.05)
        yield {"x": features["x"][32 * i : 32 * (i + 1)]}, labels[32 * i : 32 * (i + 1)]
    print("evaluation input exhausted", flush=True)


if __name__ == "__main__":
    model_dir, max_steps = sys.argv[1], int(sys.argv[2])
    options = dict(a.split("=") for a in sys.argv[3:] if "=" in a)
    flags = [a for a in sys.argv[3:] if "=" not in a]
    sharded = dict(mesh={"fsdp": 8}, fsdp_min_bytes=0, optimizer=optax.adam(1e-2)) if flags == ["fsdp"] else {}
    est = estimator(
        model_dir,
        loop="scan",
        steps_per_loop=1,
        log_every_steps=1,
        save_every_steps=1,
        grad_accum_steps=int(options.get("accum", 1)),
        **sharded,
    )
    if flags == ["evaluate"]:

        class SlowEvaluation:
            def __iter__(self):
                return slow_evaluation()

        est.train_and_evaluate(ex.data.from_arrays(*blobs(256)), SlowEvaluation(), max_steps=max_steps, eval_every=5)
    else:
        est.train(ex.data.from_arrays(*blobs(256)), max_steps=max_steps)
