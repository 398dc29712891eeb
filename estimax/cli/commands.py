"""What ``estimax train``, ``evaluate``, ``predict`` and ``export`` do, once the arguments are parsed and checked.

Owns joining the process group, loading the task, building its ``RunConfig``
from the flags (``flags.RUN_FLAGS``), the task's ``DEFAULTS`` and RunConfig's
own defaults, building the Estimator in the run directory ``runs.py`` chooses
(the model's digest tells it whether a checkpoint can fit), and running the
command. Owns no argument parsing (``entry.py``), no convention (``task.py``)
and no choice of run (``runs.py``). Imported only after the arguments are known
to be well-formed: importing it imports JAX.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import time

import jax

from estimax import compile_cache, distributed, fingerprint, storage
from estimax.cli import predict_file, runs
from estimax.cli import task as task_lib
from estimax.cli.flags import RUN_FLAGS, with_fsdp
from estimax.config import RunConfig
from estimax.data import feed
from estimax.errors import CheckpointError, ConfigError, ModelFnError
from estimax.follow import FollowPolicy
from estimax.run.warm_start import WarmStart
from estimax.spec import EVAL

logger = logging.getLogger("estimax")

COMMAND_DEFAULTS = ("max_steps", "eval_every", "model_dir")  # DEFAULTS that are no RunConfig field


def run(args: argparse.Namespace) -> int:
    """One task command, once the arguments are known to be well-formed."""
    # Before anything touches devices: the mesh then spans every process's devices.
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    compile_cache.enable(compile_cache.default_directory())  # a second command does not compile again
    given = dict(args.set)  # and --data-dir: what this command line says of the params
    task = task_lib.load(args.task, given)
    if args.data_dir is not None:
        if "data_dir" not in task.params:  # never silently ignored: case 8 of issue 13 trained digits
            raise ConfigError(
                f"--data-dir {args.data_dir}: task {task.name!r} reads no data directory (its params have no "
                f"data_dir); expected a task that does, e.g. `estimax {args.command} --data mnist --data-dir "
                f"{args.data_dir}`."
            )
        given["data_dir"] = args.data_dir
    defaults = task.defaults
    known = {name for run_flag in RUN_FLAGS for name in run_flag.names} | set(COMMAND_DEFAULTS)
    if set(defaults) - known:
        raise ConfigError(
            f"Task {task.name!r}: DEFAULTS has {sorted(set(defaults) - known)}; expected run settings "
            f"named like their flags: {', '.join(sorted(known))}."
        )
    settings = {}
    for run_flag in RUN_FLAGS:
        value = getattr(args, run_flag.field, None)
        if value is None:
            value = next((defaults[name] for name in run_flag.names if name in defaults), None)
        if value is not None:
            settings[run_flag.field] = value
    if args.fsdp is not None:
        settings["mesh"] = with_fsdp(settings.get("mesh"), args.fsdp)
    first = jax.process_index() == 0  # process 0 speaks for the group
    root = storage.resolve(args.model_dir or defaults.get("model_dir") or os.path.join("runs", task.name))
    typed = functools.partial(task_lib.override, task.module.params)  # --set values (text) -> the params
    choice = runs.RunChoice(root, args.model_dir is not None, args.command == "train", typed, given)
    fitting = _Fitting(args, task, RunConfig(**settings))
    with _naming_set(args.set, "the model_fn fails", only=ModelFnError):
        choice.settle(fitting.differs)  # the run this code trained, or a new one
        task, estimator = fitting.built(choice.model_dir, choice.sets)
        if choice.said:  # once an Estimator is built: its console shows the line
            logger.info("%s", choice.said)
        if args.command == "train" and first:
            step = fitting.computation(choice.sets)
            arrays, step = fitting.arrays(choice.sets), step.to_json() if step is not None else None
            runs.write(choice.model_dir, runs.Remembered(choice.sets, runs.as_json(task.params), arrays, step))
        return COMMANDS[args.command](args, task, estimator, first)


class _Fitting:
    """Builds the Estimator of a run directory and ``--set`` values, and says what differs between a
    run and this code (its arrays; its training step on the train input, or on the batch the run
    recorded for the commands that do not train). The last Estimator built is kept for the command."""

    def __init__(self, args, task: task_lib.Task, config: RunConfig):
        self.args, self.task, self.config = args, task, config
        self._last: tuple | None = None  # (model_dir, sets, task, estimator)
        self._computations: dict = {}  # (sets, the recorded batch) -> this code's Computation on it

    def built(self, model_dir: str, sets: dict) -> tuple:
        """``(task, estimator)`` with ``sets`` in ``model_dir``."""
        if self._last is None or self._last[:2] != (model_dir, sets):
            task = self.task.with_sets(sets)
            self._last = (model_dir, sets, task, _estimator(self.args, task, self.config, model_dir))
        return self._last[2:]

    def arrays(self, sets: dict) -> str:
        return fingerprint.arrays_digest(self._any_built(sets)[1].state_shapes())

    def computation(self, sets: dict, recorded=None) -> fingerprint.Computation | None:
        """This code's training step on the train input, or on ``recorded`` (an encoded batch) if given."""
        key = (json.dumps(sets, sort_keys=True), json.dumps(recorded, sort_keys=True))
        if key not in self._computations:
            task, estimator = self._any_built(sets)
            if recorded is None:
                self._computations[key] = estimator.computation(task.input("train"))
            else:
                shapes = estimator.state_shapes()
                self._computations[key] = fingerprint.trace_recorded(estimator.core, shapes, estimator.mesh, recorded)
        return self._computations[key]

    def _any_built(self, sets: dict) -> tuple:
        """An Estimator of ``sets``, in whichever run directory: it does not change what it computes."""
        if self._last is not None and self._last[1] == sets:
            return self._last[2:]
        return self.built(self._last[0] if self._last is not None else self.args.model_dir, sets)

    def differs(self, run: str, sets: dict) -> str:
        """What differs between what trained ``run`` and this code with ``sets``; ``""``: it fits."""
        record = runs.read(run)
        _, estimator = self.built(run, sets)
        if estimator.run_dir.checkpoints.latest_step() is None:
            return runs.UNTRAINED
        if record is None:
            return ""  # trained without the command line: taken as it is
        if record.state != self.arrays(sets):
            return fingerprint.ARRAYS_DIFFER
        before = fingerprint.Computation.from_json(record.computation)
        if before is None:
            return ""  # recorded by an earlier release: the arrays decide
        now = self.computation(sets, None if self.args.command == "train" else before.batch)
        return "" if now is None else fingerprint.differences(before, now)


def _estimator(args, task: task_lib.Task, config: RunConfig, model_dir: str):
    warm_start = WarmStart(args.warm_start) if getattr(args, "warm_start", None) else None
    with _naming_set(args.set, "the model cannot be built"):
        return task.estimator(dataclasses.replace(config, model_dir=model_dir), warm_start=warm_start)


@contextlib.contextmanager
def _naming_set(assignments, what: str, only: type[BaseException] = Exception):
    """A model that fails with ``--set`` values names them: they are the likely cause."""
    try:
        yield
    except only as error:
        if not assignments or isinstance(error, ConfigError):
            raise
        given = " ".join(f"--set {name}={value}" for name, value in assignments)
        cause = (str(error).splitlines() or [""])[0].split(" Fix: ")[0].rstrip(" .;")  # its own fix is for code
        raise ConfigError(
            f"With {given}, {what}: {type(error).__name__}: {cause}. "
            "Fix: a value the model accepts, or leave the --set out for the task's default."
        ) from error


def train(args, task, estimator, first: bool) -> int:
    length = {"epochs": args.epochs} if args.epochs is not None else {"max_steps": _max_steps(args, task)}
    eval_every = args.eval_every or task.defaults.get("eval_every")
    profile = estimator.config.profile_steps
    if profile is not None and "max_steps" in length and profile[0] >= length["max_steps"]:
        raise ConfigError(
            f"--profile-steps {profile[0]}:{profile[1]} starts at or after max_steps {length['max_steps']}."
        )
    train_input, eval_input = task.input("train"), task.input("eval")
    if not eval_every:  # it evaluates after training: its eval mode is traced before step 1 too
        eval_input = estimator.check(EVAL, eval_input)
    start = time.perf_counter()
    if eval_every:
        results = estimator.train_and_evaluate(train_input, eval_input, eval_every=eval_every, **length)
    else:
        results = estimator.train(train_input, **length).evaluate(eval_input)
    if first:
        print(f"held-out {_held_out(results)} after {estimator.step} steps; {time.perf_counter() - start:.1f} s")
    return 0


def _held_out(results: dict) -> str:
    """``accuracy 0.9700 on 360 examples``, or for named evaluation sets each set's, named."""
    named = results if isinstance(next(iter(results.values())), dict) else {None: results}
    parts = []
    for set_name, values in named.items():
        name = next((n for n in ("accuracy", "bits_per_byte") if n in values), "loss")
        where = "" if set_name is None else f" of {set_name}"
        parts.append(f"{name} {values[name]:.4f} on {int(values['num_examples'])} examples{where}")
    return ", ".join(parts)


def _max_steps(args, task) -> int:
    max_steps = args.max_steps if args.max_steps is not None else task.defaults.get("max_steps")
    if max_steps is None:
        raise ConfigError(f"Task {task.name!r} sets no DEFAULTS['max_steps']; expected --max-steps N or --epochs N.")
    return max_steps


def _require_checkpoint(estimator) -> None:
    if estimator.step == 0:
        model_dir = estimator.run_dir.url
        raise CheckpointError(
            f"No checkpoint in {model_dir}: nothing trained to use; expected a model_dir that `estimax train` "
            f"wrote. Fix: `estimax train ... --model-dir {model_dir}` first, or pass the right --model-dir."
        )


def evaluate(args, task, estimator, first: bool) -> int:
    if args.follow:  # the trainer may not have saved yet: the follower waits for its first checkpoint
        return _follow(args, task, estimator, first)
    _require_checkpoint(estimator)
    results = estimator.evaluate(task.input("eval"))
    if first:
        print(json.dumps(results))
    return 0


def _follow(args, task, estimator, first: bool) -> int:
    """``evaluate --follow``: every checkpoint of the run, until training ends; prints the last record."""
    given = {"poll_seconds": args.poll_seconds, "hold_seconds": args.hold_seconds}
    policy = FollowPolicy(newest_only=args.newest_only, **{k: v for k, v in given.items() if v is not None})
    records = estimator.follow(task.input("eval"), name=args.eval_set or "eval", policy=policy)
    if first:
        print(json.dumps(records[-1] if records else {"evaluated": 0}))
    return 0


def predict(args, task, estimator, first: bool) -> int:
    _require_checkpoint(estimator)
    predict_input = task.input("predict")
    if args.input:
        predict_input = predict_file.read(args.input, _first_features(predict_input))
    # Every process takes part; process 0 receives every example, in input order, and writes it as it comes.
    labels = getattr(predict_input, "labels", None)
    count, matches = 0, None  # matches: of the predicted classes with the labels, where both exist
    writing = storage.writing(storage.expand(args.output)) if first and args.output else contextlib.nullcontext()
    with writing as out:
        for row in estimator.predict(predict_input, gather=True):
            record = task.prediction_record(row)
            if out is not None:
                out.write((json.dumps({"index": count, **_as_dict(record)}) + "\n").encode())
            if labels is not None and count < len(labels) and isinstance(record, dict) and "class" in record:
                matches = (matches or 0) + int(record["class"] == labels[count])
            count += 1
    if not first:
        return 0
    summary = f"{count} predictions"
    if matches is not None and len(labels) == count:
        summary += f", {matches} match the labels"
    print(summary + (f"; written to {args.output}" if args.output else ""))
    return 0


def export(args, task, estimator, first: bool) -> int:
    checkpoint = int(args.checkpoint) if (args.checkpoint or "").isdigit() else args.checkpoint
    if checkpoint is None:
        _require_checkpoint(estimator)
    features = _first_features(task.input("predict"))  # the shapes of the artifact's input
    path = estimator.export(
        args.output, checkpoint=checkpoint, example_features=features, base_artifact=args.base_artifact
    )
    if first:
        print(path)
    return 0


def _first_features(predict_input):
    """The features of the first example of ``predict_input`` (a batch of one)."""
    features, _ = next(iter(feed.eval_batches(predict_input, 1, shard=feed.Shard(0, 1))))
    return features


def _as_dict(record) -> dict:
    return record if isinstance(record, dict) else {"prediction": record}


COMMANDS = {"train": train, "evaluate": evaluate, "predict": predict, "export": export}
