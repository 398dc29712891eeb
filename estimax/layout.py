"""Where every array of a run lives: one sharding per leaf of the TrainState, and the batches.

Owns turning the mesh, the sharding rules, the shardings NNX modules declare
and the default FSDP rule into a sharding for every parameter, the optimizer
state that mirrors its parameters, the model state, and the batches; the
checks that make a rule that places nothing an error (never a silent
replication); and the sharding plan that shows the result. Computed once
from abstract shapes: nothing is allocated here, and nothing here runs on
the device. The mesh itself is ``mesh.py``; the step knows nothing of this.

Where a parameter goes, first that applies:
  1. the first ``sharding_rules`` entry ``(regex, spec)`` whose regex fully
     matches its ``/``-joined path (``conv1/kernel``);
  2. the sharding its NNX module declares (``nnx.with_partitioning``, the
     variable's ``out_sharding``);
  3. replicated.
Then, when the mesh has an ``fsdp`` axis of size > 1, every parameter of at
least ``fsdp_min_bytes`` not yet sharded over ``fsdp`` also gets ``fsdp`` on
its largest dimension that is free and divides.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Sequence

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from estimax import mesh as mesh_lib
from estimax.errors import ConfigError
from estimax.state import TrainState, leaf_names

logger = logging.getLogger("estimax")

# -- the layout ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """Where one parameter (or model state leaf) lives."""

    path: str
    kind: str  # "params" or "model_state"
    shape: tuple[int, ...]
    dtype: str
    spec: P
    bytes_per_device: int
    placed_by: str


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The layout as a table: one row per parameter and model state leaf, and per-device totals.

    ``totals`` are bytes per device of ``params``, ``opt_state``,
    ``model_state``, ``average`` (0 without one), ``other`` (step, key) and ``total``; ``replicated_total``
    is what every device would hold with everything replicated.
    """

    mesh: str
    rows: tuple[PlanRow, ...]
    totals: dict[str, int]
    replicated_total: int

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        header = ("path", "shape", "dtype", "spec", "bytes/device", "placed by")
        table = [header] + [
            (r.path, str(r.shape), r.dtype, _spec_text(r.spec), f"{r.bytes_per_device:,}", r.placed_by)
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = [f"sharding plan on mesh {self.mesh}"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
        t = self.totals
        lines.append(
            f"per device: params {format_bytes(t['params'])}, optimizer state {format_bytes(t['opt_state'])}, "
            f"model state {format_bytes(t['model_state'])}, "
            + (f"parameter average {format_bytes(t['average'])}, " if t["average"] else "")
            + f"total {format_bytes(t['total'])} "
            f"(replicated: {format_bytes(self.replicated_total)})"
        )
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every array of a run lives.

    Attributes:
      mesh: the device mesh.
      state: a ``TrainState`` of ``NamedSharding``s, one per leaf.
      batch: the sharding of one global batch (rows over the batch axes).
      stack: the sharding of a stack of batches ``(K, batch, ...)``.
      plan: the ``ShardingPlan``.
    """

    mesh: Mesh
    state: TrainState
    batch: NamedSharding
    stack: NamedSharding
    plan: ShardingPlan

    @property
    def replicated(self) -> NamedSharding:
        return mesh_lib.replicated(self.mesh)


def build(
    mesh: Mesh,
    abstract_state: TrainState,
    optimizer: optax.GradientTransformation,
    rules: Sequence[tuple[str, tuple]],
    fsdp_min_bytes: int,
) -> Layout:
    """The layout of ``abstract_state`` (shapes only) on ``mesh`` under ``rules`` and ``fsdp_min_bytes``
    (``RunConfig``'s); raises before anything compiles when a rule places nothing or cannot be applied."""
    rep = mesh_lib.replicated(mesh)
    used = [False] * len(rules)
    param_specs, param_sources = _param_specs(mesh, abstract_state.params, rules, used, fsdp_min_bytes)
    state_specs, state_sources = _model_state_specs(mesh, abstract_state.model_state, rules, used)
    unused = [f"{i}: ({p!r}, {s})" for i, ((p, s), hit) in enumerate(zip(rules, used, strict=True)) if not hit]
    if unused:
        names = leaf_names(abstract_state.params) + leaf_names(abstract_state.model_state)
        raise ConfigError(
            f"sharding_rules {', '.join(unused)} match no parameter or model state; nothing would be sharded "
            f"by them. The paths are: {', '.join(names[:40])}{' ...' if len(names) > 40 else ''}. Fix: "
            "correct the regex (it must match the whole path) or remove the rule."
        )
    params = _unflatten(abstract_state.params, [NamedSharding(mesh, s) for s in param_specs])
    model_state = _unflatten(abstract_state.model_state, [NamedSharding(mesh, s) for s in state_specs])
    opt_state = _optimizer_shardings(optimizer, abstract_state.opt_state, abstract_state.params, params, rep)
    average = None if abstract_state.average is None else params  # the average lives where its parameters do
    state = TrainState(step=rep, params=params, opt_state=opt_state, model_state=model_state, rng=rep, average=average)
    plan = _plan(mesh, abstract_state, state, param_sources, state_sources)
    return Layout(mesh, state, mesh_lib.batch_sharding(mesh), mesh_lib.batch_sharding(mesh, stacked=True), plan)


def _param_specs(mesh, params, rules, used, fsdp_min_bytes) -> tuple[list[P], list[str]]:
    fsdp = mesh.shape.get(mesh_lib.FSDP_AXIS, 1)
    specs, sources, undivided = [], [], []
    for name, leaf, declared in zip(leaf_names(params), jax.tree.leaves(params), _declared(params), strict=True):
        spec, source = _ruled(mesh, name, leaf, rules, used)
        if spec is None and declared is not None:
            spec, source = declared, "nnx out_sharding"
            _check_spec(mesh, name, leaf, spec, "its module's out_sharding (nnx.with_partitioning)")
        spec = spec or (None,) * len(leaf.shape)
        if fsdp > 1 and _nbytes(leaf) >= fsdp_min_bytes and not _uses(spec, mesh_lib.FSDP_AXIS):
            sharded = _with_fsdp(spec, leaf.shape, fsdp)
            if sharded is None and source is None:
                undivided.append(f"{name} {tuple(leaf.shape)}")
            elif sharded is not None:
                spec, source = sharded, "fsdp" if source is None else f"{source} + fsdp"
        specs.append(_partition_spec(spec))
        sources.append(source or "replicated")
    if undivided:
        logger.warning(
            "FSDP: no free dimension of %s divides by fsdp=%d; they stay replicated on every device.",
            ", ".join(undivided),
            fsdp,
        )
    return specs, sources


def _model_state_specs(mesh, model_state, rules, used) -> tuple[list[P], list[str]]:
    """Model state (batch statistics, ...) is replicated unless a rule names it."""
    specs, sources = [], []
    for name, leaf in zip(leaf_names(model_state), jax.tree.leaves(model_state), strict=True):
        spec, source = _ruled(mesh, name, leaf, rules, used)
        specs.append(_partition_spec(spec or ()))
        sources.append(source or "replicated")
    return specs, sources


def _ruled(mesh, name, leaf, rules, used) -> tuple[tuple | None, str | None]:
    """The spec of the first rule that fully matches ``name`` (checked against the leaf), or ``(None, None)``."""
    for i, (pattern, spec) in enumerate(rules):
        if re.fullmatch(pattern, name):
            used[i] = True
            _check_spec(mesh, name, leaf, spec, f"sharding_rules[{i}] ({pattern!r}, {spec})")
            return spec, f"rule {i}"
    return None, None


def _check_spec(mesh, name: str, leaf, spec: tuple, origin: str) -> None:
    """Raises unless ``spec`` can place ``leaf``: one entry per dimension, known axes, used once, dividing."""
    shape = tuple(leaf.shape)
    where = f"parameter {name} of shape {shape} gets spec {spec} from {origin}"
    if len(spec) != len(shape):
        example = tuple(spec[: len(shape)]) + (None,) * (len(shape) - len(spec))
        raise ConfigError(
            f"The {where}: {len(spec)} entries for {len(shape)} dimensions; expected one entry per dimension "
            f"(None: not sharded). Fix: e.g. {example}, or a regex that does not match {name}."
        )
    axes = [a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)]
    for axis in axes:
        if axis not in mesh.shape:
            raise ConfigError(
                f"The {where}: the mesh has no axis {axis!r}; its axes are {dict(mesh.shape)}. Fix: add "
                f"{axis!r} to RunConfig(mesh=...) or use one of its axes."
            )
    if len(set(axes)) != len(axes):
        raise ConfigError(f"The {where}: an axis is used twice; expected each mesh axis at most once per parameter.")
    for dim, (size, entry) in enumerate(zip(shape, spec, strict=True)):
        ways = _ways(mesh, entry)
        if size % ways:
            raise ConfigError(
                f"The {where}: dimension {dim} has size {size}, which does not divide over {entry!r} "
                f"({ways} devices). Fix: shard a dimension that divides by {ways}, resize the mesh axis to a "
                f"divisor of {size}, or leave this dimension None."
            )


def _with_fsdp(spec: tuple, shape, fsdp: int) -> tuple | None:
    """``spec`` with ``fsdp`` on the largest free dimension that divides by it (the first of equals), or None."""
    free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % fsdp == 0 and shape[d] >= fsdp]
    if not free:
        return None
    dim = max(free, key=lambda d: (shape[d], -d))
    return tuple(mesh_lib.FSDP_AXIS if d == dim else entry for d, entry in enumerate(spec))


def _declared(params) -> list[tuple | None]:
    """Per leaf of ``params``: the spec its NNX Variable declares (``out_sharding``), or None."""
    declared = []
    for node in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        if isinstance(node, nnx.Variable):
            metadata = node.get_metadata()
            names = metadata.get("out_sharding", metadata.get("sharding_names"))  # sharding_names: older flax
            declared += [tuple(names) if names is not None else None] * len(jax.tree.leaves(node))
        else:
            declared.append(None)
    return declared


def _optimizer_shardings(optimizer, abstract_opt_state, abstract_params, param_shardings, replicated):
    """Every optimizer state leaf that mirrors a parameter (same shape) gets that parameter's sharding;
    counts and other leaves are replicated.

    A plain ``jit(optimizer.init)`` would not do this: its outputs come out replicated.
    """

    def follow(leaf, sharding, param):
        return sharding if tuple(leaf.shape) == tuple(param.shape) else replicated

    try:
        return optax.tree_map_params(
            optimizer,
            follow,
            abstract_opt_state,
            param_shardings,
            abstract_params,
            transform_non_params=lambda _: replicated,
        )
    except (TypeError, ValueError, AttributeError):  # an init that needs concrete parameters: match by path
        return _shardings_by_path(abstract_opt_state, abstract_params, param_shardings, replicated)


def _shardings_by_path(abstract_opt_state, abstract_params, param_shardings, replicated):
    """A leaf whose path ends with a parameter's path and has its shape gets its sharding."""
    by_name = {
        name: (tuple(p.shape), s)
        for name, p, s in zip(
            leaf_names(abstract_params), jax.tree.leaves(abstract_params), jax.tree.leaves(param_shardings), strict=True
        )
    }
    names = sorted(by_name, key=len, reverse=True)

    def sharding(path: str, leaf):
        for name in names:
            shape, s = by_name[name]
            if (path == name or path.endswith("/" + name)) and shape == tuple(leaf.shape):
                return s
        return replicated

    leaves = jax.tree.leaves(abstract_opt_state)
    return _unflatten(
        abstract_opt_state, [sharding(n, x) for n, x in zip(leaf_names(abstract_opt_state), leaves, strict=True)]
    )


def _plan(mesh, abstract_state, state, param_sources, state_sources) -> ShardingPlan:
    rows = []
    for kind, sources in (("params", param_sources), ("model_state", state_sources)):
        tree, shardings = getattr(abstract_state, kind), getattr(state, kind)
        for name, leaf, sharding, source in zip(
            leaf_names(tree), jax.tree.leaves(tree), jax.tree.leaves(shardings), sources, strict=True
        ):
            rows.append(
                PlanRow(
                    name, kind, tuple(leaf.shape), str(leaf.dtype), sharding.spec, _per_device(leaf, sharding), source
                )
            )

    def total(field) -> int:
        tree = getattr(abstract_state, field)
        return sum(map(_per_device, jax.tree.leaves(tree), jax.tree.leaves(getattr(state, field))))

    totals = {f: total(f) for f in ("params", "opt_state", "model_state", "average")}
    totals["other"] = total("step") + total("rng")
    totals["total"] = sum(totals.values())
    replicated = sum(_nbytes(x) for x in jax.tree.leaves(abstract_state))
    return ShardingPlan(mesh_lib.describe(mesh), tuple(rows), totals, replicated)


def _per_device(leaf, sharding: NamedSharding) -> int:
    return _nbytes(leaf) // math.prod(_ways(sharding.mesh, e) for e in sharding.spec)


def _partition_spec(spec: tuple) -> P:
    """``P()`` for a spec that shards nothing, so that replicated leaves read as such."""
    return P(*spec) if any(e is not None for e in spec) else P()


def _ways(mesh, entry) -> int:
    """How many devices one dimension is split over."""
    if entry is None:
        return 1
    return math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry))


def _uses(spec: tuple, axis: str) -> bool:
    return any(e == axis or (isinstance(e, tuple) and axis in e) for e in spec)


def _nbytes(leaf) -> int:
    return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize


def _unflatten(tree, leaves: list):
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)


def _spec_text(spec: P) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")" if len(spec) else "P()"


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"
