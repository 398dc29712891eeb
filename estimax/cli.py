"""The ``estimax`` command: train, evaluate and predict the bundled example.

``estimax train`` with no arguments trains the digits CNN on all local devices
and ends with an evaluation of the held-out split; ``--data mnist --data-dir
DIR`` trains the same CNN on MNIST's idx files (held out: the t10k files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_MODEL_DIR = os.path.join("runs", "digits")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="estimax", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("train", "train, then evaluate the held-out split"),
        ("evaluate", "evaluate the latest checkpoint on the held-out split"),
        ("predict", "predict the held-out split with the latest checkpoint"),
    ):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument(
            "--model-dir",
            default=None,
            help=f"checkpoints and metrics.jsonl (default: {DEFAULT_MODEL_DIR}, or runs/mnist with --data mnist)",
        )
        sub.add_argument(
            "--data",
            choices=("digits", "mnist"),
            default="digits",
            help="digits: scikit-learn's bundled 8x8 digits (default); mnist: MNIST idx files in --data-dir",
        )
        sub.add_argument("--data-dir", help="with --data mnist: directory (or fsspec URL) of the MNIST idx files")
        sub.add_argument("--batch-size", type=int, default=128, help="global batch size (default: 128)")
        sub.add_argument("--seed", type=int, default=0, help="initialisation, dropout and shuffling seed")
        if name == "train":
            sub.add_argument("--max-steps", type=int, default=400, help="train until this step (default: 400)")
            sub.add_argument(
                "--steps-per-loop", type=int, default=50, help="training steps per host round trip (default: 50)"
            )
            sub.add_argument(
                "--loop", choices=("auto", "scan", "step"), default="auto", help="device loop mode (default: auto)"
            )
        if name == "predict":
            sub.add_argument("--output", help="write one JSON line per example here (default: stdout summary)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.data == "mnist" and not args.data_dir:
        parser.error("--data mnist needs --data-dir DIR holding train-images-idx3-ubyte[.gz] and the other idx files")
    args.model_dir = args.model_dir or (DEFAULT_MODEL_DIR if args.data == "digits" else os.path.join("runs", "mnist"))
    import estimax as ex
    from estimax.examples import digits

    config = ex.RunConfig(
        model_dir=args.model_dir,
        train_batch_size=args.batch_size,
        seed=args.seed,
        steps_per_loop=getattr(args, "steps_per_loop", 50),
        loop=getattr(args, "loop", "auto"),
    )
    if args.data == "mnist":  # the same CNN on 28x28 images, held out: the t10k files
        from estimax.data import idx

        train, held_out = idx.mnist(args.data_dir, "train"), idx.mnist(args.data_dir, "t10k")
        estimator = digits.estimator(config, image_size=28)
    else:
        train, held_out = digits.load()
        estimator = digits.estimator(config)
    if args.command == "train":
        start = time.perf_counter()
        estimator.train(train, max_steps=args.max_steps)
        results = estimator.evaluate(held_out)
        print(
            f"held-out accuracy {results['accuracy']:.4f} on {int(results['num_examples'])} examples "
            f"after {estimator.step} steps; {time.perf_counter() - start:.1f} s"
        )
    elif args.command == "evaluate":
        if estimator.step == 0:
            print(f"No checkpoint in {args.model_dir}: run `estimax train` first.", file=sys.stderr)
            return 2
        results = estimator.evaluate(held_out)
        print(json.dumps(results))
    else:
        predictions = [row["class"].item() for row in estimator.predict(held_out)]
        correct = sum(p == y for p, y in zip(predictions, held_out.labels, strict=True))
        if args.output:
            with open(args.output, "w") as f:
                f.writelines(json.dumps({"index": i, "class": p}) + "\n" for i, p in enumerate(predictions))
        print(
            f"{len(predictions)} predictions, {correct} match the labels"
            + (f"; written to {args.output}" if args.output else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
