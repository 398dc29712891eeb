"""Ray Train: the workers of one Ray Train attempt join one JAX group.

Owns joining the group from inside the function a Ray Train trainer runs on
every worker: this worker's rank and the group's size come from
``ray.train.get_context()``, the coordinator's ``host:port`` from rank 0 (its
node's address and a port free there, sent to every worker with
``ray.train.collective.broadcast_from_rank_zero``), and
``estimax.distributed.initialize`` joins. Every attempt is a new group of fresh
processes with a new coordinator, so the same call forms the group again after
each restart. It also names the run (``ESTIMAX_RUN_ID``, unless set: Ray
Train's run, its storage path and name, the same for every attempt), so that a
new attempt takes the model_dir's lock over from the previous one at once
(``lock.py``).

Does not own supervising the group: Ray Train restarts it on the nodes that
are left when one is lost, and grows it when nodes come back
(``ScalingConfig(num_workers=(min, max))``); each new group resumes from the
model_dir's last checkpoint, resharded onto its own mesh, the input at the
next example (``resize.py``).
"""

from __future__ import annotations

import os

from estimax import distributed
from estimax.errors import ConfigError, MissingLibraryError
from estimax.run.lock import RUN_ID


def initialize(timeout_seconds: int = 300) -> bool:
    """Joins this Ray Train worker to a JAX group of every worker of this attempt; returns whether
    a group of several processes was formed (a group of one needs none).

    Call it first in the function given to the trainer (``train_loop_per_worker``), before anything
    touches devices. When JAX's group already exists (Ray's ``JaxTrainer`` forms it on TPUs and
    GPUs), it only names the run. Needs Ray Train v2: the default of the releases the ``ray`` extra
    installs; ``RAY_TRAIN_V2_ENABLED=1`` on older ones.
    """
    import jax

    context, collective = _ray_train()
    os.environ.setdefault(RUN_ID, run_id(context))
    if jax.distributed.is_initialized():
        return True
    rank, size = context.get_world_rank(), context.get_world_size()
    if size == 1:
        return distributed.initialize(num_processes=1, timeout_seconds=timeout_seconds)
    address = None
    if rank == 0:
        import ray

        address = f"{ray.util.get_node_ip_address()}:{distributed.free_port()}"
    coordinator = collective.broadcast_from_rank_zero(address)
    return distributed.initialize(coordinator, size, rank, timeout_seconds=timeout_seconds)


def run_id(context) -> str:
    """The run of a Ray Train worker, the same for every attempt: ``ray:`` and where Ray Train keeps the run
    (its storage path and the run's name, ``RunConfig(name=...)``; a name of its own when none is given)."""
    try:
        return f"ray:{context.get_storage().experiment_fs_path}"
    except Exception:  # noqa: BLE001 - an advanced part of Ray's API: the name alone names the run too
        return f"ray:{context.get_experiment_name()}"


def _ray_train():
    """This worker's Ray Train context and Ray Train's collective module, or one line saying why not."""
    try:
        import ray.train
    except ImportError:
        raise MissingLibraryError(
            "estimax.ray.initialize() needs Ray Train, which is not installed; expected `import ray.train` to "
            "work. Fix: pip install 'estimax[ray]' (or 'ray[train]')."
        ) from None
    try:
        from ray.train import collective
    except ImportError:
        raise ConfigError(
            "estimax.ray.initialize() needs Ray Train v2 (its collective calls and elastic groups); received "
            "Ray Train v1. Fix: set RAY_TRAIN_V2_ENABLED=1 in the environment of the driver and of the cluster "
            "before Ray starts."
        ) from None
    try:
        context = ray.train.get_context()
        context.get_world_rank()
    except Exception as error:  # Ray raises its own kinds outside a worker; the fix is the same
        raise ConfigError(
            f"estimax.ray.initialize() was called outside a Ray Train worker (Ray said: {error}); expected a call "
            "inside the function a Ray Train trainer runs on every worker (train_loop_per_worker). Fix: call it "
            "at the top of that function."
        ) from None
    return context, collective
