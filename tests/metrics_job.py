"""One process of a multi-process evaluation with mergeable metrics, for tests/test_metrics.py.

`python tests/metrics_job.py OUT_DIR`

Joins the group from the ESTIMAX_* variables (a no-op with none: one
process), evaluates test_metrics' poisoned model on its 1,003 examples with
`host_metrics`, and writes OUT_DIR/result-<process>.json: the integer leaves
of every merged state, the results, and the `index` rows host_metrics saw.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from estimax import distributed  # noqa: E402

distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from test_metrics import DATA, integer_leaves, make_estimator  # noqa: E402


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    seen = {}

    def host_metrics(outputs):
        seen.update(outputs)
        return {"rows": len(outputs["index"])}

    est = make_estimator(eval_batch_size=64, host_metrics=host_metrics)
    states = est.evaluate_states(DATA)
    results = est.evaluate(DATA)
    result = {
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "states": {k: [np.asarray(x).tolist() for x in v] for k, v in integer_leaves(states).items()},
        "results": results,
        "index": np.asarray(seen["index"]).tolist(),
    }
    with open(os.path.join(out_dir, f"result-{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
