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
import logging
import re
import socket
from collections.abc import Mapping

from estimax.errors import DistributedError

logger = logging.getLogger("estimax")

COORDINATOR_ENV = "ESTIMAX_COORDINATOR"
"""The variable naming the coordinator's ``host:port`` of a process group (``estimax launch`` sets the three)."""
NUM_PROCESSES_ENV = "ESTIMAX_NUM_PROCESSES"
"""The variable with the number of processes in the group."""
PROCESS_ID_ENV = "ESTIMAX_PROCESS_ID"
"""The variable with this process's index in the group, from 0."""
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
    variables: str = dataclasses.field(default="", compare=False)  # those that gave the rank and size

    def describe(self) -> str:
        return f"{self.manager}" + (f", coordinator {self.coordinator}" if self.coordinator else "")


def detect(env: Mapping[str, str]) -> Placement | None:
    """The placement ``env`` describes, or ``None`` (one process, or only JAX can tell: a TPU VM).

    Every manager's variables are checked before anything starts: a rank outside its group, a
    local rank outside its node, a list that does not match its count is a ``DistributedError``
    naming the manager, the variable and its value. Where two managers' variables are present,
    the first in this order is used (Open MPI before SLURM, as JAX does: ``mpirun`` inside a SLURM
    allocation started the process), with a warning that says so; two that place the process
    differently are an error, except that nesting.
    """
    found = [placement for placement in (read(env) for read in _READERS) if placement is not None]
    for other in found[1:]:
        _check_agree(found[0], other)
    return found[0] if found else None


def _check_agree(used: Placement, other: Placement) -> None:
    """A warning that says which of two managers' variables are used and why; an error if they contradict."""
    nested = (used.manager, other.manager) == ("Open MPI", "SLURM")
    known = None not in (used.num_processes, other.num_processes)
    same = (used.process_id, used.num_processes) == (other.process_id, other.num_processes)
    if known and not same and not nested:
        raise DistributedError(
            f"The variables of two cluster managers are set and contradict: {used.manager} places this process "
            f"as process {used.process_id} of {used.num_processes} ({used.variables}), {other.manager} as process "
            f"{other.process_id} of {other.num_processes} ({other.variables}); expected one manager's. Fix: unset "
            "the variables of the manager that did not start this process (inherited from the environment that "
            "submitted the job)."
        )
    if nested:
        why = "mpirun started this process inside the SLURM allocation (JAX reads them in the same order)"
    else:
        why = f"it comes first in estimax's order ({_ORDER})" + (
            f"; they agree: process {used.process_id} of {used.num_processes}" if known else ""
        )
    logger.warning("The variables of %s and %s are both set; using %s's: %s.", used.manager, other.manager,
                   used.manager, why)  # fmt: skip


def _kubeflow(env: Mapping[str, str]) -> Placement | None:
    """Kubeflow Trainer's JAX runtime: JAX's own variables, of which JAX itself reads only the address."""
    if "JAX_COORDINATOR_ADDRESS" not in env or "SLURM_JOB_ID" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return None
    manager = "Kubeflow Trainer"
    size, rank, said = _rank(env, manager, "JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "JAX_COORDINATOR_ADDRESS")
    return Placement(manager, env["JAX_COORDINATOR_ADDRESS"], size, rank, variables=said)


def _skypilot(env: Mapping[str, str]) -> Placement | None:
    """SkyPilot: the nodes' IPs (the first is the head), their number and this node's rank."""
    if "SKYPILOT_NODE_IPS" not in env:
        return None
    size, rank, said = _rank(env, "SkyPilot", "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_IPS")
    if size == 1:
        return None
    ips = env["SKYPILOT_NODE_IPS"].split()
    if len(ips) != size:
        raise DistributedError(
            f"SkyPilot: SKYPILOT_NODE_IPS={env['SKYPILOT_NODE_IPS']!r} lists {len(ips)} node IPs and "
            f"SKYPILOT_NUM_NODES={size}; expected one IP per node, the head's first. Fix: run the command as "
            "a SkyPilot task's `run:` (which sets all three), or set SKYPILOT_NODE_IPS to the nodes' IPs, one a line."
        )
    coordinator = f"{ips[0]}:{env.get(PORT_ENV, DEFAULT_PORT)}"
    return Placement("SkyPilot", coordinator, size, rank, variables=said)


def _indexed_job(env: Mapping[str, str]) -> Placement | None:
    """A Kubernetes Indexed Job or JobSet: the pod's index; the size and the coordinator from estimax's
    variables (JAX finds them itself with ``jax[k8s]``, by listing the job's pods)."""
    if "JOB_COMPLETION_INDEX" not in env or "KUBERNETES_SERVICE_HOST" not in env:
        return None
    manager = "Kubernetes Indexed Job"
    size, coordinator = env.get("ESTIMAX_NUM_PROCESSES"), env.get("ESTIMAX_COORDINATOR")
    if size and coordinator:
        size, rank, said = _rank(env, manager, "JOB_COMPLETION_INDEX", "ESTIMAX_NUM_PROCESSES")
        return Placement(manager, coordinator, size, rank, variables=said)
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


def _open_mpi(env: Mapping[str, str]) -> Placement | None:
    """``mpirun``: JAX detects the group; the GPUs of each rank are set here."""
    if "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    manager = "Open MPI"
    size, rank, said = _rank(env, manager, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
    if size == 1:
        return None
    local_rank, local_size = "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"
    if local_rank in env and not env.get(local_size):
        _required(env, local_size, manager, local_rank)
    on_node = _int(env, local_size, manager, 1)
    gpus = _share_of_node(env, manager, _int(env, local_rank, manager, 0), on_node, f"{local_size}={on_node}")
    return Placement(manager, None, size, rank, gpus, variables=said)


def _slurm(env: Mapping[str, str]) -> Placement | None:
    """``srun``: JAX detects the group; the GPUs of each task are set here."""
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env or _int(env, "SLURM_NTASKS", "SLURM", 1) <= 1:
        return None
    size, rank, said = _rank(env, "SLURM", "SLURM_PROCID", "SLURM_NTASKS")
    on_node, on_node_said = _tasks_on_this_node(env)
    gpus = _share_of_node(env, "SLURM", _int(env, "SLURM_LOCALID", "SLURM", 0), on_node, on_node_said)
    return Placement("SLURM", None, size, rank, gpus, variables=said)


_READERS = (_kubeflow, _skypilot, _indexed_job, _open_mpi, _slurm)
_ORDER = "Kubeflow Trainer, SkyPilot, Kubernetes Indexed Job, Open MPI, SLURM"


def _share_of_node(
    env: Mapping[str, str], manager: str, local_rank: int, on_node: int | None, on_node_said: str
) -> tuple[int, ...] | None:
    """This process's GPUs (``local_gpus``), once its local rank is checked against its node's
    process count (``None``: unknown, taken as 1 for local rank 0); GPUs that no process of the
    node gets are named (by local rank 0, once a node)."""
    rank_name = "SLURM_LOCALID" if manager == "SLURM" else "OMPI_COMM_WORLD_LOCAL_RANK"
    visible = _visible_gpus(env)
    if on_node is None:
        if not visible or local_rank == 0:
            return local_gpus(0, 1, len(visible)) if visible else None
        on_node = 1
    if not 0 <= local_rank < on_node:
        raise DistributedError(
            f"{manager}: {rank_name}={local_rank} with {on_node_said}; expected a local rank from 0 to "
            f"{on_node - 1}: a process would drive GPUs that the node does not have. Fix: let {manager} set both "
            "(a value set by hand or inherited from another job overrides its own)."
        )
    if visible and local_rank == 0 and idle_gpus(visible, on_node):
        logger.warning("%s: %d processes on this node (%s) %s", manager, on_node, on_node_said,
                       idle_gpus(visible, on_node))  # fmt: skip
    return local_gpus(local_rank, on_node, len(visible) if visible else None)


def idle_gpus(visible: list[str], processes: int) -> str:
    """What to say when an equal share of the ``visible`` GPUs for each of ``processes`` leaves some
    idle (``""``: none idle, or each process bound to its own by the manager)."""
    if len(visible) < processes or not len(visible) % processes:
        return ""
    share = len(visible) // processes
    fits = ", ".join(str(n) for n in range(1, len(visible) + 1) if len(visible) % n == 0)
    idle = ", ".join(visible[processes * share :])
    return (
        f"share the node's {len(visible)} visible GPUs {share} each; GPUs {idle} stay idle. "
        f"Fix: run {fits} processes per node, or bind GPUs to tasks (e.g. --gpus-per-task)."
    )


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


def _visible_gpus(env: Mapping[str, str]) -> list[str] | None:
    """The names of the GPUs this process sees: ``CUDA_VISIBLE_DEVICES``'s, else SLURM's count."""
    devices = env.get("CUDA_VISIBLE_DEVICES")
    if devices is not None and devices.strip():
        return [d.strip() for d in devices.split(",") if d.strip()]
    gpus = env.get("SLURM_GPUS_ON_NODE")
    return [str(i) for i in range(int(gpus))] if gpus and gpus.isdigit() else None


def _tasks_on_this_node(env: Mapping[str, str]) -> tuple[int | None, str]:
    """The number of tasks of this node and the variable that says it: the step's
    ``SLURM_STEP_TASKS_PER_NODE`` (``"2(x3),1"``: 2 tasks on each of 3 nodes, then 1), else
    ``SLURM_NTASKS_PER_NODE``, else the job's ``SLURM_TASKS_PER_NODE``; ``None`` with none of them."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        text = env.get(name, "")
        counts = [
            int(c) for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", text) for c in [count] * int(repeat or 1)
        ]
        if not counts:
            continue
        node = _int(env, "SLURM_NODEID", "SLURM", 0) if len(counts) > 1 else 0
        if not 0 <= node < len(counts) or counts[node] < 1:
            raise DistributedError(
                f"SLURM: {name}={text!r} with SLURM_NODEID={node}; expected a count >= 1 of tasks for this node "
                f"(one entry per node). Fix: let srun set them (--ntasks-per-node >= 1)."
            )
        return counts[node], f"{name}={text!r}" + (f", SLURM_NODEID={node}" if len(counts) > 1 else "")
    return None, "none of SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE"


def _rank(env: Mapping[str, str], manager: str, rank_name: str, size_name: str, because: str | None = None):
    """``(size, rank, "the variables")`` of a manager, checked: ``0 <= rank < size``. ``because``: the
    variable whose presence says this is that manager, so that a missing one is named with it."""
    if because is not None:
        size, rank = _required(env, size_name, manager, because), _required(env, rank_name, manager, because)
    else:
        size, rank = _int(env, size_name, manager), _int(env, rank_name, manager)
    said = f"{rank_name}={rank}, {size_name}={size}"
    if size < 1 or not 0 <= rank < size:
        expected = f"a rank from 0 to {size - 1}" if size >= 1 else f"{size_name} >= 1"
        raise DistributedError(
            f"{manager}: {said}; expected {expected}. Fix: let {manager} set both (a value set by hand or "
            "inherited from another job overrides its own)."
        )
    return size, rank, said


def _int(env: Mapping[str, str], name: str, manager: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None or text == "":
        if default is None:
            raise DistributedError(f"{manager}: {name} is not set; expected an integer. Fix: let {manager} set it.")
        return default
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"{manager}: {name}={text!r} is not an integer; expected e.g. {name}=2.") from None


def _required(env: Mapping[str, str], name: str, manager: str, because: str) -> int:
    if not env.get(name):
        raise DistributedError(
            f"{because} is set, so this looks like {manager}, but {name} is not; expected both. Fix: set {name} "
            f"(or unset {because} to run one process)."
        )
    return _int(env, name, manager)


def without_manager(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without the variables by which a manager places a process (for ``estimax launch``'s
    children, which form a group of their own)."""
    return {k: v for k, v in env.items() if not k.startswith(MANAGER_VARIABLES)}


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
