"""Cluster managers: each one's variables read as its processes get them (pure), and real groups of two
processes on 127.0.0.1 formed from Kubeflow's, SkyPilot's and SLURM's variables alone."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import warm
from helpers import (
    MULTIHOST_JOB,
    MULTIHOST_STEPS,
    checkpoint_steps,
    job_env,
    launch_group,
    max_difference,
    read_result,
)

from estimax.distributed import free_port
from estimax.errors import DistributedError
from estimax.group import clusters

EIGHT_GPUS = "0,1,2,3,4,5,6,7"


# -- what each manager's variables say ------------------------------------------------------


def test_kubeflow_trainer():
    env = {"JAX_COORDINATOR_ADDRESS": "trainer-node-0-0.trainer:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert clusters.detect(env) == clusters.Placement("Kubeflow Trainer", "trainer-node-0-0.trainer:1234", 4, 3)
    with pytest.raises(DistributedError, match="JAX_COORDINATOR_ADDRESS is set.*but JAX_NUM_PROCESSES is not"):
        clusters.detect({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"})


def test_skypilot():
    env = {"SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1"}
    assert clusters.detect(env) == clusters.Placement("SkyPilot", "10.0.0.5:8476", 2, 1)
    assert clusters.detect({**env, "ESTIMAX_COORDINATOR_PORT": "9000"}).coordinator == "10.0.0.5:9000"
    one_node = {**env, "SKYPILOT_NUM_NODES": "1", "SKYPILOT_NODE_IPS": "10.0.0.5", "SKYPILOT_NODE_RANK": "0"}
    assert clusters.detect(one_node) is None


def test_kubernetes_indexed_job():
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "JOB_COMPLETION_INDEX": "2"}
    env = {**pod, "ESTIMAX_NUM_PROCESSES": "4", "ESTIMAX_COORDINATOR": "train-0.train:1234"}
    assert clusters.detect(env) == clusters.Placement("Kubernetes Indexed Job", "train-0.train:1234", 4, 2)
    if clusters.importlib.util.find_spec("kubernetes") is None:  # without jax[k8s]: say what is missing
        with pytest.raises(DistributedError, match="JOB_COMPLETION_INDEX=2.*expected ESTIMAX_NUM_PROCESSES and "):
            clusters.detect(pod)


def test_slurm_one_task_per_node_drives_every_gpu_of_its_node():
    node = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1"}
    one_per_node = {**node, "SLURM_NTASKS_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": EIGHT_GPUS}
    assert clusters.detect(one_per_node) == clusters.Placement("SLURM", None, 2, 1, tuple(range(8)))
    # 8 tasks on each of 2 nodes, all 8 GPUs visible to each: task 3 of its node drives GPU 3.
    per_gpu = {**node, "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}
    assert clusters.detect({**per_gpu, "CUDA_VISIBLE_DEVICES": EIGHT_GPUS}).local_device_ids == (3,)
    # Bound by SLURM (--gpus-per-task=1): the task sees its one GPU.
    assert clusters.detect({**per_gpu, "CUDA_VISIBLE_DEVICES": "5"}).local_device_ids == (0,)
    assert clusters.detect({**per_gpu, "SLURM_GPUS_ON_NODE": "8"}).local_device_ids == (3,)
    assert clusters.detect({**node, "SLURM_NTASKS_PER_NODE": "1"}).local_device_ids is None  # no GPUs
    assert clusters.detect({**node, "SLURM_NTASKS": "1"}) is None  # one task: no group


def test_open_mpi_gives_each_rank_its_share():
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    env |= {"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "CUDA_VISIBLE_DEVICES": EIGHT_GPUS}
    assert clusters.detect(env) == clusters.Placement("Open MPI", None, 4, 3, (4, 5, 6, 7))


def test_no_manager_and_launch_children_see_none():
    assert clusters.detect({"HOME": "/root", "PATH": "/bin"}) is None
    env = {"SLURM_JOB_ID": "7", "OMPI_COMM_WORLD_SIZE": "2", "JAX_COORDINATOR_ADDRESS": "h:1", "PATH": "/bin"}
    assert clusters.without_manager({**env, "SKYPILOT_NODE_RANK": "1", "JOB_COMPLETION_INDEX": "0"}) == {"PATH": "/bin"}


def _one_line(env, match):
    with pytest.raises(DistributedError, match=match) as error:
        clusters.detect(env)
    assert "\n" not in str(error.value) and "Fix: " in str(error.value)


SLURM_TASK = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_NODEID": "1"}
SKYPILOT_NODE = {"SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "1"}


def test_contradicting_variables_are_one_line_naming_the_manager_the_variable_and_its_value():
    _one_line(
        {**SKYPILOT_NODE, "SKYPILOT_NODE_IPS": ""},
        r"^SkyPilot: SKYPILOT_NODE_IPS='' lists 0 node IPs and SKYPILOT_NUM_NODES=2; expected one IP per node",
    )
    _one_line(
        {**SKYPILOT_NODE, "SKYPILOT_NODE_RANK": "-1"},
        r"^SkyPilot: SKYPILOT_NODE_RANK=-1, SKYPILOT_NUM_NODES=2; expected a rank from 0 to 1\.",
    )
    _one_line(
        {**SLURM_TASK, "SLURM_NTASKS_PER_NODE": "0"},
        r"^SLURM: SLURM_NTASKS_PER_NODE='0' with SLURM_NODEID=0; expected a count >= 1 of tasks for this node",
    )
    _one_line(  # before: GPUs 6 and 7 of a node of 4
        {**SLURM_TASK, "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1,2,3"},
        r"^SLURM: SLURM_LOCALID=3 with SLURM_NTASKS_PER_NODE='2'; expected a local rank from 0 to 1",
    )
    _one_line(  # a second task of its node, but how many the node runs is not said: no share can be chosen
        {**SLURM_TASK, "SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "0,1"},
        r"^SLURM: SLURM_LOCALID=1 with none of SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE",
    )
    mpi = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    _one_line(  # before: GPUs 2 and 3 of a node of 2
        {**mpi, "CUDA_VISIBLE_DEVICES": "0,1"},
        r"^OMPI_COMM_WORLD_LOCAL_RANK is set, so this looks like Open MPI, but OMPI_COMM_WORLD_LOCAL_SIZE is not",
    )
    _one_line(
        {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "5"},
        r"^Kubeflow Trainer: JAX_PROCESS_ID=5, JAX_NUM_PROCESSES=2; expected a rank from 0 to 1\.",
    )
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "ESTIMAX_NUM_PROCESSES": "2", "ESTIMAX_COORDINATOR": "t-0.t:1"}
    _one_line(
        {**pod, "JOB_COMPLETION_INDEX": "5"},
        r"^Kubernetes Indexed Job: JOB_COMPLETION_INDEX=5, ESTIMAX_NUM_PROCESSES=2; expected a rank from 0 to 1\.",
    )
    _one_line(
        {**SLURM_TASK, **SKYPILOT_NODE},
        r"^The variables of two cluster managers are set and contradict: SkyPilot places this process as process 1 "
        r"of 2 \(SKYPILOT_NODE_RANK=1, SKYPILOT_NUM_NODES=2\), SLURM as process 3 of 4 \(SLURM_PROCID=3, "
        r"SLURM_NTASKS=4\)",
    )


def test_a_process_never_picks_a_gpu_that_its_node_does_not_have():
    for visible in range(1, 9):
        for on_node in range(1, 9):
            for local in range(on_node):
                env = {**SLURM_TASK, "SLURM_LOCALID": str(local), "SLURM_NTASKS_PER_NODE": str(on_node)}
                gpus = clusters.detect({**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(visible)))})
                assert gpus.local_device_ids and set(gpus.local_device_ids) <= set(range(visible))


def test_two_managers_that_agree_and_idle_gpus_are_warnings(estimax_log):
    agreeing = {**SKYPILOT_NODE, **SLURM_TASK, "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    assert clusters.detect(agreeing).manager == "SkyPilot"
    mpi = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "5"}  # mpirun inside an sbatch allocation
    assert clusters.detect({**SLURM_TASK, **mpi}).process_id == 5
    three = {
        **SLURM_TASK,
        "SLURM_LOCALID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
        "CUDA_VISIBLE_DEVICES": EIGHT_GPUS,
    }
    assert clusters.detect(three).local_device_ids == (0, 1)
    assert [r.getMessage() for r in estimax_log.records if r.levelname == "WARNING"] == [
        "The variables of SkyPilot and SLURM are both set; using SkyPilot's: it comes first in estimax's order "
        "(Kubeflow Trainer, SkyPilot, Kubernetes Indexed Job, Open MPI, SLURM); they agree: process 1 of 2.",
        "The variables of Open MPI and SLURM are both set; using Open MPI's: mpirun started this process inside the "
        "SLURM allocation (JAX reads them in the same order).",
        "SLURM: 3 processes on this node (SLURM_STEP_TASKS_PER_NODE='3(x2)', SLURM_NODEID=1) share the node's 8 "
        "visible GPUs 2 each; GPUs 6, 7 stay idle. Fix: run 1, 2, 4, 8 processes per node, or bind GPUs to tasks (e.g. "
        "--gpus-per-task).",
    ]


def test_the_command_line_stops_on_contradicting_variables_before_anything_starts(tmp_path):
    env = job_env(**{**SKYPILOT_NODE, "SKYPILOT_NODE_IPS": ""})
    command = [sys.executable, "-m", "estimax.cli", "train", "--model-dir", str(tmp_path / "run"), "--max-steps", "1"]
    result = warm.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and not (tmp_path / "run").exists()
    assert result.stderr.strip().splitlines()[-1].startswith("estimax: error: SkyPilot: SKYPILOT_NODE_IPS='' lists 0")


# -- real groups of two processes -----------------------------------------------------------


def _group(manager_env, *job_args):
    """Two processes of the job, each with its own variables of one manager; returns their output."""
    processes = [
        warm.Popen(
            [sys.executable, MULTIHOST_JOB, *job_args],
            env=job_env(JAX_NUM_CPU_DEVICES="4", **manager_env(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    return outputs


@pytest.fixture(scope="module")
def one_process(multihost_references):
    return multihost_references.one


def _kubeflow(port):
    return lambda rank: {
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": str(rank),
    }


def _skypilot(port):
    return lambda rank: {
        "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NODE_RANK": str(rank),
        "ESTIMAX_COORDINATOR_PORT": str(port),
    }


@pytest.mark.parametrize("manager, name", [(_kubeflow, "Kubeflow Trainer"), (_skypilot, "SkyPilot")])
def test_a_managers_two_processes_train_like_one_process(manager, name, one_process, tmp_path):
    out = _group(manager(free_port()), str(tmp_path / "run"), str(tmp_path / "out"), "train", str(MULTIHOST_STEPS))
    two = read_result(tmp_path / "out")
    assert (two["processes"], two["devices"]) == (2, 8)
    assert max_difference(one_process["losses"], two["losses"]) <= 1e-5
    assert max_difference(one_process["params"], two["params"]) <= 1e-5
    assert f"Process 0 of 2 joined the group ({name}) at 127.0.0.1:" in out[0]


SHOW_GPUS = textwrap.dedent(
    """
    from estimax import distributed
    import jax
    distributed.initialize()
    print("GPUS", jax.process_index(), jax.process_count(), jax.config._read("jax_cuda_visible_devices"), flush=True)
    """
)


def _free_slurm_job_id() -> int:
    """A job id whose coordinator port (JAX: 61440 + job id % 4096) nothing listens on."""
    for job_id in range(1000, 4096):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + job_id))
                return job_id
            except OSError:
                continue
    pytest.skip("no free port in 61440-65535, where JAX puts a SLURM group's coordinator")


def test_slurm_one_task_per_node_is_not_narrowed_to_gpu_0():
    job_id = _free_slurm_job_id()

    def slurm(rank):
        return {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": str(rank),
            "SLURM_NTASKS_PER_NODE": "1",
            "CUDA_VISIBLE_DEVICES": EIGHT_GPUS,
        }

    processes = [
        subprocess.Popen([sys.executable, "-c", SHOW_GPUS], env=job_env(**slurm(r)), stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    lines = sorted(line for p in processes for line in p.communicate(timeout=120)[0].splitlines() if "GPUS" in line)
    # Before: "0" in both (JAX's detection narrows every process to its local rank).
    assert lines == [f"GPUS 0 2 {EIGHT_GPUS}", f"GPUS 1 2 {EIGHT_GPUS}"]


LAUNCHED = textwrap.dedent(
    """
    import os, json
    keys = sorted(k for k in os.environ if k.startswith(("SLURM_", "JAX_COORDINATOR", "ESTIMAX_PROCESS_ID")))
    print("ENV", json.dumps({k: os.environ[k] for k in keys}), os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
    """
)


def test_launch_inside_a_managed_step_gives_children_their_own_group_and_gpus():
    env = job_env(SLURM_JOB_ID="9", SLURM_PROCID="0", SLURM_NTASKS="1", CUDA_VISIBLE_DEVICES="2,3,4,5")
    env["JAX_COORDINATOR_ADDRESS"] = "10.0.0.1:1234"
    command = [sys.executable, "-m", "estimax.cli", "launch", "--num-processes", "2", "--", sys.executable, "-c"]
    out = subprocess.run([*command, LAUNCHED], env=env, capture_output=True, text=True, timeout=120).stdout
    children = sorted(line.split("ENV ", 1)[1] for line in out.splitlines() if "ENV " in line)
    assert children == ['{"ESTIMAX_PROCESS_ID": "0"} 2,3', '{"ESTIMAX_PROCESS_ID": "1"} 4,5'], out
    command[command.index("--num-processes") + 1] = "3"
    out = subprocess.run([*command, LAUNCHED], env=env, capture_output=True, text=True, timeout=120).stdout
    assert "[launch] warning: 3 processes share the node's 4 visible GPUs 1 each; GPUs 5 stay idle." in out


SIGNALLED = textwrap.dedent(
    """
    import sys
    from models import blobs, estimator
    import estimax as ex

    class Say(ex.Hook):
        def after_loop(self, loop):
            if loop.step_after == 4:
                print("training", flush=True)

    est = estimator(sys.argv[1], steps_per_loop=2)
    est.train(ex.data.from_arrays(*blobs(256)), max_steps=10**8, hooks=[Say()])
    """
)


def test_sigusr1_saves_and_exits_for_requeue(tmp_path):
    model_dir = str(tmp_path / "run")
    process = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED, model_dir],
        env=job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in process.stdout:  # the child's readiness line, not a sleep
        if "training" in line:
            break
    process.send_signal(signal.SIGUSR1)  # SLURM's `--signal=USR1@90`
    out = process.communicate(timeout=120)[0]
    assert process.returncode == 75, out
    assert "SIGUSR1 received: finishing the current loop, then saving and exiting." in out
    assert any(name.isdigit() for name in os.listdir(os.path.join(model_dir, "checkpoints")))


def test_launch_inside_a_step_of_many_tasks_is_refused():
    env = job_env(SLURM_JOB_ID="9", SLURM_PROCID="1", SLURM_NTASKS="4", SLURM_LOCALID="1")
    command = [sys.executable, "-m", "estimax.cli", "launch", "--num-processes", "2", "--", sys.executable, "-c", ""]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "a process of a SLURM group; expected one launcher per machine" in result.stderr


def test_sigusr1_to_every_process_of_a_group_saves_one_step(tmp_path):
    """`--signal=USR1@90` reaches every task of the step: the group saves one step and exits 75."""
    model_dir, out_dir = str(tmp_path / "run"), str(tmp_path / "out")
    group = launch_group(model_dir, out_dir, "train", str(MULTIHOST_STEPS), "0.5")
    for line in group.stdout:  # a train line of process 0: the group trains (a readiness line, not a sleep)
        if "estimax  train step" in line:
            break
    while not all(os.path.exists(f"{out_dir}/pid-{i}") for i in range(2)):
        assert group.poll() is None, group.communicate()[0]
        time.sleep(0.01)  # not a spin: the group needs these cores
    for i in range(2):
        with open(f"{out_dir}/pid-{i}") as f:
            os.kill(int(f.read()), signal.SIGUSR1)
    out = group.communicate(timeout=120)[0]
    assert group.returncode == 75, out
    assert "SIGUSR1 received: handled as SIGTERM" in out
    assert max(checkpoint_steps(model_dir)) < MULTIHOST_STEPS  # stopped early, at one saved step
