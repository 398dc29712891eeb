"""What a run computes: a fingerprint of its training step, and what differs between two.

Owns ``Computation``: the digest of the training step's program (``jax.make_jaxpr`` of
``Core.train_step`` on the state's and the global train batch's shapes: nothing compiled,
allocated or run), the batch it was traced on and the digest of the state's array names and
shapes, which is what a checkpoint must fit. The program's text is made independent of the
process (memory addresses) and of the devices (the mesh's size and device ids), so the same
code on 1 or 8 devices, today or tomorrow, gives the same digest; another JAX release may
give another. An edit of the model, the loss or the optimizer (a learning rate is a constant
of the program) gives another digest. Does not own where a run keeps its fingerprint
(``run_computation.py``, ``cli/runs.py``) nor what a call does when it differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import jax
import numpy as np

from estimax.state import leaf_names

# Parts of a program's text that say where it runs or where Python keeps an object, not what it computes.
_ADDRESSES = re.compile(r" at 0x[0-9a-fA-F]+")
ARRAYS_DIFFER = "shapes: the state's arrays (the model's or optimizer's)"
_MESHES = re.compile(r"\b(?:Abstract)?Mesh\((?:[^()]|\([^()]*\))*\)|device_ids=\[[^\]]*\]")


@dataclasses.dataclass(frozen=True)
class Computation:
    """The fingerprint of a training step: ``digest`` of its program, ``batch`` (the shapes and
    dtypes it was traced on, as ``encode_batch`` writes them, ``None`` for a batch of another
    kind), ``arrays``, the digest of the state's array names and shapes, and ``evaluation``, the
    digest of the eval-mode model_fn on the same batch (what an evaluation computes: no optimizer)."""

    digest: str
    batch: object
    arrays: str
    evaluation: str = ""  # "": unknown

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value) -> Computation | None:
        """The ``Computation`` that ``to_json`` wrote, ``None`` for anything else."""
        if not isinstance(value, dict) or not all(isinstance(value.get(k), str) for k in ("digest", "arrays")):
            return None
        evaluation = value.get("evaluation") if isinstance(value.get("evaluation"), str) else ""
        return cls(value["digest"], value.get("batch"), value["arrays"], evaluation)


def arrays_digest(abstract_state) -> str:
    """The names and shapes of the state's arrays (what a checkpoint must fit), as a digest; without the
    parameter average, which a checkpoint may hold or not (``averaging.py``)."""
    abstract_state = abstract_state._replace(average=None)
    leaves = jax.tree.leaves(abstract_state)
    rows = [f"{name} {tuple(leaf.shape)}" for name, leaf in zip(leaf_names(abstract_state), leaves, strict=True)]
    return _digest("\n".join(rows))


def trace(core, abstract_state, mesh, batch) -> Computation:
    """The ``Computation`` of ``core.train_step`` on ``abstract_state`` and ``batch`` (``ShapeDtypeStruct``s
    of the global train batch, e.g. ``decode_batch`` of a recorded one)."""
    unplaced = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_state)  # any device count
    with jax.set_mesh(mesh):  # modules that declare shardings need a mesh to trace
        step = jax.make_jaxpr(core.train_step)(unplaced, batch)
        # Whether a run keeps a parameter average does not change what its evaluation computes.
        evaluation = jax.make_jaxpr(core.eval_values)(unplaced._replace(average=None), batch)
    digests = program_digest(str(step)), program_digest(str(evaluation))
    return Computation(digests[0], encode_batch(batch), arrays_digest(abstract_state), digests[1])


def trace_recorded(core, abstract_state, mesh, encoded) -> Computation | None:
    """``trace`` on a batch ``encode_batch`` wrote (a run's record): ``None`` for a batch of another kind;
    a step that cannot take that batch computes otherwise (its digest says so)."""
    batch = decode_batch(encoded)
    if batch is None:
        return None
    try:
        return trace(core, abstract_state, mesh, batch)
    except Exception:  # any error of the user's code on the run's batch: another computation than the run's
        return Computation("untraceable", encoded, arrays_digest(abstract_state), "untraceable")


def program_digest(text: str) -> str:
    """The digest of a program's text without what says where it runs."""
    return _digest(_MESHES.sub("Mesh", _ADDRESSES.sub("", text)))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode_batch(batch):
    """``batch`` as JSON (dicts with text keys, tuples and lists, arrays as shape and dtype, ``None``),
    or ``None`` when it holds anything else."""
    try:
        return {"batch": _encode(batch)}
    except TypeError:
        return None


def _encode(tree):
    if tree is None:
        return None
    if isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
        return {"dict": {k: _encode(v) for k, v in tree.items()}}
    if isinstance(tree, tuple | list):
        return {"tuple": [_encode(v) for v in tree]}
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return {"shape": [int(n) for n in tree.shape], "dtype": str(np.dtype(tree.dtype))}
    raise TypeError(type(tree).__name__)  # never leaves the module: encode_batch answers None for such a batch


def decode_batch(encoded):
    """The ``ShapeDtypeStruct``s ``encode_batch`` wrote, or ``None`` when ``encoded`` is not its output."""
    try:
        return _decode(encoded["batch"])
    except (KeyError, TypeError, ValueError):
        return None


def _decode(value):
    if value is None:
        return None
    if "dict" in value:
        return {k: _decode(v) for k, v in value["dict"].items()}
    if "tuple" in value:
        return tuple(_decode(v) for v in value["tuple"])
    return jax.ShapeDtypeStruct(tuple(value["shape"]), np.dtype(value["dtype"]))


def describe_batch(encoded) -> str:
    """``features['x'] float32 (32, 2), labels int32 (32,)``: the batch ``encode_batch`` wrote, for a message."""
    decoded = decode_batch(encoded)
    if decoded is None:
        return "a batch of another kind"
    named = dict(zip(("features", "labels"), decoded, strict=False)) if isinstance(decoded, tuple) else decoded
    leaves = jax.tree_util.tree_leaves_with_path(named)
    return ", ".join(f"{_name(p)} {x.dtype} {tuple(x.shape)}" for p, x in leaves) or "no arrays"


def _name(path) -> str:
    """``features['x']``, ``labels``."""
    return jax.tree_util.keystr(path[:1], simple=True) + jax.tree_util.keystr(path[1:])


def differences(before: Computation, now: Computation) -> str:
    """What differs, in a few words: the state's arrays, the batch's shapes, or else the code; ``""``
    when nothing does."""
    if before.arrays != now.arrays:
        return ARRAYS_DIFFER
    if before.batch != now.batch:
        return f"shapes: the batch ({describe_batch(before.batch)} -> {describe_batch(now.batch)})"
    if before.digest != now.digest:
        return "code: the training step computes otherwise (the model, loss or optimizer), with the same arrays"
    return ""


def evaluation_differences(before: Computation, now: Computation) -> str:
    """What differs for an evaluation (the optimizer does not enter it): the state's arrays, or the
    eval-mode model_fn's code; ``""`` when nothing does or that of ``before`` is unknown."""
    if before.arrays != now.arrays:
        return ARRAYS_DIFFER
    if before.evaluation and before.evaluation != now.evaluation:
        return "code: the model_fn computes otherwise in eval mode (the model, loss or metrics)"
    return ""
