"""What an adapters-only export weighs beside the merged one: the LM example with LoRA of rank 8.

The byte-level transformer of ``estimax.examples.lm`` at its default size (2 layers, 128 wide,
128 bytes of context), LoRA of rank 8 on every attention and MLP projection (as
``benchmarks/fine_tuning.py``), warm-started from the plain model's parameters (the base,
here its initialisation) and trained ``STEPS`` steps on one CPU device. Exported three ways:
the base (the plain model, ``Estimator.export``), the merged export (``export(path)``) and the
adapters alone on the base (``export(path, base_artifact=base)``). One JSON line per artifact:
bytes on disk (all, ``params/``, the program), and the seconds ``estimax.serving.load`` took
plus the first batch's call; then whether the adapters-only export predicts the merged
export's bytes exactly.
Run: ``python benchmarks/lora_export.py``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings

import jax
import numpy as np

import estimax as ex
from estimax.examples import lm
from estimax.state import leaf_names

STEPS, BATCH = 10, 16
LORA = ex.LoRA(layers=[r"blocks/\d+/(attn/(query|key|value|out)|mlp/(up|down))"], rank=8, alpha=16)


def estimator(lora, warm_start=None) -> ex.Estimator:
    hparams = {**lm.params, "decay_steps": 1000}
    config = ex.RunConfig(train_batch_size=BATCH, steps_per_loop=STEPS, num_devices=1, quiet=True, lora=lora)
    config = lm.run_config(config, hparams)
    return ex.Estimator(lm.model, lm.model_fn, lm.optimizer(hparams), config, hparams, warm_start=warm_start)


def bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def loaded(path: str, features: dict) -> tuple[dict, float]:
    start = time.perf_counter()
    outputs = ex.serving.load(path)(features)
    return outputs, time.perf_counter() - start


def main() -> None:
    train, held_out = lm.load(seq_len=lm.MODEL["seq_len"], train_bytes=200_000, held_out_bytes=4_096)
    features = {"bytes": held_out.features["bytes"][:8]}
    with tempfile.TemporaryDirectory(prefix="lora-export-") as work:
        plain = estimator(None)
        params = jax.device_get(plain.state().params)
        np.savez(os.path.join(work, "base.npz"), **dict(zip(leaf_names(params), jax.tree.leaves(params), strict=True)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ex.UntrainedWarning)  # the base is the initial parameters
            base = plain.export(os.path.join(work, "base"), example_features=features)
        est = estimator(LORA, ex.WarmStart(os.path.join(work, "base.npz")))
        est.train(train, max_steps=STEPS)
        paths = {
            "base": base,
            "merged": est.export(os.path.join(work, "merged"), example_features=features),
            "adapters": est.export(os.path.join(work, "adapters"), example_features=features, base_artifact=base),
        }
        predictions = {}
        for name, path in paths.items():
            predictions[name], seconds = loaded(path, features)
            sizes = {
                "bytes": bytes_under(path),
                "params_bytes": bytes_under(os.path.join(path, "params")),
                "program_bytes": os.path.getsize(os.path.join(path, "model.jaxexport")),
            }
            print(json.dumps({"artifact": name, **sizes, "load_and_first_call_seconds": round(seconds, 2)}))
        same = all(np.array_equal(predictions["adapters"][k], v) for k, v in predictions["merged"].items())
        merged, adapters = bytes_under(paths["merged"]), bytes_under(paths["adapters"])
        print(
            f"adapters / merged: {adapters:,} vs {merged:,} bytes (x{adapters / merged:.3f}); predictions equal "
            f"the merged export's: {same}"
        )
    print(f"devices: {jax.devices()[0].device_kind}, jax {jax.__version__}")


if __name__ == "__main__":
    main()
