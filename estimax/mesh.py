"""The device mesh and how batches are split over it.

Owns building the mesh over every device of every process (a 1-D ``data``
mesh by default, or named axes with sizes), which axes split the batch
(``data`` and ``fsdp``; every other axis is a model axis), the batch
shardings, the host-local <-> global array steps, and a predicted batch as per-example host
rows (this process's, or every process's on process 0, in input order). Which batch sizes
divide the batch axes is ``data/plan.py``'s rule. Where the state lives is ``layout.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from estimax.errors import ConfigError

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)  # both split the batch; FSDP also shards the state


def devices(num_devices: int | None) -> list:
    """The first ``num_devices`` of JAX's devices (all of them for ``None``)."""
    devices = jax.devices()
    if num_devices is not None and num_devices > len(devices):
        raise ConfigError(
            f"RunConfig(num_devices={num_devices}) exceeds the {len(devices)} devices available; "
            f"expected at most {len(devices)}."
        )
    return devices[:num_devices]


def make_mesh(devices=None, axes: Mapping[str, int] | None = None) -> Mesh:
    """A mesh over ``devices`` (default: all devices).

    ``axes=None``: a 1-D ``data`` mesh. Otherwise ``{name: size}`` with one
    size ``-1`` allowed (the rest of the devices); a ``data`` axis of size 1
    is added when absent. Axes are laid out ``data``, ``fsdp``, then the
    model axes in the order given, so that each process holds a contiguous
    block of the batch and model axes span the nearest devices.

    Auto axis types on purpose: the compiler propagates shardings and inserts
    the collectives itself (see the design notes on Explicit meshes).
    """
    devices = jax.devices() if devices is None else list(devices)
    if axes is None:
        return Mesh(np.array(devices), (DATA_AXIS,), axis_types=(AxisType.Auto,))
    sizes = resolve_axes(axes, len(devices))
    sizes.setdefault(DATA_AXIS, 1)
    names = sorted(sizes, key=lambda n: BATCH_AXES.index(n) if n in BATCH_AXES else len(BATCH_AXES))
    grid = np.array(devices).reshape([sizes[n] for n in names])
    return Mesh(grid, tuple(names), axis_types=(AxisType.Auto,) * len(names))


def resolve_axes(axes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """``axes`` with its ``-1`` replaced by the rest of ``num_devices``; raises unless they multiply to it."""
    sizes = dict(axes)
    rest = [n for n, s in sizes.items() if s == -1]
    known = math.prod(s for s in sizes.values() if s != -1)
    shown = dict(axes)
    if rest:
        if num_devices % known:
            raise ConfigError(
                f"RunConfig(mesh={shown}): the fixed axes take {known} devices, which does not divide the "
                f"{num_devices} devices; expected a product that divides {num_devices}."
            )
        sizes[rest[0]] = num_devices // known
    elif known != num_devices:
        raise ConfigError(
            f"RunConfig(mesh={shown}) takes {known} devices but there are {num_devices}; expected sizes "
            f"whose product is {num_devices}. Fix: give one axis -1 (the rest of the devices), e.g. data=-1."
        )
    return sizes


def describe(mesh: Mesh) -> str:
    """``data=4 x model=2``."""
    return " x ".join(f"{n}={s}" for n, s in mesh.shape.items())


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the batch is split over, in mesh order."""
    return tuple(n for n in mesh.axis_names if n in BATCH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, stacked: bool = False) -> NamedSharding:
    """Sharding of a batch ``(batch, ...)`` or a stack of batches ``(K, batch, ...)``: rows over the batch axes."""
    axes = batch_axes(mesh)
    rows = axes[0] if len(axes) == 1 else axes
    return NamedSharding(mesh, P(None, rows) if stacked else P(rows))


def to_global(host_tree, sharding: NamedSharding, global_batch_size: int):
    """Builds global arrays from this process's rows of every leaf.

    ``global_batch_size`` is the size of the sharded axis over all processes
    (axis 0 of a batch, axis 1 of a stack of batches).
    """
    axis = 1 if sharding.spec and sharding.spec[0] is None else 0

    def put(x):
        shape = list(np.shape(x))
        shape[axis] = global_batch_size
        return jax.make_array_from_process_local_data(sharding, x, tuple(shape))

    return jax.tree.map(put, host_tree)


def to_host_local(x) -> np.ndarray:
    """This process's rows of an array sharded on the batch axes, as numpy.

    Devices along a model axis hold copies of the same rows: each block is taken once.
    """
    # Explicit transfers: jax >= 0.12 rejects np.asarray on a device array under transfer_guard("disallow").
    if x.is_fully_addressable:
        return jax.device_get(x)
    blocks = {s.index[0].start or 0: s for s in x.addressable_shards}
    return np.concatenate([jax.device_get(blocks[start].data) for start in sorted(blocks)])


def rows(predictions, num_valid: int) -> Iterator:
    """This process's valid rows of one predicted global batch, in order."""
    host = jax.tree.map(to_host_local, predictions)  # host sync: this batch is done
    for i in range(num_valid):
        yield jax.tree.map(lambda x, i=i: x[i], host)


def gathered_rows(predictions, num_valid: int) -> Iterator:
    """Every process's rows of one batch on process 0, in input order (shards ``i::n``)."""
    from jax.experimental import multihost_utils

    # host sync: a collective of every process; each global batch is the processes' host batches in order
    host = multihost_utils.process_allgather(predictions, tiled=True)
    valid = multihost_utils.process_allgather(np.int32(num_valid))
    if jax.process_index() != 0:
        return
    count, host_batch = len(valid), len(jax.tree.leaves(host)[0]) // len(valid)
    for row in range(host_batch):  # local row r of process p is example r * count + p of the batch
        for process in range(count):
            if row < valid[process]:
                yield jax.tree.map(lambda x, i=process * host_batch + row: x[i], host)
