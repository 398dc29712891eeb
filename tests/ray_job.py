"""A Ray Train run of the tiny MLP whose group changes shape, for tests/test_ray.py.

`python tests/ray_job.py ADDRESS MODEL_DIR OUT_DIR MAX_STEPS MIN_WORKERS MAX_WORKERS [HOLD ...]`

Connects to the Ray cluster at ADDRESS and trains with Ray Train on MIN_WORKERS
to MAX_WORKERS workers (one CPU each), every worker one process of one JAX
group (``estimax.ray.initialize``) on the devices JAX_NUM_CPU_DEVICES gives:
the same model, input and batch as tests/resize_job.py, saving every 4 steps
synchronously. Each worker prints ``step S on W workers at T`` after every
loop (T: the wall clock). A HOLD ``W:S`` makes a group of W workers stop
after step S and wait (a run that cannot end in that shape, so that the test
decides when the cluster changes); its checkpoint of S - 4 is committed by
then. Rank 0 writes OUT_DIR/result.json with the final step and parameters.
"""

import json
import os
import sys
import threading
import time

os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

import ray  # noqa: E402
import ray.train  # noqa: E402
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer  # noqa: E402


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
            if jax.process_index() == 0:
                print(f"step {loop.step_after} on {workers} workers at {time.time():.3f}", flush=True)
            if loop.step_after in config["hold"].get(workers, ()):
                print(f"holding at step {loop.step_after} on {workers} workers", flush=True)
                threading.Event().wait()  # until Ray Train stops this group

    est = estimator(config["model_dir"], loop="scan", train_batch_size=24, steps_per_loop=4,
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
    address, model_dir, out_dir, max_steps, least, most, *holds = sys.argv[1:]
    hold = {}
    for text in holds:
        workers, step = map(int, text.split(":"))
        hold.setdefault(workers, []).append(step)
    ray.init(address=address, log_to_driver=True)
    trainer = DataParallelTrainer(
        train,
        train_loop_config={"model_dir": model_dir, "out_dir": out_dir, "max_steps": int(max_steps), "hold": hold},
        scaling_config=ray.train.ScalingConfig(
            num_workers=(int(least), int(most)), elastic_resize_monitor_interval_s=1.0
        ),
        run_config=ray.train.RunConfig(
            storage_path=os.path.join(out_dir, "ray"), failure_config=ray.train.FailureConfig(max_failures=3)
        ),
    )
    trainer.fit()


if __name__ == "__main__":
    main()
