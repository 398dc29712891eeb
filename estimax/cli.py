"""The ``estimax`` command: train, evaluate and predict a bundled example.

``estimax train`` with no arguments trains the digits CNN on all local devices
and ends with an evaluation of the held-out split; ``--example lstm`` and
``--example time_distributed`` run the two 2018 device-loop programs;
``--example mnist --data-dir DIR`` (or ``--data mnist``) trains the TF official
MNIST model on MNIST's idx files (held out: the t10k files).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

EXAMPLES = ("digits", "mnist", "lstm", "time_distributed")
DEFAULT_EXAMPLE = "digits"
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
            "--example", choices=EXAMPLES, default=DEFAULT_EXAMPLE, help="the bundled example (default: digits)"
        )
        sub.add_argument(
            "--data", choices=("digits", "mnist"), help="--data mnist is --example mnist (MNIST idx files)"
        )
        sub.add_argument("--data-dir", help="with --example mnist: directory (or fsspec URL) of the MNIST idx files")
        sub.add_argument(
            "--model-dir",
            help=f"checkpoints and metrics.jsonl (default: {DEFAULT_MODEL_DIR}, runs/<example> for the others)",
        )
        sub.add_argument(
            "--batch-size", type=int, help="global batch size (default: 128; 1024 for lstm and time_distributed)"
        )
        sub.add_argument("--seed", type=int, default=0, help="initialisation, dropout and shuffling seed")
        if name == "train":
            sub.add_argument("--max-steps", type=int, help="train until this step (default: 400; 10 for lstm, ...)")
            sub.add_argument(
                "--steps-per-loop", type=int, help="training steps per host round trip (default: 50; 2 for lstm, ...)"
            )
            sub.add_argument(
                "--loop", choices=("auto", "scan", "step"), help="device loop mode (default: auto; scan for lstm, ...)"
            )
            sub.add_argument("--eval-every", type=int, help="also evaluate the held-out split every N steps")
            sub.add_argument("--profile-steps", help="A:B: write a jax.profiler trace of steps A to B to the model_dir")
            sub.add_argument("--quiet", action="store_true", help="no progress bar and no train log lines")
        if name == "predict":
            sub.add_argument("--output", help="write one JSON line per example here (default: stdout summary)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.data == "mnist":
        args.example = "mnist"
    if args.example == "mnist" and not args.data_dir:
        parser.error("--data mnist needs --data-dir DIR holding train-images-idx3-ubyte[.gz] and the other idx files")
    profile_steps = None
    if getattr(args, "profile_steps", None):
        try:
            profile_steps = tuple(int(x) for x in args.profile_steps.split(":"))
        except ValueError:
            parser.error(f"--profile-steps {args.profile_steps!r}: expected A:B, e.g. 100:110")
    import estimax as ex

    example = importlib.import_module(f"estimax.examples.{args.example}")

    def given_or_default(name: str, default_key: str):  # an explicit 0 still reaches RunConfig's check
        value = getattr(args, name, None)
        return example.DEFAULTS[default_key] if value is None else value

    model_dir = args.model_dir or os.path.join("runs", args.example)
    config = ex.RunConfig(
        model_dir=model_dir,
        train_batch_size=given_or_default("batch_size", "batch_size"),
        seed=args.seed,
        steps_per_loop=given_or_default("steps_per_loop", "steps_per_loop"),
        loop=given_or_default("loop", "loop"),
        quiet=getattr(args, "quiet", False),
        profile_steps=profile_steps,
    )
    estimator = example.estimator(config)
    train, held_out = example.load(args.data_dir) if args.example == "mnist" else example.load()
    if args.command == "train":
        start = time.perf_counter()
        max_steps = given_or_default("max_steps", "max_steps")
        if args.eval_every:
            results = estimator.train_and_evaluate(
                train, held_out, max_steps=max_steps, eval_every_steps=args.eval_every
            )
        else:
            results = estimator.train(train, max_steps=max_steps).evaluate(held_out)
        name = "accuracy" if "accuracy" in results else "loss"
        print(
            f"held-out {name} {results[name]:.4f} on {int(results['num_examples'])} examples "
            f"after {estimator.step} steps; {time.perf_counter() - start:.1f} s"
        )
    elif args.command == "evaluate":
        if estimator.step == 0:
            print(f"No checkpoint in {model_dir}: run `estimax train` first.", file=sys.stderr)
            return 2
        results = estimator.evaluate(held_out)
        print(json.dumps(results))
    else:
        records = [example.prediction_record(row) for row in estimator.predict(held_out)]
        summary = f"{len(records)} predictions"
        if records and "class" in records[0]:
            correct = sum(r["class"] == y for r, y in zip(records, held_out.labels, strict=True))
            summary += f", {correct} match the labels"
        if args.output:
            with open(args.output, "w") as f:
                f.writelines(json.dumps({"index": i, **r}) + "\n" for i, r in enumerate(records))
        print(summary + (f"; written to {args.output}" if args.output else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
