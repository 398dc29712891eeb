"""The device mesh and where arrays live on it.

Owns the data-parallel mesh over every device of every process, the shardings
of state (replicated) and batches (split on the ``data`` axis), the check that
a global batch divides the mesh, and the host-local -> global array step.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(devices=None) -> Mesh:
    """A 1-D data-parallel mesh over ``devices`` (default: all devices).

    Auto axis types on purpose: the compiler propagates shardings and inserts
    the gradient all-reduce itself (see the design notes on Explicit meshes).
    """
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.array(devices), (DATA_AXIS,), axis_types=(AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, stacked: bool = False) -> NamedSharding:
    """Sharding of a batch ``(batch, ...)`` or a stack of batches ``(K, batch, ...)``."""
    return NamedSharding(mesh, P(None, DATA_AXIS) if stacked else P(DATA_AXIS))


def check_batch_size(name: str, global_batch_size: int, mesh: Mesh) -> None:
    """Raises unless ``global_batch_size`` splits evenly over the data axis and processes."""
    num_shards = mesh.shape[DATA_AXIS]
    if global_batch_size % num_shards == 0 and global_batch_size % jax.process_count() == 0:
        return
    lower = global_batch_size // num_shards * num_shards
    upper = lower + num_shards
    nearest = " or ".join(str(b) for b in (lower, upper) if b > 0)
    raise ValueError(
        f"RunConfig({name}={global_batch_size}) does not divide the {num_shards} devices "
        f"of the data axis; expected a multiple of {num_shards}. Fix: use {nearest}."
    )


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
    """This process's rows of an array sharded on the data axis, as numpy."""
    # Explicit transfers: jax >= 0.12 rejects np.asarray on a device array under transfer_guard("disallow").
    if x.is_fully_addressable:
        return jax.device_get(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([jax.device_get(s.data) for s in shards])
