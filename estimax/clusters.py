"""Which group a process belongs to, read from the environment its cluster manager gave it.

JAX detects SLURM, Open MPI and Cloud TPU by itself; estimax reads the
managers it does not (Kubeflow Trainer's JAX runtime, SkyPilot, a Kubernetes
Indexed Job or JobSet without ``jax[k8s]``) and fixes what its detection gets
wrong: given no device ids, it narrows every GPU process to its local rank,
so one task per node would drive GPU 0 of 8. Here each process gets the GPUs
of its share of the node: all of them for one process per node, its own for
one per GPU. Owns reading the environment (pure functions of a mapping, so
that each manager is testable without one) and the names of the variables
each manager sets (``estimax launch`` keeps them from its children). Does
not own joining the group (``distributed.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Mapping

from estimax.errors import DistributedError

DEFAULT_PORT = 8476  # the coordinator's port where a manager names only hosts (JAX's own default on TPUs)
PORT_ENV = "ESTIMAX_COORDINATOR_PORT"
# Prefixes and names of the variables by which a manager places a process in its group.
MANAGER_VARIABLES = (
    "SLURM_", "OMPI_", "PMI_", "PMIX_", "SKYPILOT_NODE_", "SKYPILOT_NUM_NODES", "JOB_COMPLETION_INDEX",
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Placement:
    """A process's place in its group, as its manager gave it. ``None``: left to JAX's detection."""

    manager: str
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None

    def describe(self) -> str:
        return f"{self.manager}" + (f", coordinator {self.coordinator}" if self.coordinator else "")


def detect(env: Mapping[str, str]) -> Placement | None:
    """The placement ``env`` describes, or ``None`` (one process, or only JAX can tell: a TPU VM)."""
    for read in (_kubeflow, _skypilot, _indexed_job, _slurm, _open_mpi):
        placement = read(env)
        if placement is not None:
            return placement
    return None


def _kubeflow(env: Mapping[str, str]) -> Placement | None:
    """Kubeflow Trainer's JAX runtime: JAX's own variables, of which JAX itself reads only the address."""
    if "JAX_COORDINATOR_ADDRESS" not in env or "SLURM_JOB_ID" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return None
    return Placement(
        "Kubeflow Trainer",
        env["JAX_COORDINATOR_ADDRESS"],
        _required(env, "JAX_NUM_PROCESSES", "Kubeflow Trainer", "JAX_COORDINATOR_ADDRESS"),
        _required(env, "JAX_PROCESS_ID", "Kubeflow Trainer", "JAX_COORDINATOR_ADDRESS"),
    )


def _skypilot(env: Mapping[str, str]) -> Placement | None:
    """SkyPilot: the nodes' IPs (the first is the head), their number and this node's rank."""
    if "SKYPILOT_NODE_IPS" not in env:
        return None
    nodes = _required(env, "SKYPILOT_NUM_NODES", "SkyPilot", "SKYPILOT_NODE_IPS")
    if nodes <= 1:
        return None
    head = env["SKYPILOT_NODE_IPS"].split()[0]
    coordinator = f"{head}:{env.get(PORT_ENV, DEFAULT_PORT)}"
    return Placement(
        "SkyPilot", coordinator, nodes, _required(env, "SKYPILOT_NODE_RANK", "SkyPilot", "SKYPILOT_NODE_IPS")
    )


def _indexed_job(env: Mapping[str, str]) -> Placement | None:
    """A Kubernetes Indexed Job or JobSet: the pod's index; the size and the coordinator from estimax's
    variables (JAX finds them itself with ``jax[k8s]``, by listing the job's pods)."""
    if "JOB_COMPLETION_INDEX" not in env or "KUBERNETES_SERVICE_HOST" not in env:
        return None
    size, coordinator = env.get("ESTIMAX_NUM_PROCESSES"), env.get("ESTIMAX_COORDINATOR")
    if size and coordinator:
        return Placement(
            "Kubernetes Indexed Job", coordinator, _int(env, "ESTIMAX_NUM_PROCESSES"), _int(env, "JOB_COMPLETION_INDEX")
        )
    if importlib.util.find_spec("kubernetes") is not None:
        return Placement("Kubernetes (JAX's detection)")
    missing = " and ".join(
        name for name, value in (("ESTIMAX_NUM_PROCESSES", size), ("ESTIMAX_COORDINATOR", coordinator)) if not value
    )
    raise DistributedError(
        f"A Kubernetes Indexed Job (JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']}) gives this pod its index but "
        f"not the group; expected {missing}. Fix: set ESTIMAX_NUM_PROCESSES to the job's parallelism and "
        "ESTIMAX_COORDINATOR to pod 0's address and a port (an Indexed Job's pod 0 is <job>-0.<headless service>), "
        "or pip install 'jax[k8s]' to let JAX list the job's pods."
    )


def _slurm(env: Mapping[str, str]) -> Placement | None:
    """``srun``: JAX detects the group; the GPUs of each task are set here."""
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env or _int(env, "SLURM_NTASKS", 1) <= 1:
        return None
    per_node = _tasks_on_this_node(env)
    return Placement("SLURM", local_device_ids=local_gpus(_int(env, "SLURM_LOCALID", 0), per_node, _visible_gpus(env)))


def _open_mpi(env: Mapping[str, str]) -> Placement | None:
    """``mpirun``: JAX detects the group; the GPUs of each rank are set here."""
    if "OMPI_COMM_WORLD_SIZE" not in env or _int(env, "OMPI_COMM_WORLD_SIZE") <= 1:
        return None
    local_rank, per_node = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    return Placement("Open MPI", local_device_ids=local_gpus(local_rank, per_node, _visible_gpus(env)))


def local_gpus(local_rank: int, processes_on_node: int, visible: int | None) -> tuple[int, ...] | None:
    """The GPUs (indices among the visible ones) of the process of ``local_rank`` of a node that runs
    ``processes_on_node`` processes and shows ``visible`` GPUs to each: an equal share of them, so all
    for one process per node, one each for one per GPU, and ``[0]`` where the manager already bound one
    GPU to each process. ``None`` where the GPUs are unknown (no GPUs: nothing to choose)."""
    if not visible:
        return None
    if visible < processes_on_node:  # bound by the manager: each process sees its own few
        return tuple(range(visible))
    share = visible // processes_on_node
    return tuple(range(local_rank * share, (local_rank + 1) * share))


def _visible_gpus(env: Mapping[str, str]) -> int | None:
    devices = env.get("CUDA_VISIBLE_DEVICES")
    if devices is not None and devices.strip():
        return len([d for d in devices.split(",") if d.strip()])
    gpus = env.get("SLURM_GPUS_ON_NODE")
    return int(gpus) if gpus and gpus.isdigit() else None


def _tasks_on_this_node(env: Mapping[str, str]) -> int:
    """From ``SLURM_NTASKS_PER_NODE``, else this node's entry of ``SLURM_STEP_TASKS_PER_NODE``
    (``"2(x3),1"``: 2 tasks on each of 3 nodes, then 1)."""
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        return int(env["SLURM_NTASKS_PER_NODE"])
    counts = []
    for count, repeat in re.findall(
        r"(\d+)(?:\(x(\d+)\))?", env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    ):
        counts += [int(count)] * int(repeat or 1)
    node = _int(env, "SLURM_NODEID", 0)
    return counts[node] if node < len(counts) else 1  # fmt: skip


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None or text == "":
        if default is None:
            raise DistributedError(f"{name} is not set; expected an integer.")
        return default
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"{name}={text!r} is not an integer; expected e.g. {name}=2.") from None


def _required(env: Mapping[str, str], name: str, manager: str, because: str) -> int:
    if not env.get(name):
        raise DistributedError(
            f"{because} is set, so this looks like {manager}, but {name} is not; expected both. Fix: set {name} "
            f"(or unset {because} to run one process)."
        )
    return _int(env, name)


def without_manager(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the variables by which a manager places a process (for ``estimax launch``'s
    children, which form a group of their own)."""
    return {k: v for k, v in env.items() if not k.startswith(MANAGER_VARIABLES)}
