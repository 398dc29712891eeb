"""One process of a multi-process run, for tests/test_distributed.py.

`python tests/multihost_job.py MODEL_DIR OUT_DIR [train|evaluate] [MAX_STEPS] [SECONDS_PER_LOOP] [adam|fsdp|tp|clock]`

Joins the group from the ESTIMAX_* variables (a no-op with none: one
process), with the devices JAX_NUM_CPU_DEVICES gives. `train` trains the
tiny MLP to MAX_STEPS (saving every 4 steps), then evaluates and predicts;
`evaluate` only restores and evaluates. Process 0 writes OUT_DIR/result.json
(per-step losses, evaluation, predictions gathered in input order, final
parameters); every process writes OUT_DIR/local-<i>.json (what it predicted
itself) and OUT_DIR/pid-<i> on start. ``adam`` trains with Adam instead of
SGD; ``fsdp`` also shards parameters and Adam's state over ``fsdp=8``, which
spans every process; ``tp`` shards them by tensor-parallel rules over
``data=4`` x ``model=2``.
"""

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from estimax import distributed  # noqa: E402

distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from models import blobs, estimator  # noqa: E402

import estimax as ex  # noqa: E402
from estimax.hooks import Hook  # noqa: E402

NUM_TRAIN, NUM_EVAL = 256, 203  # 203: not a multiple of any batch or process count: padding on every process
FEATURES, LABELS = blobs(NUM_TRAIN + NUM_EVAL)


class Losses(Hook):
    """Per-step losses of every loop, slowed down on request (so that a test can kill a process mid-run)."""

    def __init__(self, seconds_per_loop: float):
        self.losses, self.seconds_per_loop = {}, seconds_per_loop

    def after_loop(self, loop):
        for i, loss in enumerate(loop.outputs["loss"]):
            self.losses[loop.step_before + i + 1] = float(loss)
        time.sleep(self.seconds_per_loop)


def main():
    model_dir, out_dir = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "train"
    max_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 24
    seconds_per_loop = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    variant = sys.argv[6] if len(sys.argv) > 6 else None
    layout = {} if variant in (None, "clock") else {"optimizer": optax.adam(1e-2)}
    saves = {"save_every_steps": 4}
    if variant == "clock":  # clocks that disagree: process 0's says a save is due at every loop, 1's never
        seconds = 1e-3 if jax.process_index() == 0 else 1e6
        saves = {"checkpoint": ex.CheckpointPolicy(every_steps=None, every_seconds=seconds, keep=100)}
    if variant == "fsdp":
        layout.update(mesh={"fsdp": 8}, fsdp_min_bytes=0)
    if variant == "tp":  # l1 column parallel, l2 row parallel, over the 2 devices of "model" in each process
        rules = [(r"l1/kernel", (None, "model")), (r"l1/bias", ("model",)), (r"l2/kernel", ("model", None))]
        layout.update(mesh={"data": 4, "model": 2}, sharding_rules=rules)
    process = jax.process_index()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"pid-{process}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(f.name, os.path.join(out_dir, f"pid-{process}"))  # whole: a test that sees the file kills this pid
    est = estimator(
        model_dir,
        loop="scan",
        steps_per_loop=4,
        eval_batch_size=16,
        **saves,
        sync_timeout_seconds=60,
        **layout,
    )
    losses = Losses(seconds_per_loop)
    if mode == "train":
        est.train(
            ex.data.from_arrays({"x": FEATURES["x"][:NUM_TRAIN]}, LABELS[:NUM_TRAIN]),
            max_steps=max_steps,
            hooks=[losses],
        )
    held_out = ex.data.from_arrays({"x": FEATURES["x"][NUM_TRAIN:]}, LABELS[NUM_TRAIN:])
    results = est.evaluate(held_out)
    local = [int(p["class"]) for p in est.predict(held_out)]
    gathered = [p["logits"].tolist() for p in est.predict(held_out, gather=True)]
    with open(os.path.join(out_dir, f"local-{process}.json"), "w") as f:
        json.dump({"classes": local, "process_count": jax.process_count()}, f)
    # A collective: the parameters may be sharded over every process's devices.
    params = multihost_utils.process_allgather(est.state().params, tiled=True)
    if process == 0:
        leaves = jax.tree_util.tree_leaves_with_path(params)
        result = {
            "step": est.step,
            "losses": losses.losses,
            "eval": results,
            "predictions": gathered,
            "params": {jax.tree_util.keystr(k): np.asarray(v).tolist() for k, v in leaves},
            "devices": jax.device_count(),
            "processes": jax.process_count(),
            "kernel_spec": list(est.state().params["l1"]["kernel"].get_value().sharding.spec),
        }
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
