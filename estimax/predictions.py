"""Predictions as per-example host rows, in input order, on one process or gathered from all.

Owns turning one predicted global batch (device arrays) into the valid rows of
this process, or of every process on process 0. Does not own running the
model (``loop.py``) nor input order (the sources shard examples ``i::n``).
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np

from estimax import mesh as mesh_lib


def rows(predictions, num_valid: int) -> Iterator:
    host = jax.tree.map(mesh_lib.to_host_local, predictions)  # host sync: this batch is done
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
