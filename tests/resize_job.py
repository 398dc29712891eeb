"""One process of a run that may change shape, for tests/test_resize.py.

`python tests/resize_job.py MODEL_DIR OUT_DIR MAX_STEPS INPUT`

Joins the group from the ESTIMAX_* variables (one process without them) on the
devices JAX_NUM_CPU_DEVICES gives, trains the tiny MLP to MAX_STEPS from
INPUT (``grain``: a Grain MapDataset; ``stream``: a Grain IterDataset per
process), saving every 4 steps, and process 0 writes OUT_DIR/result.json with
the final parameters.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from estimax import distributed  # noqa: E402

distributed.initialize()

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from models import blobs, estimator  # noqa: E402

import estimax as ex  # noqa: E402

FEATURES, LABELS = blobs(203)  # 203 examples: epochs end with a remainder that is dropped


def examples() -> grain.MapDataset:
    return grain.MapDataset.range(len(LABELS)).map(lambda i: ({"x": FEATURES["x"][i]}, LABELS[i]))


def main():
    model_dir, out_dir, max_steps, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if kind == "grain":
        input = ex.data.from_grain(examples())
    else:  # each process streams its own part, repeated
        input = ex.data.from_grain(lambda i, n: examples()[i::n].repeat().to_iter_dataset())
    est = estimator(model_dir, loop="scan", train_batch_size=24, steps_per_loop=4, save_every_steps=4)
    est.train(input, max_steps=max_steps)
    params = multihost_utils.process_allgather(est.state().params, tiled=True)
    if jax.process_index() == 0:
        leaves = jax.tree_util.tree_leaves_with_path(params)
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(
                {"step": est.step, "params": {jax.tree_util.keystr(k): np.asarray(v).tolist() for k, v in leaves}}, f
            )


if __name__ == "__main__":
    main()
