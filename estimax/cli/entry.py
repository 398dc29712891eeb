"""The ``estimax`` command: train, evaluate and predict a task module.

``estimax train my_project.task`` (a module path or a ``.py`` file) runs any
program that follows the task convention (``estimax/cli/task.py``); ``--example
NAME`` runs a bundled one (``estimax/examples/``), and ``estimax train`` with
no task trains the digits CNN and evaluates its held-out split.

Owns parsing and checking the arguments (without importing JAX, so that
``--help`` and mistakes, ``--set`` names and values included, answer at
once), printing every ``EstimaxError`` as one line with its kind's exit status
(2, or 74 for a store fault; ``--debug`` shows the traceback), and a task's own
``ValueError`` and the like as one line too, and ending the program as soon as
its command is done. The run-setting flags are
``flags.py``'s.
Owns no training: the commands call the ``Estimator``.

With several processes (``--coordinator``, ``--num-processes``,
``--process-id``, the ``ESTIMAX_*`` variables, or a cluster JAX detects), each
command joins the group before anything touches devices; ``estimax launch
--num-processes N -- estimax train ...`` starts and supervises such a group on
this machine.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import NoReturn

from estimax.cli import predict_file
from estimax.cli import task as task_lib
from estimax.cli.flags import RUN_FLAGS, non_negative_int, positive_int
from estimax.errors import USER_ERROR_EXIT_CODE, ConfigError, EstimaxError  # imports nothing heavy

EXAMPLES = ("digits", "mnist", "lstm", "time_distributed", "lm")
DEFAULT_EXAMPLE = "digits"
# What a task's own code raises about its settings, files or imports (its model, its inputs, the libraries
# it calls): said in one line too, as estimax's own errors are. estimax raises only EstimaxErrors for these.
TASK_ERRORS = (ValueError, TypeError, FileNotFoundError, ImportError)
FLAG_DEFAULTS = "A run setting not given takes the task's DEFAULTS entry, else RunConfig's default."
DOCS_EPILOG = (
    "Documentation: docs/ in the source tree, as a site with `pip install '.[docs]' && mkdocs serve` there: "
    "docs/getting-started.md, docs/guides/command-line.md (every flag), docs/guides/task-modules.md (your own "
    "program)."
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="estimax", description=__doc__.splitlines()[0], epilog=DOCS_EPILOG)
    parser.add_argument("--version", action=_Version, help="show the versions of estimax, Python, jax and flax")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in (
        ("train", "train, then evaluate the held-out input"),
        ("evaluate", "evaluate the latest checkpoint on the held-out input"),
        ("predict", "predict the held-out input with the latest checkpoint"),
        ("export", "write a checkpoint as a self-contained artifact (estimax serve, estimax.serving.load)"),
    ):
        sub = commands.add_parser(
            name, help=help_text, description=f"{help_text.capitalize()}. {FLAG_DEFAULTS}", epilog=DOCS_EPILOG
        )
        add_task_arguments(sub, name)
        if name == "train":
            length = sub.add_mutually_exclusive_group()
            length.add_argument("--max-steps", type=non_negative_int, help="train until this step")
            length.add_argument("--epochs", type=positive_int, help="train until N epochs are done (counted from 0)")
            sub.add_argument("--eval-every", type=positive_int, help="also evaluate every N steps")
            sub.add_argument(
                "--warm-start", metavar="DIR", help="start a new run from the parameters of the run in DIR that fit"
            )
        if name == "evaluate":
            _follow_arguments(sub)
        if name == "predict":
            sub.add_argument(
                "--input", metavar="FILE", help=f"predict this file instead ({', '.join(predict_file.FORMATS)})"
            )
            sub.add_argument("--output", help="write one JSON line per example here (default: a summary)")
        if name == "export":
            sub.add_argument("--output", required=True, help="the artifact's directory, e.g. exports/digits")
            sub.add_argument("--checkpoint", help="STEP of the model dir or a checkpoint PATH (default: the latest)")
            sub.add_argument(
                "--base-artifact",
                metavar="DIR",
                help="a LoRA run: write the adapters alone, on this export of the base they were trained on",
            )
    launch = commands.add_parser(
        "launch",
        help="run a command as N processes on this machine, restarting the group on failure",
        usage="estimax launch --num-processes N [--devices-per-process D] [--max-restarts R] -- COMMAND ...",
    )
    _launch_arguments(launch)
    from estimax.serving import server

    server.add_arguments(commands.add_parser("serve", help="serve an exported model over TF Serving's REST API"))
    return parser


def add_task_arguments(sub: argparse.ArgumentParser, command: str) -> None:
    """The task, the run-setting flags of ``command`` and the multi-process flags (any command taking a task)."""
    sub.add_argument("task", nargs="?", help="a task module (my_project.task) or .py file (default: --example)")
    sub.add_argument("--example", choices=EXAMPLES, help="a bundled task (default: digits)")
    sub.add_argument("--data", choices=("digits", "mnist"), help="--data mnist is --example mnist")
    sub.add_argument("--data-dir", help="--set data_dir=DIR, for tasks that read files (--example mnist, lm)")
    sub.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", type=_assignment, help="override params[NAME]"
    )
    sub.add_argument(
        "--model-dir",
        help="the run's directory (default: under runs/<task>: a new numbered run for a changed model; "
        "evaluate, predict and export take the latest)",
    )
    for run_flag in RUN_FLAGS:
        if command in run_flag.commands:
            sub.add_argument(*run_flag.flags, dest=run_flag.field, help=run_flag.help, **run_flag.options)
    sub.add_argument("--fsdp", type=positive_int, help="shard parameters and optimizer state over N devices")
    sub.add_argument("--debug", action="store_true", help="show the traceback of an error")
    group = sub.add_argument_group("many processes (default: the ESTIMAX_* variables, or JAX's detection)")
    group.add_argument("--coordinator", help="host:port of process 0 (ESTIMAX_COORDINATOR)")
    group.add_argument("--num-processes", type=positive_int, help="processes in the group (ESTIMAX_NUM_PROCESSES)")
    group.add_argument("--process-id", type=non_negative_int, help="this process's index (ESTIMAX_PROCESS_ID)")


def _follow_arguments(sub: argparse.ArgumentParser) -> None:
    group = sub.add_argument_group("following a run (docs/guides/evaluating-while-training.md)")
    group.add_argument(
        "--follow", action="store_true", help="evaluate every checkpoint the run commits, until training ends"
    )
    group.add_argument("--eval-set", metavar="NAME", help="the evaluation set's name: records, TensorBoard (eval)")
    group.add_argument("--newest-only", action="store_true", help="when behind, evaluate the newest checkpoint only")
    group.add_argument("--poll-seconds", type=_positive_seconds, help="look for a new checkpoint this often (10)")
    group.add_argument("--hold-seconds", type=_positive_seconds, help="keep unread steps this long after a stop (120)")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"received {text!r}; expected a number of seconds above 0, e.g. 10")
    return value


def _assignment(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name.strip():
        raise argparse.ArgumentTypeError(f"received {text!r}; expected NAME=VALUE, e.g. --set learning_rate=0.01")
    return name.strip(), value


def _launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-processes", type=positive_int, required=True, help="processes to start on 127.0.0.1")
    parser.add_argument(
        "--devices-per-process", type=positive_int, help="simulate D CPU devices in each process (default: real ones)"
    )
    parser.add_argument(
        "--max-restarts", type=non_negative_int, default=0, help="restart the group from its checkpoint up to R times"
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
    from estimax.cli.launch import launch

    try:
        return launch(
            command, args.num_processes, devices_per_process=args.devices_per_process, max_restarts=args.max_restarts
        )
    except ConfigError as error:
        parser.error(str(error))


def check_arguments(args: argparse.Namespace) -> None:
    """What argparse cannot see alone: flags that exclude or need each other. Exits 2 before any import."""

    def error(message: str):
        print(f"estimax {args.command}: error: {message}", file=sys.stderr)
        raise SystemExit(USER_ERROR_EXIT_CODE)

    if args.task and (args.example or args.data):
        error(f"received the task {args.task!r} and --example/--data; expected one of them")
    if args.example and args.data and args.example != args.data:
        error(f"received --example {args.example} and --data {args.data}; expected one of them")
    if not args.task:
        args.task = f"estimax.examples.{args.data or args.example or DEFAULT_EXAMPLE}"
    if args.process_id is not None and args.num_processes is not None and args.process_id >= args.num_processes:
        error(
            f"--process-id {args.process_id} with --num-processes {args.num_processes}; expected 0 to "
            f"{args.num_processes - 1}"
        )
    following = [f for f in ("eval_set", "newest_only", "poll_seconds", "hold_seconds") if getattr(args, f, None)]
    if following and not getattr(args, "follow", False):
        error(f"--{following[0].replace('_', '-')} without --follow; expected it with --follow")
    names = [name for name, _ in args.set]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        error(f"--set {', '.join(repeated)} given more than once; expected each name once")
    if getattr(args, "input", None):
        try:
            predict_file.check(args.input)
        except ConfigError as problem:
            error(str(problem))
    try:
        task_lib.check_sets(args.task, args.set)  # from the task's source: before its imports (JAX)
    except ConfigError as problem:
        error(str(problem))


def main(argv: list[str] | None = None) -> int:
    """The ``estimax`` command on ``argv``. As the program itself (no ``argv``: ``sys.argv``), it
    ends the process at once when the command is done (``exit_now``)."""
    if argv is not None:
        return _command(list(argv))
    exit_now(_command(sys.argv[1:]))


def exit_now(code: int) -> NoReturn:
    """Ends the process with ``code`` once everything is written, without the interpreter's teardown,
    where tearing down JAX's runtime takes 0.5 s on an idle 2-core machine and seconds under load.
    The exit handlers run first (logging's flush, JAX's, Orbax's, multiprocessing's). With a thread
    still alive (it may be writing), the usual exit waits for it instead."""
    import atexit
    import os
    import threading

    if threading.active_count() > 1:
        sys.exit(code)
    atexit._run_exitfuncs()  # what the interpreter runs at exit, before its teardown
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _command(argv: list[str]) -> int:
    if argv[:1] == ["launch"]:
        return _launch(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":  # the artifact only: no task, no model code, no Flax
            from estimax.serving import server

            return server.main(args)
        check_arguments(args)
        from estimax.cli import commands

        return commands.run(args)
    except (EstimaxError, *TASK_ERRORS) as error:
        if getattr(args, "debug", False):
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"estimax: error: {message} (--debug shows the traceback)", file=sys.stderr)
        # The kind's own status: 2 for a mistake, 74 for a store that stopped answering (EX_IOERR).
        return error.exit_code if isinstance(error, EstimaxError) else USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:  # a third Ctrl-C (two stop and save): at once, without a traceback
        if args.debug:
            raise
        print("estimax: interrupted: stopped at once; the checkpoints already written are kept.", file=sys.stderr)
        return 128 + signal.SIGINT


class _Version(argparse.Action):
    """``--version``: ``estimax X (Python Y, jax Z, flax W)`` from the installed metadata, without importing JAX."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib import metadata

        from estimax import __version__

        def installed(name: str) -> str:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                return "not installed"

        python = sys.version.split()[0]
        print(f"estimax {__version__} (Python {python}, jax {installed('jax')}, flax {installed('flax')})")
        parser.exit()
