"""The input side of an Estimator: which batches each verb gets, and where they go.

Owns, for ``train``, ``evaluate`` and ``predict``: the global and host batch
sizes of each mode with one divisibility rule and one suggestion; how many
steps a train call runs and what an epoch is; turning an input into batches on
the mesh, placed with the layout's shardings (evaluation batches padded and
masked); the training input's position across processes (gathered from every
process for a checkpoint, handed back to each, and refused when a stream
cannot continue in another shape); and the feature shapes of the last input
seen, which ``export()`` traces with. Does not own reading formats (the
sources), stacking host batches and prefetching (``feed.py``), nor the
device loops.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator

import jax
import numpy as np

from estimax import counting
from estimax import mesh as mesh_lib
from estimax.data import feed
from estimax.data.source import ChunkSizes, SizedSource, Source
from estimax.errors import ConfigError, EstimaxError, EvaluationError, InputError, InputKindError, one_line
from estimax.spec import EVAL, TRAIN, Mode

logger = logging.getLogger("estimax")

POSITIONS = "estimax.input_positions/1"
"""The format of the training input's position as a checkpoint saves it: every process's."""


def feature_spec(features, leading_axes: int = 1):
    """The per-example shapes and dtypes of ``features`` (the first ``leading_axes`` axes dropped)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[leading_axes:], x.dtype), features)


def describe_input(input) -> str:
    """What kind of input this is, as an error names it."""
    kind = getattr(input, "kind", None)
    if kind:
        return kind
    if isinstance(input, Source):
        return type(input).__name__
    return f"a plain iterable of batches ({type(input).__name__})"


class InputPlan:
    """The batches of one Estimator's verbs.

    Args:
      config: the ``RunConfig`` (batch sizes, ``grad_accum_steps``, seed, ``steps_per_loop``).
      layout: the ``Layout``; batches go where ``layout.batch`` / ``layout.stack`` say.
      sync: the group's ``Sync``, which gathers every process's input position for a checkpoint.
    """

    def __init__(self, config, layout, sync):
        self.config, self.layout, self.sync = config, layout, sync
        self.process_count, self.process_index = jax.process_count(), jax.process_index()
        axes = mesh_lib.batch_axes(layout.mesh)
        self._axes = " x ".join(f"{a}={layout.mesh.shape[a]}" for a in axes)
        self._single_data_axis = axes == (mesh_lib.DATA_AXIS,)
        self.batch_shards = math.prod(layout.mesh.shape[a] for a in axes)
        self.features = None  # per-example ShapeDtypeStructs of the last input seen

    # -- sizes ------------------------------------------------------------------
    def global_batch(self, mode: Mode) -> int:
        cfg = self.config
        return {TRAIN: cfg.train_batch_size, EVAL: cfg.global_eval_batch_size}.get(mode, cfg.global_predict_batch_size)

    def host_batch(self, mode: Mode) -> int:
        return self.global_batch(mode) // self.process_count

    def multiple(self, mode: Mode) -> int:
        """What a global batch of ``mode`` must be a multiple of: every micro-batch splits over
        the batch shards and over the processes."""
        micro = self.config.grad_accum_steps if mode == TRAIN else 1
        return micro * math.lcm(self.batch_shards, self.process_count)

    def check(self, *modes: Mode) -> None:
        """Raises ``ConfigError`` unless each mode's global batch is a multiple of ``multiple(mode)``,
        naming the nearest sizes that are."""
        for mode in modes:
            size, multiple = self.global_batch(mode), self.multiple(mode)
            if size % multiple == 0:
                continue
            name = {TRAIN: "train_batch_size", EVAL: "eval_batch_size"}.get(mode, "predict_batch_size")
            nearest = counting.nearest_multiples(size, multiple)
            split_more = math.lcm(self.batch_shards, self.process_count) != self.batch_shards
            processes = f" and {self.process_count} processes" if split_more else ""
            micro = self.config.grad_accum_steps if mode == TRAIN else 1
            if micro > 1:
                raise ConfigError(
                    f"RunConfig(train_batch_size={size}) with grad_accum_steps={micro} does not split into "
                    f"{micro} micro-batches over the {self.batch_shards} batch shards{processes}; expected a "
                    f"multiple of {micro} x {multiple // micro} = {multiple}. Fix: use train_batch_size {nearest}, "
                    "or another grad_accum_steps."
                )
            over = "the data axis" if self._single_data_axis else f"the batch axes {self._axes}"
            raise ConfigError(
                f"RunConfig({name}={size}) does not divide the {self.batch_shards} devices of {over}"
                f"{processes}; expected a multiple of {multiple}. Fix: use {nearest}."
            )

    # -- training -----------------------------------------------------------------
    def steps_per_epoch(self, input, required: bool = True) -> int | None:
        """Full global batches in one pass over ``input``; ``None`` (or an error, if ``required``)
        for an input of unknown size."""
        if not isinstance(input, SizedSource):
            if not required:
                return None
            raise InputKindError(
                f"Counting in epochs needs an input of known size, e.g. estimax.data.from_arrays; "
                f"received {type(input).__name__}. Fix: count in steps instead (max_steps, eval_every=<steps>)."
            )
        return input.steps_per_epoch(self.host_batch(TRAIN), self.process_count)

    def target_step(self, start: int, max_steps, steps, epochs, input) -> tuple[int, int | None]:
        """``(the step a train call stops at, steps per epoch or None)``."""
        given = {k: v for k, v in (("max_steps", max_steps), ("steps", steps), ("epochs", epochs)) if v is not None}
        if len(given) != 1:
            raise ConfigError(
                f"train() received {given or 'none of max_steps, steps, epochs'}; "
                "expected exactly one of them, e.g. `train(data, max_steps=1000)`."
            )
        ((name, value),) = given.items()
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"train({name}={value!r}) must be a non-negative integer.")
        per_epoch = self.steps_per_epoch(input, required=name == "epochs")
        if name == "max_steps":
            return value, per_epoch
        if name == "steps":
            return start + value, per_epoch
        assert per_epoch is not None  # required for epochs: steps_per_epoch raised otherwise
        global_batch = self.global_batch(TRAIN)
        logger.info(
            "An epoch is %d steps of %d examples; %d examples per epoch are dropped (drop_remainder).",
            per_epoch,
            global_batch,
            len(input) - per_epoch * global_batch,
        )
        return value * per_epoch, per_epoch

    def train_chunks(self, input, start: int, target: int, position=None) -> Iterator[feed.DeviceChunk]:
        """Stacks of ``steps_per_loop`` global training batches on the mesh, from step ``start`` to
        ``target``, each with this process's input position after it.

        ``position``: where the input stood at ``start``: a checkpoint's (every process's, as
        ``saved_position`` gave it) or this process's own from the call before.
        """
        stacks = feed.train_stacks(
            input,
            self.host_batch(TRAIN),
            ChunkSizes(start, target, self.config.steps_per_loop),
            seed=self.config.seed,
            start_step=start,
            input_state=self._own_position(input, position, start),
        )
        return self._noting_features(self._placed_stacks(stacks), leading_axes=2)

    def _placed_stacks(self, stacks: feed.Stacks) -> Iterator[feed.DeviceChunk]:
        # The position is read right after each stack is drawn, before any later stack is.
        global_batch = self.global_batch(TRAIN)
        for stack in stacks:
            num_steps = jax.tree.leaves(stack)[0].shape[0]
            placed = mesh_lib.to_global(stack, self.layout.stack, global_batch)
            yield feed.DeviceChunk(placed, num_steps, stacks.input_state)

    def saved_position(self, position):
        """What a checkpoint saves of the training input's position: every process's (a collective:
        every process calls it at the same save), or ``None`` where the step alone says it."""
        if position is None:
            return None
        positions = [json.loads(p) for p in self.sync.gather("the input positions", json.dumps(position))]
        return {"format": POSITIONS, "processes": self.process_count, "positions": positions}

    def _own_position(self, input, position, start: int):
        """This process's part of ``position``; refuses a stream whose position was saved by
        another number of processes."""
        if not (isinstance(position, dict) and position.get("format") == POSITIONS):
            return position  # this process's own, or a checkpoint of one process from an earlier release
        saved = position["processes"]
        if saved == self.process_count:
            return position["positions"][self.process_index]
        raise InputError(
            f"The training input is {describe_input(input)}: a stream whose position at step {start} was saved "
            f"by {saved} processes, and this run has {self.process_count}; a stream cannot be split anew at a "
            f"position. Fix: resume with {saved} processes, or train from a random-access input, which continues "
            "at the next example in any shape (ex.data.from_arrays, ex.data.from_grain(MapDataset), the file "
            "readers, ex.data.from_hf of a map-style Dataset)."
        )

    def check_resize(self, input, saved_processes: int | None, start: int) -> None:
        """Refuses, before the first step, an input that cannot continue exactly after the number
        of processes changed since the checkpoint of ``start`` (``saved_processes``)."""
        if saved_processes in (None, self.process_count) or isinstance(input, Source):
            return  # random-access sources seek by step; streams are checked against their saved position
        raise InputError(
            f"The training input is {describe_input(input)}, whose position estimax cannot know, and the "
            f"checkpoint of step {start} was trained by {saved_processes} processes; this run has "
            f"{self.process_count}, so each process's iterable would not continue where that run stopped. "
            "Fix: resume with the same number of processes, or train from a random-access input, which "
            "continues at the next example in any shape (ex.data.from_arrays, ex.data.from_grain(MapDataset), "
            "the file readers)."
        )

    # -- evaluation and prediction --------------------------------------------------
    def eval_batches(self, input, mode: Mode = EVAL) -> Iterator[feed.DeviceBatch]:
        """Every example of ``input`` once, in global batches of ``mode`` padded and masked on the
        mesh; the same number of batches on every process. Evaluation input errors name the input."""
        self.check(mode)
        batches = iter(feed.eval_batches(input, self.host_batch(mode)))
        if mode == EVAL:
            batches = _named_input(batches)
        return self._noting_features(self._placed_batches(batches, mode), leading_axes=1)

    def _placed_batches(self, batches: Iterator, mode: Mode) -> Iterator[feed.DeviceBatch]:
        check, host_size, global_batch = feed.BatchChecker(), self.host_batch(mode), self.global_batch(mode)
        for batch in batches:
            batch = check(batch)
            rows = feed.rows(batch)
            if rows > host_size:
                raise InputError(
                    f"Input batch has {rows} rows; expected at most the host batch size "
                    f"{host_size} (eval/predict batch size / process count)."
                )
            padded = jax.tree.map(lambda x, n=host_size - rows: np.pad(x, [(0, n)] + [(0, 0)] * (x.ndim - 1)), batch)
            mask = np.arange(host_size) < rows
            on_mesh = mesh_lib.to_global((padded, mask), self.layout.batch, global_batch)
            yield feed.DeviceBatch(on_mesh[0], on_mesh[1], rows, rows < host_size)

    # -- export --------------------------------------------------------------------
    def export_features(self, example_features=None):
        """Per-example feature shapes for ``export()``: those of ``example_features`` (a batch, its
        ``ShapeDtypeStruct``s, or an ``ex.data.from_arrays`` dataset), else of the last input seen."""
        if example_features is not None:
            return feature_spec(getattr(example_features, "features", example_features))
        if self.features is None:
            raise ConfigError(
                "export() needs the shape and dtype of each feature, and this Estimator has not seen any input "
                "yet. Fix: pass a batch, e.g. `est.export(path, example_features={'image': images[:1]})`, or "
                "call train/evaluate/predict first."
            )
        return self.features

    def _noting_features(self, items: Iterator, leading_axes: int) -> Iterator:
        """``items`` unchanged; the first one's feature shapes become ``features``."""
        for i, item in enumerate(items):
            if i == 0:
                self.features = feature_spec((item.stack if leading_axes == 2 else item.batch)[0], leading_axes)
            yield item


def _named_input(batches: Iterator) -> Iterator:
    """The evaluation input's batches; an error reading them names the input and how far it got."""
    count = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (EstimaxError, TypeError, ValueError):
            raise  # the input checks' own errors name the example and the fix already
        except Exception as error:
            raise EvaluationError(
                f"The evaluation input raised {one_line(error)} reading batch {count + 1} "
                f"(after {count} batches). Fix: correct the evaluation input, or evaluate fewer batches (steps=)."
            ) from error
        count += 1
        yield batch
