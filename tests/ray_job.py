"""A Ray Train run of the tiny MLP whose group may change shape, for tests/test_ray.py.

`python tests/ray_job.py ADDRESS MODEL_DIR OUT_DIR --max-steps N --workers MIN:MAX [--batch B]
[--max-failures F] [--hold W:S ...]`

Connects to the Ray cluster at ADDRESS and trains with Ray Train's
``JaxTrainer`` on MIN to MAX workers (one CPU each), every worker one process
of one JAX group (``estimax.ray.initialize``) on the devices
JAX_NUM_CPU_DEVICES gives: the model, input and global batch (24 unless B) of
tests/resize_job.py, saving every 4 steps synchronously. Rank 0 prints
``step S on W workers at T`` after every loop (T: the wall clock). A hold
``W:S`` makes a group of W workers stop after step S and wait, its checkpoint
of step S - 4 committed (a run that cannot end in that shape, so that the
test decides when the cluster changes). Rank 0 writes OUT_DIR/result.json
with the final step and parameters.
"""

import argparse
import json
import os
import threading
import time

import ray
import ray.train
from ray.train.v2.jax import JaxTrainer


def train(config):
    import estimax.ray

    estimax.ray.initialize(timeout_seconds=60)

    import grain
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from models import blobs, estimator

    import estimax as ex

    features, labels = blobs(203)
    examples = grain.MapDataset.range(len(labels)).map(lambda i: ({"x": features["x"][i]}, labels[i]))
    workers = jax.process_count()

    class Report(ex.Hook):
        def after_loop(self, loop):
            held = loop.step_after in config["hold"].get(workers, ())
            if jax.process_index() == 0:
                print(f"step {loop.step_after} on {workers} workers at {time.time():.3f}", flush=True)
                if held:
                    print(f"holding at step {loop.step_after} on {workers} workers", flush=True)
            if held:
                threading.Event().wait()  # until Ray Train stops this group

    est = estimator(config["model_dir"], loop="scan", train_batch_size=config["batch"], steps_per_loop=4,
                    checkpoint=ex.CheckpointPolicy(every_steps=4, async_save=False))  # fmt: skip
    est.train(ex.data.from_grain(examples), max_steps=config["max_steps"], hooks=[Report()])
    params = multihost_utils.process_allgather(est.state().params, tiled=True)
    if jax.process_index() == 0:
        leaves = jax.tree_util.tree_leaves_with_path(params)
        os.makedirs(config["out_dir"], exist_ok=True)
        with open(os.path.join(config["out_dir"], "result.json"), "w") as f:
            json.dump(
                {"step": est.step, "params": {jax.tree_util.keystr(k): np.asarray(v).tolist() for k, v in leaves}}, f
            )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--workers", required=True)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--max-failures", type=int, default=3)
    parser.add_argument("--hold", action="append", default=[])
    args = parser.parse_args()
    hold = {}
    for text in args.hold:
        workers, step = map(int, text.split(":"))
        hold.setdefault(workers, []).append(step)
    ray.init(address=args.address)
    config = {"model_dir": args.model_dir, "out_dir": args.out_dir, "max_steps": args.max_steps, "batch": args.batch}
    trainer = JaxTrainer(
        train,
        train_loop_config={**config, "hold": hold},
        scaling_config=ray.train.ScalingConfig(
            num_workers=tuple(map(int, args.workers.split(":"))), elastic_resize_monitor_interval_s=1.0
        ),
        run_config=ray.train.RunConfig(
            storage_path=os.path.join(args.out_dir, "ray"),
            failure_config=ray.train.FailureConfig(max_failures=args.max_failures),
        ),
    )
    trainer.fit()


if __name__ == "__main__":
    main()
