"""The ``estimax`` command: train, evaluate and predict a bundled example.

``estimax train`` with no arguments trains the digits CNN on all local devices
and ends with an evaluation of the held-out split; ``--example lstm`` and
``--example time_distributed`` run the two 2018 device-loop programs;
``--example mnist --data-dir DIR`` (or ``--data mnist``) trains the TF official
MNIST model on MNIST's idx files (held out: the t10k files).

With several processes (``--coordinator``, ``--num-processes``,
``--process-id``, the ``ESTIMAX_*`` variables, or a cluster JAX detects), each
command joins the group before anything touches devices; ``estimax launch
--num-processes N -- estimax train ...`` starts and supervises such a group on
this machine.
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
        sub.add_argument("--mesh", help="device mesh, e.g. data=4,model=2 (-1: the rest; default: data over all)")
        sub.add_argument("--fsdp", type=int, help="shard parameters and optimizer state over N devices (FSDP)")
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
        group = sub.add_argument_group("many processes (default: the ESTIMAX_* variables, or JAX's detection)")
        group.add_argument("--coordinator", help="host:port of process 0 (ESTIMAX_COORDINATOR)")
        group.add_argument("--num-processes", type=int, help="processes in the group (ESTIMAX_NUM_PROCESSES)")
        group.add_argument("--process-id", type=int, help="this process's index, 0 to N-1 (ESTIMAX_PROCESS_ID)")
    launch = commands.add_parser(
        "launch",
        help="run a command as N processes on this machine, restarting the group on failure",
        usage="estimax launch --num-processes N [--devices-per-process D] [--max-restarts R] -- COMMAND ...",
    )
    _launch_arguments(launch)
    return parser


def _launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-processes", type=int, required=True, help="processes to start on 127.0.0.1")
    parser.add_argument(
        "--devices-per-process", type=int, help="simulate D CPU devices in each process (default: the real devices)"
    )
    parser.add_argument(
        "--max-restarts", type=int, default=0, help="restart the group from its latest checkpoint up to R times"
    )


def _launch(argv: list[str]) -> int:
    """``estimax launch [options] -- COMMAND ...``: the options are parsed, the command is not."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="estimax launch", description="Run a command as N local processes.")
    _launch_arguments(parser)
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        parser.error("expected the command after `--`, e.g. `estimax launch --num-processes 2 -- estimax train`")
    from estimax.launch import launch

    try:
        return launch(
            command, args.num_processes, devices_per_process=args.devices_per_process, max_restarts=args.max_restarts
        )
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:
        return _launch(argv[1:])
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
    from estimax import distributed

    # Before anything touches devices: the mesh then spans every process's devices.
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import jax

    import estimax as ex
    from estimax.layout import parse_mesh

    try:
        mesh = parse_mesh(args.mesh, args.fsdp)
    except ValueError as error:
        parser.error(str(error))

    first = jax.process_index() == 0  # process 0 speaks for the group
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
        mesh=mesh,
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
        print_once = print if first else _silent
        print_once(
            f"held-out {name} {results[name]:.4f} on {int(results['num_examples'])} examples "
            f"after {estimator.step} steps; {time.perf_counter() - start:.1f} s"
        )
    elif args.command == "evaluate":
        if estimator.step == 0:
            print(f"No checkpoint in {model_dir}: run `estimax train` first.", file=sys.stderr)
            return 2
        results = estimator.evaluate(held_out)
        if first:
            print(json.dumps(results))
    else:
        # Every process takes part; process 0 receives every example, in input order.
        records = [example.prediction_record(row) for row in estimator.predict(held_out, gather=True)]
        if not first:
            return 0
        summary = f"{len(records)} predictions"
        if records and "class" in records[0]:
            correct = sum(r["class"] == y for r, y in zip(records, held_out.labels, strict=True))
            summary += f", {correct} match the labels"
        if args.output:
            with open(args.output, "w") as f:
                f.writelines(json.dumps({"index": i, **r}) + "\n" for i, r in enumerate(records))
        print(summary + (f"; written to {args.output}" if args.output else ""))
    return 0


def _silent(*args, **kwargs) -> None:
    pass


if __name__ == "__main__":
    sys.exit(main())
