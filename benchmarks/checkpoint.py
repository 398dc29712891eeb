"""How long a checkpoint save blocks training, against the size of the state.

For states of 1 to 256 MiB (float32 arrays on one device), measures with the
engine's own ``Checkpointer``: the time ``save`` blocks the training loop
(on-device checksums + copy off the device; the write continues in the
background) and the checksums' share of it, the time until the write is complete, and a synchronous save.
One JSON line per size. Run: ``python benchmarks/checkpoint.py``.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time

import jax
import jax.numpy as jnp

from estimax.config import CheckpointPolicy
from estimax.run.checkpoint import Checkpointer, checksums

SIZES_MIB = (1, 16, 64, 256)
REPEATS = 3


def state_of(mib: int) -> dict:
    """A parameter-like pytree of ``mib`` MiB: 8 float32 arrays of random values (incompressible)."""
    per_array = mib * 2**20 // 4 // 8
    keys = jax.random.split(jax.random.key(0), 8)
    return {f"layer{i}": jax.random.normal(k, (per_array,), jnp.float32) for i, k in enumerate(keys)}


def measure(mib: int, directory: str) -> dict:
    state = jax.block_until_ready(state_of(mib))
    asynchronous = Checkpointer(f"{directory}/async", CheckpointPolicy(keep=1))
    synchronous = Checkpointer(f"{directory}/sync", CheckpointPolicy(keep=1, async_save=False))
    blocking, complete, sync, sums = [], [], [], []
    checksum = jax.jit(checksums)
    for step in range(REPEATS + 1):  # the first round compiles the checksums and warms up
        start = time.perf_counter()
        asynchronous.save(step, state)
        returned = time.perf_counter()
        asynchronous.wait()
        done = time.perf_counter()
        synchronous.save(step, state)
        synchronous.wait()
        before = time.perf_counter()
        jax.device_get(checksum(state))
        if step:
            sums.append(time.perf_counter() - before)
            blocking.append(returned - start)
            complete.append(done - start)
            sync.append(time.perf_counter() - done)
    return {
        "state_mib": mib,
        "async_blocking_ms": round(1e3 * min(blocking), 1),
        "of_which_checksums_ms": round(1e3 * min(sums), 1),
        "async_complete_ms": round(1e3 * min(complete), 1),
        "sync_save_ms": round(1e3 * min(sync), 1),
        "blocking_fraction_of_sync": round(min(blocking) / min(sync), 3),
    }


def main() -> None:
    logging.getLogger("absl").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as directory:
        for mib in SIZES_MIB:
            print(json.dumps(measure(mib, f"{directory}/{mib}")), flush=True)


if __name__ == "__main__":
    main()
