"""The TF SavedModel export, checked end to end where TensorFlow is installed (``estimax[tf]``).

TensorFlow is not installed by CI (it adds 1.6 GB to the environment), so
this check lives here: train the digits CNN for a few steps, export it with
``format="tf_saved_model"``, load it with ``tf.saved_model.load`` in a new
process that has no estimax model code, call its ``serving_default``
signature on the 360 held-out images, and compare with ``est.predict()``.
Prints one JSON line. Run: ``pip install 'estimax[tf]'; python benchmarks/tf_saved_model.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import estimax as ex
from estimax.examples import digits

LOADER = """
import json, sys, time
import numpy as np
import tensorflow as tf

start = time.perf_counter()
model = tf.saved_model.load(sys.argv[1])
serve = model.signatures["serving_default"]
images = np.load(sys.argv[2])
out = {k: v.numpy() for k, v in serve(image=tf.constant(images)).items()}
one = {k: v.numpy() for k, v in serve(image=tf.constant(images[:1])).items()}
np.savez(sys.argv[3], **out)
print(json.dumps({
    "tensorflow": tf.__version__,
    "load_and_call_s": round(time.perf_counter() - start, 2),
    "batch_1_equal": bool(np.array_equal(one["class"], out["class"][:1])),
    "estimax_model_code_imported": any(m.startswith("estimax.examples") for m in sys.modules),
}))
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        est = digits.estimator(ex.RunConfig(model_dir=f"{directory}/run", train_batch_size=64, quiet=True))
        train, held_out = digits.load()
        est.train(train, max_steps=50)
        start = time.perf_counter()
        path = est.export(f"{directory}/saved_model", format="tf_saved_model")
        export_seconds = time.perf_counter() - start
        rows = list(est.predict(held_out))
        expected = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        images = held_out.features["image"]
        np.save(f"{directory}/images.npy", images)
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        result = subprocess.run(
            [sys.executable, "-c", LOADER, path, f"{directory}/images.npy", f"{directory}/out.npz"],
            capture_output=True,
            text=True,
            env=env,
            cwd=directory,
            check=False,
        )
        if result.returncode != 0:
            raise SystemExit(result.stderr)
        facts = json.loads(result.stdout.strip().splitlines()[-1])
        out = np.load(f"{directory}/out.npz")
        files = [os.path.join(root, f) for root, _, names in os.walk(path) for f in names]
        print(
            json.dumps(
                {
                    **facts,
                    "examples": len(images),
                    "export_s": round(export_seconds, 2),
                    "saved_model_bytes": sum(os.path.getsize(f) for f in files),
                    "class_equal_to_predict": bool(np.array_equal(out["class"], expected["class"])),
                    "probabilities_max_abs_diff": float(
                        np.max(np.abs(out["probabilities"] - expected["probabilities"]))
                    ),
                }
            )
        )


if __name__ == "__main__":
    main()
