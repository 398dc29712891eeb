"""Following a run: every checkpoint its trainer commits evaluated once, in step order, by a process of its own.

A ``Follower`` waits for the run's checkpoints (polling every ``poll_seconds``), evaluates each
committed step it has not evaluated yet through the Estimator's evaluation (restored into its
own mesh, whatever the trainer's), and writes one record per step to
``<model_dir>/evaluations/<set>.jsonl`` and the run's TensorBoard run (tags ``<set>/...``):
files of its own, never the trainer's. Its records are its progress: a follower started again carries on
after the last step they name, including the steps committed while it was down. It holds the
steps it has not read (``holds.py``), so that the trainer's keep-N does not delete them first.
It ends once the trainer's last call ended normally (``RunDir.ended``) and its last checkpoint
is evaluated. With ``newest_only``, a follower that is behind evaluates the newest step and
records the ones it skipped.

Owns the order of steps, the records file and the end. Does not own the evaluation itself
(``evaluator.py``, through the Estimator), the hold (``holds.py``) nor the run's layout
(``run_dir.py``). With several processes, process 0 decides each step and writes; every
process evaluates it (a collective).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import jax

from estimax import storage
from estimax.config import CheckpointPolicy
from estimax.errors import ConfigError
from estimax.records.writers import TensorBoardWriter, VersionedObject, format_values
from estimax.run.checkpoint import Checkpointer
from estimax.run.holds import Hold
from estimax.serving import export_base

logger = logging.getLogger("estimax")

EVALUATIONS = "evaluations"  # a model_dir's folder of followers' records, one file per evaluation set


@dataclasses.dataclass(frozen=True)
class FollowPolicy:
    """How a follower follows (``Estimator.follow(policy=...)``).

    Attributes:
      newest_only: when behind, evaluate only the newest committed step (the others are recorded as skipped).
      poll_seconds: how often to look for a new checkpoint.
      hold_seconds: how long the hold on unread steps outlives a follower that stopped renewing it
        (at least 3x ``poll_seconds``).
    """

    newest_only: bool = False
    poll_seconds: float = 10.0
    hold_seconds: float = 120.0

    def __post_init__(self):
        for field in ("poll_seconds", "hold_seconds"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"FollowPolicy({field}={value!r}); expected a number of seconds above 0.")
        if self.hold_seconds < 3 * self.poll_seconds:
            raise ConfigError(
                f"FollowPolicy(hold_seconds={self.hold_seconds:g}, poll_seconds={self.poll_seconds:g}): the hold "
                "would expire between two looks; expected hold_seconds at least 3x poll_seconds."
            )


@dataclasses.dataclass(frozen=True)
class Work:
    """What a follower does with each step, given by the Estimator.

    Attributes:
      restore: ``step -> state``, the committed step restored into the follower's mesh.
      evaluate: ``state -> results``, the Estimator's evaluation.
      best: ``estimax.Best``: the best state so far kept in ``evaluations/<set>-best/``; or ``None``.
      export: ``(state, path) -> path``, the Estimator's export; with ``export_base``.
      export_base: ``estimax.serving.export_base.ExportBase``: versions ``BASE/<step>/``; or ``None``.
    """

    restore: Callable[[int], Any]
    evaluate: Callable[[Any], dict]
    best: Any = None
    export: Callable[[Any, str], str] | None = None
    export_base: Any = None


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"follow(name={name!r}); expected a name of letters, digits, '-', '_' or '.', e.g. 'eval'.")
    return name


class Records:
    """``evaluations/<set>.jsonl``: one JSON line per step handled (evaluated, skipped or missed).

    On disk each record is appended whole (a line cut short by a kill is dropped when read);
    on a store the object is written whole, conditionally on the version read last.
    """

    def __init__(self, path: str):
        self.path = path
        self._object = VersionedObject(path) if storage.is_url(path) else None
        self._lines = self._read()

    def _read(self) -> list[str]:
        if self._object is not None:
            text = self._object.read().decode()
        else:
            text = storage.read_bytes(self.path).decode() if storage.exists(self.path) else ""
        lines = [line + "\n" for line in text.split("\n")[:-1]]  # a last line without its newline: cut short
        if self._object is None and text and not text.endswith("\n"):
            storage.write_bytes(self.path, "".join(lines).encode())
        return lines

    def all(self) -> list[dict]:
        return [json.loads(line) for line in self._lines]

    def handled_through(self) -> int:
        """The last step handled (evaluated, skipped or missed); -1 before the first."""
        steps = [-1]
        for record in self.all():
            steps += [record["step"], *record.get("skipped", ())]
        return max(steps)

    def append(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        if self._object is not None:
            self._object.write("".join([*self._lines, line]).encode())
        else:
            storage.makedirs(storage.parent(self.path))
            with open(self.path, "a") as f:
                f.write(line)
                f.flush()
        self._lines.append(line)


class Follower:
    """Follows the checkpoints of ``run_dir``.

    Args:
      run_dir: the run's ``RunDir``.
      work: what is done with each step (``Work``).
      name: the evaluation set: its records file, TensorBoard tags and hold are named after it.
      policy: a ``FollowPolicy``.
      sync: the group's ``Sync``: process 0's decision of each step on every process.
    """

    def __init__(self, run_dir, work: Work, name: str, policy: FollowPolicy, sync):
        if run_dir.url is None:
            raise ConfigError(
                "follow() needs a run to follow; received RunConfig(model_dir=None). Fix: the model_dir the "
                "trainer writes, e.g. RunConfig(model_dir='runs/x')."
            )
        base = work.export_base
        if base is not None and base.which == "best" and work.best is None:
            raise ConfigError(
                f"follow(export=ExportBase({base.path!r}, which='best')) without best=; expected best=ex.Best(metric) "
                "to say which checkpoint is the best. Fix: pass best=, or ExportBase(..., which='latest')."
            )
        self.run_dir, self.work, self.name, self.policy, self.sync = run_dir, work, check_name(name), policy, sync
        self.primary = jax.process_index() == 0
        self.written: list[dict] = []  # this call's records
        self._best_value: float | None = None
        self._best_checkpoints = None
        if work.best is not None and work.best.keep_checkpoint:
            self._best_checkpoints = Checkpointer(
                run_dir.path(EVALUATIONS, f"{name}-best"), CheckpointPolicy(every_steps=None, keep=1),
                best=(work.best.metric, work.best.direction),
            )  # fmt: skip

    def run(self) -> list[dict]:
        """Follows until training has ended and its last checkpoint is handled; returns this call's records."""
        records = hold = None
        if self.primary:
            records = Records(self.run_dir.path(EVALUATIONS, f"{self.name}.jsonl"))
            self._best_value = self._best_so_far(records.all())
            hold = Hold(self.run_dir.url, self.name, self.policy.hold_seconds)
            hold.take(records.handled_through() + 1)
        done = int(self.sync.share("the steps evaluated", str(records.handled_through() if records else "")))
        logger.info(
            "Following %s for %r%s from step %d: every %g s.", self.run_dir.url, self.name,
            " (the newest only)" if self.policy.newest_only else "", done + 1, self.policy.poll_seconds,
        )  # fmt: skip
        tensorboard = TensorBoardWriter(self.run_dir.tensorboard_dir) if self.primary else None
        with hold.keep_alive() if hold else contextlib.nullcontext():
            while True:
                if hold:
                    hold.check()
                plan = json.loads(self.sync.share("the next step to evaluate", json.dumps(self._next(done))))
                if plan["end"]:
                    break
                if plan["step"] is None:
                    time.sleep(self.policy.poll_seconds)
                    continue
                self._handle(plan["step"], plan["skipped"], records, hold, tensorboard)
                done = plan["step"]
        if self._best_checkpoints is not None:
            self._best_checkpoints.wait()
        ended = self.run_dir.ended() or {}
        logger.info("Training ended (last checkpoint %s) and every checkpoint is handled: the follower of %r ends.",
                    ended.get("checkpoint"), self.name)  # fmt: skip
        return self.written

    def _next(self, done: int) -> dict:
        """Process 0's choice: the next step after ``done``, the steps it skips, or the end."""
        if not self.primary:
            return {}
        ended = self.run_dir.ended()  # read before the listing: a checkpoint committed before the end is listed
        steps = [s for s in self._steps() if s > done]
        if not steps:
            return {"step": None, "skipped": [], "end": ended is not None}
        if self.policy.newest_only:
            return {"step": steps[-1], "skipped": steps[:-1], "end": False}
        return {"step": steps[0], "skipped": [], "end": False}

    def _handle(self, step: int, skipped: list[int], records, hold, tensorboard) -> None:
        if hold:
            hold.move(step)  # newest only: the steps skipped go; the one read stays
        if skipped:
            logger.warning(
                "Step %d is evaluated for %r; steps %s are skipped (newest only: the follower was behind).",
                step, self.name, ", ".join(map(str, skipped)),
            )  # fmt: skip
        committed_at = self._committed_at(step) if self.primary else None
        record: dict = {"split": self.name, "step": step}
        results: dict = {}
        try:
            state = self._restore(step)
        except Exception:
            if step in self._steps():
                raise
            logger.warning("Step %d was deleted before %r read it (its hold had expired): missed.", step, self.name)
            record["missed"] = True
        else:
            results = self.work.evaluate(state)
            record.update(results)
            record.update(self._keep(step, state, results))
        now = time.time()
        record.update(evaluated_at=now)
        if committed_at is not None:
            record.update(committed_at=committed_at, lag_seconds=now - committed_at)
        if skipped:
            record["skipped"] = skipped
        if self.primary:
            records.append(record)
            if results:
                tensorboard.write(self.name, step, results)
                lag = f" ({record['lag_seconds']:.1f} s after its commit)" if committed_at is not None else ""
                logger.info("%s step %d%s: %s", self.name, step, lag, format_values(results))
            hold.move(step + 1)
        self.written.append(record)

    def _steps(self) -> list[int]:
        """The committed steps; listed again when a step the trainer deleted meanwhile vanished under the listing."""
        for _ in range(3):
            with contextlib.suppress(FileNotFoundError):
                return self.run_dir.checkpoints.steps()
            time.sleep(0.1)
        return self.run_dir.checkpoints.steps()

    def _restore(self, step: int):
        """The state of ``step``; tried again when another step, deleted by the trainer meanwhile, vanished
        under the listing that comes before it (Orbax reads every step's folder)."""
        for _ in range(3):
            try:
                return self.work.restore(step)
            except FileNotFoundError:
                if step not in self._steps():
                    raise
                time.sleep(0.1)
        return self.work.restore(step)

    def _keep(self, step: int, state, results: dict) -> dict:
        """The best checkpoint and the export of ``step``'s state, where asked; what the record says of them."""
        best, base, said = self.work.best, self.work.export_base, {}
        improved = False
        if best is not None:
            if best.metric not in results:
                raise ConfigError(
                    f"Best(metric={best.metric!r}) is not among the evaluation's results {sorted(results)}; "
                    "expected one of them. Fix: pass one of those names."
                )
            value = results[best.metric]
            before = self._best_value
            improved = before is None or (value > before if best.direction == "max" else value < before)
            improved = self.sync.share(f"whether step {step} is the best", "1" if improved else "") == "1"
            if improved:
                self._best_value, said["best"] = value, True
                if self._best_checkpoints is not None:
                    self._best_checkpoints.save(step, state, metrics=results)
        if base is not None and (base.which == "latest" or improved):
            said["exported"] = self.work.export(state, base.version(step))
            if self.primary:
                export_base.prune(base.path, base.keep)
        return said

    def _best_so_far(self, records: list[dict]) -> float | None:
        best = self.work.best
        if best is None:
            return None
        values = [r[best.metric] for r in records if isinstance(r.get(best.metric), int | float)]
        if not values:
            return None
        return max(values) if best.direction == "max" else min(values)

    def _committed_at(self, step: int) -> float | None:
        """When the trainer committed ``step`` (Orbax's commit time), or ``None`` where it cannot be read."""
        path = storage.join(self.run_dir.checkpoints.directory, str(step), "_CHECKPOINT_METADATA")
        with contextlib.suppress(Exception):
            return json.loads(storage.read_bytes(path))["commit_timestamp_nsecs"] / 1e9
        return None
