"""Task modules: a user's program, by convention, for ``estimax train|evaluate|predict``.

A task module is any Python module (a dotted module path, or a ``.py`` file)
that defines these names (pinned: programs outside this repository rely on them):

- ``model``: the NNX factory ``(rngs, params) -> nnx.Module``, or a model wrapped
  by ``estimax.models``.
- ``model_fn``: ``model_fn(model, features, labels, mode, params) -> Spec``.
- ``optimizer``: an optax ``GradientTransformation``, or a function of ``params``
  returning one.
- ``train_input(params)`` and ``eval_input(params)``: the inputs, as
  ``Estimator.train`` and ``Estimator.evaluate`` take them; ``eval_input`` may return a
  mapping of set names to inputs (``{"val": ..., "test": ...}``): each set is evaluated and
  recorded under its name.
- ``params``: a dict of hyper-parameter defaults (``--set name=value`` overrides them).

and optionally:

- ``predict_input(params)``: the input of ``predict`` (default: ``eval_input``, the first set
  of a mapping).
- ``prediction_record(row) -> dict``: one prediction as JSON values (default:
  arrays as lists).
- ``DEFAULTS``: the run settings the command line uses unless given, keyed by
  flag name (``{"batch_size": 128, "max_steps": 400, "loop": "scan"}``).
- ``SHARDING_RULES``: ``(regex, spec)`` rules (``RunConfig(sharding_rules=...)``)
  that apply when the run's mesh has every axis they name and no rules were given.
- ``run_config(config, params) -> RunConfig``: run settings that follow the
  params (the LM's ``tokens_per_example`` is its ``seq_len``).

Owns loading a task, checking it against the convention, typing ``--set``
overrides from the defaults and building the ``Estimator``. Owns no argument
parsing (``entry.py``) and no training.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from types import ModuleType

from estimax.errors import ConfigError, ConfigTypeError, NotFoundError

REQUIRED = ("model", "model_fn", "optimizer", "train_input", "eval_input", "params")
"""The names every task module defines."""
CONVENTION = (
    "a task module defines model (the factory (rngs, params) -> module, or a wrapped model), model_fn, "
    "optimizer (an optax transformation, or a function of params returning one), train_input(params), "
    "eval_input(params) and params (a dict of defaults); optionally predict_input(params), "
    "prediction_record(row), DEFAULTS and SHARDING_RULES"
)
"""The task convention in one sentence, as errors about a task module quote it."""


@dataclasses.dataclass(frozen=True)
class Task:
    """A loaded task module: its name, the module, and its ``params`` after overrides."""

    name: str
    module: ModuleType
    params: dict

    @property
    def defaults(self) -> Mapping:
        """The module's ``DEFAULTS`` (run settings), or none."""
        return getattr(self.module, "DEFAULTS", {})

    def input(self, kind: str):
        """The input of ``kind`` ("train", "eval" or "predict"), built from ``params``: for "eval", one
        input or a mapping of named sets; a "predict" that falls back to such a mapping, its first set."""
        fn = getattr(self.module, f"{kind}_input", None) or self.module.eval_input
        made = fn(dict(self.params))
        if kind != "eval" and fn is self.module.eval_input and isinstance(made, Mapping) and made:
            return next(iter(made.values()))
        return made

    def optimizer(self):
        optimizer = self.module.optimizer
        if hasattr(optimizer, "init") and hasattr(optimizer, "update"):
            return optimizer
        if not callable(optimizer):
            raise ConfigTypeError(
                f"Task {self.name!r}: optimizer={optimizer!r}; expected an optax transformation "
                "(e.g. optax.adam(1e-3)) or a function of params returning one."
            )
        return optimizer(dict(self.params))

    def with_sets(self, sets: Mapping[str, str]) -> Task:
        """This task with the module's params overridden by ``sets`` (``--set`` values as text)."""
        return dataclasses.replace(self, params=override(self.module.params, sets))

    def estimator(self, config, warm_start=None):
        """The ``Estimator`` of this task under ``config`` (a ``RunConfig``), warm-started from
        ``warm_start`` (a ``WarmStart``) when its model_dir has no checkpoint yet."""
        from estimax.estimator import Estimator

        config = with_task_rules(config, getattr(self.module, "SHARDING_RULES", None))
        if hasattr(self.module, "run_config"):
            config = self.module.run_config(config, dict(self.params))
        return Estimator(
            model=self.module.model,
            model_fn=self.module.model_fn,
            optimizer=self.optimizer(),
            config=config,
            params=dict(self.params),
            warm_start=warm_start,
        )

    def prediction_record(self, row) -> dict:
        record = getattr(self.module, "prediction_record", None)
        return record(row) if record is not None else to_json(row)


def with_task_rules(config, rules):
    """``config`` with a task's sharding ``rules`` when it names none itself and its mesh has
    every axis the rules use (the same task then runs on a 1-D data mesh too)."""
    if not rules or config.sharding_rules or not config.mesh:
        return config
    axes = {a for _, spec in rules for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
    if not axes <= set(config.mesh):
        return config
    return dataclasses.replace(config, sharding_rules=tuple(rules))


def load(spec: str, overrides: Mapping[str, str] = {}) -> Task:
    """The task of ``spec``: a module path (``my_project.task``) or a ``.py`` file.

    ``overrides`` are ``--set`` values as text, typed from ``params``' defaults.
    """
    module = _import(spec)
    missing = [name for name in REQUIRED if not hasattr(module, name)]
    if missing:
        raise ConfigError(f"Task {spec!r} does not define {', '.join(missing)}; expected {CONVENTION}.")
    if not isinstance(module.params, dict):
        raise ConfigTypeError(
            f"Task {spec!r}: params is a {type(module.params).__name__}; expected a dict of defaults."
        )
    name = os.path.splitext(os.path.basename(spec))[0] if _is_file(spec) else spec.rsplit(".", 1)[-1]
    return Task(name, module, override(module.params, overrides))


def check_sets(spec: str, sets: list[tuple[str, str]]) -> None:
    """Raises what ``load`` would about a ``--set`` name or value, reading the task's source
    instead of importing it (no JAX): names are checked when its ``params`` dict is written out
    at the module's top level, values when their default is a literal there."""
    declared = _declared_params(spec)
    if declared is not None:
        override(declared, {name: text for name, text in sets if declared.get(name) is not _UNREAD})


_UNREAD = object()  # a default that _declared_params found but could not read (not a literal)


def _declared_params(spec: str) -> dict | None:
    """The ``params`` of the task ``spec`` as its source declares them: the last top-level
    ``params = {...}`` (or ``dict(...)``) with names written out; a default that is not a literal
    reads as ``_UNREAD``. ``None`` when there is no such source or assignment."""
    path = _source_file(spec)
    try:
        with open(path, "rb") as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError, TypeError):  # no file here: the import reports it
        return None
    declared = None
    for node in tree.body:
        target = node.targets[-1] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(target, ast.Name) and target.id == "params":
            declared = _literal_dict(node.value) if node.value is not None else None
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and _changes_params(node):
            return None  # params[...] = ..., params.update(...): known only once the module has run
    return declared


def _changes_params(node: ast.stmt) -> bool:
    """Whether a top-level statement may change ``params`` other than by assigning it whole."""
    for part in ast.walk(node):
        if isinstance(part, ast.Subscript | ast.Attribute) and getattr(part.value, "id", None) == "params":
            if isinstance(part, ast.Attribute) or isinstance(part.ctx, ast.Store | ast.Del):
                return True
        if isinstance(part, ast.AugAssign) and getattr(part.target, "id", None) == "params":
            return True
    return False


def _literal_dict(node: ast.expr) -> dict | None:
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        pairs = zip((k.value for k in node.keys), node.values, strict=True)
    elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict" and not node.args:
        if any(k.arg is None for k in node.keywords):  # dict(**other): names not written out
            return None
        pairs = ((k.arg, k.value) for k in node.keywords)
    else:
        return None
    declared = {}
    for name, value in pairs:
        try:
            declared[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError):
            declared[name] = _UNREAD
    return declared


def _source_file(spec: str) -> str | None:
    """The file of ``spec`` found as the import would find it, without importing its packages."""
    if _is_file(spec):
        return os.path.abspath(spec)
    parts = spec.split(".")
    for entry in [*sys.path, os.getcwd()]:
        base = os.path.join(entry or os.getcwd(), *parts)
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def override(params: Mapping, overrides: Mapping[str, str]) -> dict:
    """``params`` with ``overrides`` (text) parsed to the type of each default."""
    result = dict(params)
    for name, text in overrides.items():
        if name not in params:
            known = ", ".join(sorted(params)) or "none"
            raise ConfigError(f"--set {name}={text}: {name!r} is not in params; known names: {known}.")
        result[name] = parse_value(text, params[name], name)
    return result


def parse_value(text: str, default, name: str = "value"):
    """``text`` as a value of ``default``'s type: bool, int, float, str, tuple or list
    (comma-separated or a Python literal); any literal where the default is ``None``."""
    kind = type(default)
    unlike = ConfigError(
        f"--set {name}={text}: not a {kind.__name__} like its default {default!r}; "
        f"expected e.g. --set {name}={_example(default)}."
    )
    try:
        if isinstance(default, bool):
            lowered = text.strip().lower()
            if lowered not in _BOOLS:
                raise unlike
            return _BOOLS[lowered]
        if isinstance(default, int | float | str):
            return kind(text)
        if isinstance(default, tuple | list):
            items = ast.literal_eval(text) if text.strip()[:1] in "([" else [t for t in text.split(",") if t.strip()]
            if not isinstance(items, tuple | list):
                raise unlike
            types = {type(d) for d in default}
            if len(types) == 1 and all(isinstance(i, str) for i in items):
                items = [parse_value(i, default[0], name) for i in items]
            elif all(isinstance(i, str) for i in items):
                items = [_literal(i) for i in items]
            return kind(items)
        if default is None:
            return _literal(text)
        value = ast.literal_eval(text)
        if not isinstance(value, kind):
            raise unlike
        return value
    except (ValueError, SyntaxError, TypeError):  # int("x"), no literal, an item unlike its default (a ConfigError)
        raise unlike from None


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _literal(text: str):
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text


def _example(default) -> str:
    if isinstance(default, bool):
        return "true"
    if isinstance(default, tuple | list):
        return ",".join(map(str, default)) or "1,2"
    return repr(default) if not isinstance(default, str) else "text"


def _is_file(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec


def _import(spec: str) -> ModuleType:
    if _is_file(spec):
        path = os.path.abspath(spec)
        if not os.path.isfile(path):
            raise NotFoundError(f"Task file {spec!r} does not exist; expected a .py file or a module path.")
        name = os.path.splitext(os.path.basename(path))[0]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, os.path.dirname(path))  # its sibling modules import as they would under `python file.py`
        sys.modules[name] = module
        with _syntax_named(spec):
            module_spec.loader.exec_module(module)
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's package in the working directory
    try:
        with _syntax_named(spec):
            return importlib.import_module(spec)
    except ModuleNotFoundError as error:
        if error.name is None or not (spec == error.name or spec.startswith(error.name + ".")):
            raise  # the task itself imports something missing: that module's error
        raise ConfigError(
            f"No task module {spec!r} (no module named {error.name!r} from {os.getcwd()}); expected a module "
            "path importable from the working directory, or a .py file."
        ) from None


@contextlib.contextmanager
def _syntax_named(spec: str):
    """A syntax error in the task (or a module it imports) is one line: file, line and the code there."""
    try:
        yield
    except SyntaxError as error:
        code = (error.text or "").strip()
        raise ConfigError(
            f"Task {spec!r} does not compile: {error.filename}, line {error.lineno}: {error.msg}"
            + (f" in `{code}`" if code else "")
            + "; expected valid Python. Fix: correct that line (`python -m py_compile FILE` checks a file)."
        ) from None


def to_json(row):
    """A prediction (numpy arrays, scalars, dicts of them) as JSON values."""
    if isinstance(row, Mapping):
        return {k: to_json(v) for k, v in row.items()}
    if hasattr(row, "tolist"):
        return row.tolist()
    return row
