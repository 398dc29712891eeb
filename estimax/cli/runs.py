"""Which run directory a command uses, and what a run remembers of the command that trained it.

A run is the computation that made it. Under the default root (``runs/<task>``,
or the task's ``DEFAULTS["model_dir"]``) each computation is a run of its own,
numbered as it comes: ``runs/<task>``, then ``runs/<task>-2``, ``runs/<task>-3``...
``train`` continues the latest run of the same params, state arrays and
training step (``fingerprint.py``: an edit of the model, the loss or the
optimizer is another step), and otherwise starts the next number, saying in one
line what differs from the latest run; ``evaluate``, ``predict`` and ``export``
take the latest run whose ``--set`` values agree with those given and whose
arrays and training step this code has, or fail in one line naming each run and
what differs. An explicit ``--model-dir`` is used as it is.

Each run keeps, in ``cli.json`` beside its checkpoints, the ``--set`` values it
was trained with (as typed), the params they gave, a digest of the names and
shapes of its state's arrays and its training step's fingerprint: later
commands apply the same values, and refuse others, without being told. Owns the
numbering, that file and the choice of a run; does not own the rest of a run
directory (``run_dir.py``), building the model nor telling whether it fits a
run (``commands.py``). Imports no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable

from estimax import storage
from estimax.errors import ConfigError

logger = logging.getLogger("estimax")

RECORD = "cli.json"


@dataclasses.dataclass(frozen=True)
class Remembered:
    """What ``estimax train`` wrote into a run: its ``--set`` values, the params, the state's digest and
    the training step's fingerprint (``fingerprint.Computation.to_json``; ``None`` from earlier releases)."""

    sets: dict[str, str]
    params: dict
    state: str
    computation: dict | None = None

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True).encode()


def as_json(params: dict) -> dict:
    """``params`` as ``cli.json`` holds them (tuples as lists, other objects by ``repr``), to compare."""
    return json.loads(json.dumps(params, sort_keys=True, default=repr))


def read(model_dir: str) -> Remembered | None:
    """The run's ``cli.json``, or ``None`` (no run, or one trained without the command line); a
    ``ConfigError`` naming the file and what is wrong with it when it is damaged."""
    path = storage.join(model_dir, RECORD)
    if not storage.exists(path):
        return None
    content = storage.read_bytes(path)
    try:
        record = json.loads(content)
        problem = _shape_problem(record)
    except (ValueError, UnicodeDecodeError) as error:  # json's errors are ValueErrors
        problem = f"damaged: {error}"
    if problem is not None:
        what = "empty" if not content.strip() else problem
        raise ConfigError(
            f'{path} is {what}; expected the JSON object `estimax train` writes there ("sets", "params", '
            '"state"), which says how this run was trained. Fix: restore it, or delete it (the run\'s checkpoints '
            "stay; the command line then takes the run as trained without --set values)."
        )
    sets, params, state = record["sets"], record["params"], record["state"]
    computation = record.get("computation") if isinstance(record.get("computation"), dict) else None
    return Remembered({str(k): str(v) for k, v in sets.items()}, params, state, computation)


def _shape_problem(record) -> str | None:
    """What is wrong with a parsed ``cli.json`` (``"damaged: ..."``), or ``None``."""
    if not isinstance(record, dict):
        return f"damaged: a JSON {type(record).__name__}, not an object"
    if missing := sorted({"sets", "params", "state"} - record.keys()):
        return f"damaged: no {', '.join(map(repr, missing))}"
    if not (
        isinstance(record["sets"], dict) and isinstance(record["params"], dict) and isinstance(record["state"], str)
    ):
        return 'damaged: "sets" and "params" must be objects and "state" a string'
    return None


def _readable(run: str) -> Remembered | None:
    """``read(run)``, or ``None`` with a warning when its record is damaged: another run's damaged record
    never stops a command, which goes on to the runs whose records it can read."""
    try:
        return read(run)
    except ConfigError as error:
        logger.warning("Skipping %s: %s", run, error)
        return _DAMAGED


def write(model_dir: str, remembered: Remembered) -> None:
    storage.write_bytes(storage.join(model_dir, RECORD), remembered.to_json())


def runs(root: str) -> list[str]:
    """The runs under ``root``, oldest first: ``root`` itself, then ``root-2``, ``root-3``..."""
    parent, base = storage.parent(root), storage.name(root)
    numbered = re.compile(rf"{re.escape(base)}-([2-9]|[1-9]\d+)")
    found = {1: root} if storage.exists(root) else {}
    for name in storage.listdir(parent) if storage.exists(parent) else ():
        match = numbered.fullmatch(name)
        if match:
            found[int(match.group(1))] = storage.join(parent, name)
    return [found[n] for n in sorted(found)]


def next_run(root: str) -> str:
    """The directory of a new run under ``root``: ``root`` when there is none yet, else the next number."""
    existing = runs(root)
    if not existing:
        return root
    last = storage.name(existing[-1])
    number = int(last.rsplit("-", 1)[1]) if existing[-1] != root else 1
    return f"{root}-{number + 1}"


_DAMAGED = Remembered({}, {}, "")  # a run whose record cannot be read: no command takes it by itself


def describe(sets: dict[str, str]) -> str:
    """``--set a=1 --set b=2``, or ``no --set`` values."""
    return " ".join(f"--set {name}={value}" for name, value in sorted(sets.items())) or "no --set values"


UNTRAINED = "nothing trained yet"  # what a run without checkpoints lacks: a new run may take its directory
ARRAYS = "shapes: the state's arrays"  # how a difference of the arrays begins: no checkpoint of the run fits


class RunChoice:
    """The run a command uses under ``root`` and the ``--set`` values that come with it.

    ``typed(sets)`` gives the task's params with ``sets`` (text) applied; ``given`` are the
    values of this command line. The candidates are the runs of those values, newest first;
    ``settle(differs)`` chooses among them. ``model_dir`` and ``sets`` (remembered, then given)
    are the choice.
    """

    def __init__(self, root: str, explicit: bool, training: bool, typed: Callable[[dict], dict], given: dict):
        self.root, self.explicit, self.training, self.typed, self.given = root, explicit, training, typed, given
        if explicit:
            self.candidates = [root]
        else:
            accepts = self._same_params if training else self._agrees
            self.candidates = [
                run for run in reversed(runs(root)) if (record := _readable(run)) is not _DAMAGED and accepts(record)
            ]
            if not training and not self.candidates:
                self.candidates = [self._no_agreeing_run()]
        self._choose(self.candidates[0] if self.candidates else next_run(root))
        self.said = ""
        if explicit and self.record is not None and not self._agrees(self.record):
            changed = {n: v for n, v in given.items() if self.record.sets.get(n) != v}
            raise ConfigError(
                f"{describe(changed)}: {self.model_dir} was trained with {describe(self.record.sets)} (remembered "
                f"in its {RECORD}); expected the same values. Fix: leave the --set out, or {self._elsewhere()}"
            )

    def _choose(self, run: str) -> None:
        self.model_dir, self.record = run, read(run)
        self.sets = self.sets_of(self.record)

    def sets_of(self, record: Remembered | None) -> dict[str, str]:
        """The ``--set`` values a command uses in the run of ``record``: remembered, then given."""
        return {**(record.sets if record else {}), **self.given}

    def _agrees(self, record: Remembered | None) -> bool:
        """The values given change nothing in ``record``'s params (a run without a record: its defaults)."""
        sets = record.sets if record else {}
        return self.typed({**sets, **self.given}) == self.typed(sets)

    def _same_params(self, record: Remembered | None) -> bool:
        return record is None or record.params == as_json(self.typed(self.given))

    def _no_agreeing_run(self) -> str:
        existing = runs(self.root)
        if not existing:
            return self.root  # nothing trained: the command says so
        listed = "; ".join(f"{run}: {describe(getattr(_readable(run), 'sets', {}))}" for run in existing)
        raise ConfigError(
            f"{describe(self.given)}: no run under {self.root} was trained with these values ({listed}); "
            "expected the values of a trained run. Fix: leave the --set out (the latest run), or pass "
            "--model-dir of the run to use."
        )

    def _elsewhere(self) -> str:
        return (
            "train a new run: another --model-dir, or no --model-dir (a new numbered run beside runs/<task>); "
            f"--warm-start {self.model_dir} starts it from this run's weights."
        )

    def settle(self, differs: Callable[[str, dict], str]) -> None:
        """Chooses the run: ``differs(run, sets)`` says what differs between this code with ``sets`` and
        what trained ``run`` (``UNTRAINED``, a phrase of ``fingerprint.differences``, or ``""``: it fits).
        ``said`` is then the line that says which run is used and why; what cannot be used is refused."""
        if self.explicit:
            what = differs(self.model_dir, self.sets)
            if what.startswith(ARRAYS):
                raise ConfigError(
                    f"{self.model_dir} holds a run of another model or optimizer (the arrays of its state differ "
                    "from this task's, e.g. after an edit of the model); expected the model that trained it. "
                    f"Fix: restore that model, or {self._elsewhere()}"
                )
            return  # another training step: said by the call (it continues, or its evaluation stays apart)
        said = {}
        for run in self.candidates:
            said[run] = differs(run, self.sets_of(read(run)))
            if not said[run]:
                self._choose(run)
                self._say_chosen(said)
                return
        if self.training:
            self._choose(next((run for run, what in said.items() if what == UNTRAINED), next_run(self.root)))
            self._say_new(said)
            return
        if not said or all(what == UNTRAINED for what in said.values()):
            return  # nothing trained: the command says so
        listed = "; ".join(f"{run}: {what}" for run, what in said.items())
        raise ConfigError(
            f"No run under {self.root} fits this code ({describe(self.given)}): {listed}; expected a run this "
            "code trained. Fix: `estimax train` first (a new numbered run), restore the code that trained one of "
            "them, or pass its --model-dir to take it as it is."
        )

    def _say_chosen(self, said: dict[str, str]) -> None:
        newer = [f"{run} ({what})" for run, what in said.items() if what]
        if self.training:
            self.said = f"Run directory {self.model_dir}: continuing the run ({describe(self.sets)})."
        elif not newer:
            self.said = f"Using {self.model_dir}, the latest run ({describe(self.sets)})."
        else:
            self.said = (
                f"Using {self.model_dir}, the latest run this code fits ({describe(self.sets)}); newer runs "
                f"differ: {'; '.join(newer)}."
            )

    def _say_new(self, said: dict[str, str]) -> None:
        trained = [(run, what) for run, what in said.items() if what != UNTRAINED]
        reason = ""
        if trained:
            reason = f", as {trained[0][0]} was trained by another computation ({trained[0][1]})"
        elif existing := [run for run in runs(self.root) if run != self.model_dir]:
            other = _readable(existing[-1])
            if other is not None and other is not _DAMAGED:
                reason = f", as {existing[-1]} was trained with other --set values ({describe(other.sets)})"
        self.said = f"Run directory {self.model_dir}: a new run ({describe(self.sets)}){reason}."
