"""The run-setting flags of the ``estimax`` command: one line per ``RunConfig`` field it sets.

Each flag is named after its field (``--train-batch-size`` sets
``train_batch_size``); the shorter names of earlier releases stay as aliases
(``--batch-size``). A task's ``DEFAULTS`` may use either name. Owns the table
and the argument types (checked without importing JAX); does not own parsing
(``entry.py``) nor what a command does with the settings (``commands.py``).
"""

from __future__ import annotations

import argparse
import dataclasses

from estimax.config import EMA_WARMUPS, EVAL_WEIGHTS, LOOP_KINDS
from estimax.records.tracker_kinds import TRACKERS

TASK_COMMANDS = ("train", "evaluate", "predict", "export")  # the commands that take a task
TRAIN = ("train",)


def positive_int(text: str) -> int:
    return _int(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _int(text, 0, "an integer >= 0")


def _int(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise argparse.ArgumentTypeError(f"received {text!r}; expected {what}")
    return value


def step_range(text: str) -> tuple[int, int]:
    """``A:B`` with ``0 <= A < B``."""
    parts = text.split(":")
    try:
        start, stop = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        start = stop = None
    if start is None or not 0 <= start < stop:
        raise argparse.ArgumentTypeError(f"received {text!r}; expected A:B with 0 <= A < B, e.g. 100:110")
    return start, stop


def tracker(text: str) -> str:
    """``mlflow`` or ``mlflow=URI`` (``TRACKERS``)."""
    if text.partition("=")[0] not in TRACKERS:
        raise argparse.ArgumentTypeError(
            f"received {text!r}; expected one of {', '.join(TRACKERS)}, e.g. mlflow=http://host:5000"
        )
    return text


def mesh_axes(text: str) -> dict[str, int]:
    """``data=4,model=2`` as ``RunConfig(mesh=...)`` (a size ``-1``: the rest of the devices)."""
    axes = {}
    for item in text.split(","):
        name, equals, size = item.partition("=")
        if not equals or not name.strip() or not size.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"received {text!r}; expected name=size pairs, e.g. data=4,model=2")
        axes[name.strip()] = int(size)
    return axes


def with_fsdp(mesh: dict[str, int] | None, fsdp: int) -> dict[str, int]:
    """``mesh`` with an ``fsdp`` axis of ``fsdp`` devices (``--fsdp``); ``data`` takes the rest unless sized."""
    mesh = {**(mesh or {}), "fsdp": fsdp}
    return mesh if "data" in mesh or -1 in mesh.values() else {"data": -1, **mesh}


@dataclasses.dataclass(frozen=True)
class RunFlag:
    """``--<field>`` sets ``RunConfig.<field>``; unset, the task's ``DEFAULTS`` entry or RunConfig's default."""

    field: str
    help: str
    options: dict = dataclasses.field(default_factory=dict)  # argparse options: type, choices, action
    commands: tuple[str, ...] = TASK_COMMANDS
    aliases: tuple[str, ...] = ()  # the names of earlier releases, e.g. "batch_size"

    @property
    def flags(self) -> list[str]:
        return ["--" + name.replace("_", "-") for name in (self.field, *self.aliases)]

    @property
    def names(self) -> tuple[str, ...]:
        """What a task's ``DEFAULTS`` may call it."""
        return (self.field, *self.aliases)


RUN_FLAGS = (
    RunFlag("train_batch_size", "global batch of a training step", {"type": positive_int}, aliases=("batch_size",)),
    RunFlag("eval_batch_size", "batch of evaluation and prediction", {"type": positive_int}),
    RunFlag("seed", "initialisation, dropout and shuffling seed", {"type": non_negative_int}),
    RunFlag("mesh", "device mesh, e.g. data=4,model=2 (-1: the rest)", {"type": mesh_axes}),
    RunFlag("steps_per_loop", "training steps per host round trip", {"type": positive_int}, TRAIN),
    RunFlag("loop", "device loop mode", {"choices": LOOP_KINDS}, TRAIN),
    RunFlag("log_every_steps", "a train log line every N steps", {"type": positive_int}, TRAIN, ("log_every",)),
    RunFlag("grad_accum_steps", "micro-batches per step (accumulated)", {"type": positive_int}, TRAIN, ("grad_accum",)),
    RunFlag("profile_steps", "A:B: trace steps A to B", {"type": step_range}, TRAIN),
    RunFlag("quiet", "no progress bar and no train log lines", {"action": "store_true", "default": None}),
    RunFlag("tokens_per_example", "tokens in one example: adds tokens/s", {"type": positive_int}, TRAIN),
    RunFlag("ema_decay", "keep a moving average of the parameters, e.g. 0.999", {"type": float}),
    RunFlag("ema_warmup", "how the parameter average starts", {"choices": EMA_WARMUPS}, TRAIN),
    RunFlag("eval_weights", "evaluate, predict and export these weights", {"choices": EVAL_WEIGHTS}),
    RunFlag(
        "trackers", "mlflow, or mlflow=URI (server or dir)", {"type": tracker, "action": "append"}, aliases=("tracker",)
    ),
    RunFlag("freeze", "REGEX: parameters whose path matches do not train (repeatable)", {"action": "append"}, TRAIN),
)
