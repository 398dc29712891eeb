"""The fine-tuning run estimax was first asked for, end to end, on scikit-learn's 8x8 digits.

    python benchmarks/seed_fine_tuning.py [--seeds 0 1 2] [--examples 20] [--steps 300]

A tf-slim user started Inception v3 from its published checkpoint, left out the ``Logits``
scopes and trained on a new data set. Here, in small:

1. Pretrain the digits CNN (``estimax/examples/digits.py``) on the digits 0-4.
2. Fine-tune it on a few examples of the digits 5-9 (``--examples`` per class): the backbone
   warm-started from step 1 with the head left out and initialised anew (``WarmStart(exclude=)``),
   frozen for the first third of the steps, then trained (``freeze={0: [...], N: []}``), with a
   moving average of the weights (``ema_decay``) that evaluation and export use.
3. Train the same model from scratch on the same examples for the same steps.

Prints, per seed, the held-out accuracy on all other images of 5-9 for the fine-tuned run (its
average), the same run's raw weights, and the run from scratch; and checks that the exported
artifact (the average) predicts as the Estimator does.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np
import optax
from sklearn.datasets import load_digits

import estimax as ex
from estimax.examples.digits import CNN, model_fn

BACKBONE = [r"conv1/.*", r"conv2/.*", r"dense/.*"]


def split(seed: int, per_class: int):
    """(pretraining set of 0-4, a few examples per class of 5-9, every other image of 5-9); 5-9 as 0-4."""
    digits = load_digits()
    images, labels = (digits.images / 16.0).astype(np.float32), digits.target.astype(np.int32)
    first = labels < 5
    rng = np.random.default_rng(seed)
    chosen = np.concatenate([rng.choice(np.flatnonzero(labels == c), per_class, replace=False) for c in range(5, 10)])
    rest = np.setdiff1d(np.flatnonzero(~first), chosen)
    arrays = lambda idx, shift=0: ex.data.from_arrays({"image": images[idx]}, labels[idx] - shift)  # noqa: E731
    return arrays(np.flatnonzero(first)), arrays(chosen, 5), arrays(rest, 5)


def estimator(model_dir: str, seed: int, warm_start=None, **config) -> ex.Estimator:
    """The digits CNN with a head of 5 classes; ``config``: the ``RunConfig`` settings beyond the common ones."""
    return ex.Estimator(
        model=lambda rngs, params: CNN(8, 5, rngs=rngs),
        model_fn=model_fn,
        optimizer=optax.adamw(1e-3, weight_decay=1e-4),
        config=ex.RunConfig(model_dir=model_dir, train_batch_size=32, steps_per_loop=25, seed=seed, quiet=True,
                            **config),
        warm_start=warm_start,
    )  # fmt: skip


def run(seed: int, per_class: int, steps: int) -> dict:
    pretrain, few, held_out = split(seed, per_class)
    root = tempfile.mkdtemp(prefix="seed-fine-tuning-")
    estimator(f"{root}/pretrain", seed).train(pretrain, max_steps=steps)

    tuning = {"freeze": {0: BACKBONE, steps // 3: []}, "ema_decay": 0.99}  # frozen for a third of the steps
    head_anew = ex.WarmStart(f"{root}/pretrain", exclude=[r"head/.*"])
    tuned = estimator(f"{root}/fine-tune", seed, head_anew, **tuning)
    tuned.train(few, max_steps=steps)
    average = tuned.evaluate(held_out)
    raw = estimator(f"{root}/fine-tune", seed, **tuning, eval_weights="raw").evaluate(held_out)

    scratch = estimator(f"{root}/scratch", seed)
    scratch.train(few, max_steps=steps)
    from_scratch = scratch.evaluate(held_out)

    path = tuned.export(f"{root}/export")  # the average, as evaluation used it
    images = held_out.features["image"][:64]
    predicted = np.stack([r["class"] for r in tuned.predict(ex.data.from_arrays({"image": images}))])
    assert (ex.serving.load(path)({"image": images})["class"] == predicted).all(), "the export predicts otherwise"
    return {
        "seed": seed,
        "fine_tuned_average": round(average["accuracy"], 4),
        "fine_tuned_raw": round(raw["accuracy"], 4),
        "from_scratch": round(from_scratch["accuracy"], 4),
        "held_out_examples": int(average["num_examples"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--examples", type=int, default=20, help="training examples per class of 5-9")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for seed in args.seeds:
        print(json.dumps(run(seed, args.examples, args.steps)), flush=True)


if __name__ == "__main__":
    main()
