"""Many processes, one program: ``jax.distributed`` initialisation and named barriers.

Owns joining the group (from arguments, from the ``ESTIMAX_*`` environment
variables that ``estimax launch`` sets, from a cluster manager's variables
(``clusters.py``), or by JAX's own detection on a Cloud TPU VM), checking
the place it is given, starting the watch that stops the survivors within a
bound when a process is lost (``peers.py``), quieting the console of every
process but 0, and barriers with a timeout that say which process is late
and what it was last doing, instead of waiting forever. Does not own
restarting a failed group (``launch.py``, a cluster manager): only a
supervisor can start the group again.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import jax

from estimax.errors import ConfigError, DistributedError, SyncTimeoutError
from estimax.group import clusters, peers
from estimax.group.clusters import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV
from estimax.group.clusters import free_port as free_port  # estimax.distributed.free_port, as documented

logger = logging.getLogger("estimax")

ALL_LOGS_ENV = "ESTIMAX_LOG_ALL_PROCESSES"
"""The variable that, set to ``1``, makes every process log INFO lines, not only process 0."""
_STATUS_KEY = "estimax/status/"


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    force: bool = False,
    timeout_seconds: int = 300,
    peer_timeout_seconds: float | None = None,
) -> bool:
    """Joins this process to the group before anything touches devices; returns whether it did.

    Arguments left ``None`` come from ``ESTIMAX_COORDINATOR``,
    ``ESTIMAX_NUM_PROCESSES`` and ``ESTIMAX_PROCESS_ID`` (``estimax launch``
    sets them), then from JAX's detection (``JAX_COORDINATOR_ADDRESS``, SLURM,
    Open MPI, Cloud TPU). With none of them this is one process and nothing is
    done, unless ``force=True``: then a group of one on 127.0.0.1 starts, which
    JAX's preemption sync needs. Calling it again is a no-op.

    Args:
        coordinator: ``HOST:PORT`` of process 0.
        num_processes: how many processes the group has.
        process_id: this process's index in the group.
        force: start a group of one on 127.0.0.1 when nothing says there is a group.
        timeout_seconds: how long to wait for the group to gather.
        peer_timeout_seconds: how long a process may show no sign of life before
            every other one logs a line naming it and exits with
            ``PEER_LOST_EXIT_CODE`` (69), within 1.3 times that
            (``peers.bound_seconds``); default ``ESTIMAX_PEER_TIMEOUT_SECONDS``, else 10.
    """
    if jax.distributed.is_initialized():
        return True
    peer_timeout = peers.timeout_seconds(peer_timeout_seconds)
    coordinator = coordinator or os.environ.get(COORDINATOR_ENV)
    num_processes = _int_or_none(NUM_PROCESSES_ENV, num_processes)
    process_id = _int_or_none(PROCESS_ID_ENV, process_id)
    placement = None
    if None in (coordinator, num_processes, process_id) and num_processes != 1:
        placement = clusters.detect(os.environ)  # a cluster manager's variables fill the gaps
        if placement is not None:
            coordinator = coordinator or placement.coordinator
            num_processes = placement.num_processes if num_processes is None else num_processes
            process_id = placement.process_id if process_id is None else process_id
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()) and num_processes != 1:
        missing = [k for k, v in given.items() if v is None]
        if missing and placement is None and not _tpu_vm():
            raise ConfigError(
                f"distributed.initialize received {given}; expected all three of coordinator "
                "(host:port of process 0), num_processes and process_id, e.g. "
                "`estimax train --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0`. "
                f"Fix: also set {', '.join(missing)} (flags or ESTIMAX_* environment variables)."
            )
    elif num_processes == 1 or (placement is None and not _tpu_vm()):
        if not force:
            return False
        coordinator, num_processes, process_id = f"127.0.0.1:{free_port()}", 1, 0
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ConfigError(
            f"distributed.initialize received process_id={process_id} with num_processes={num_processes} (from "
            f"the arguments or {PROCESS_ID_ENV} / {NUM_PROCESSES_ENV}); expected a process_id from 0 to "
            f"{num_processes - 1}. Fix: give each of the {num_processes} processes its own id in that range."
        )
    devices = placement.local_device_ids if placement is not None else None
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=list(devices) if devices is not None else None,
            initialization_timeout=timeout_seconds,
            # JAX's own watch aborts every process from C++: the backstop, behind estimax's.
            heartbeat_timeout_seconds=max(10, math.ceil(peers.JAX_HEARTBEAT_FACTOR * peer_timeout)),
        )
    except RuntimeError as error:
        if "before any JAX" in str(error) or "must be called before" in str(error):
            raise DistributedError(
                "estimax.distributed.initialize() was called after JAX had started its devices; expected it "
                "first. Fix: call it at the top of the program, before building an Estimator or any array."
            ) from error
        raise
    if jax.process_count() > 1:
        host = coordinator.rsplit(":", 1)[0] if coordinator else None  # where the others reach process 0
        peers.PeerWatch(_client(), jax.process_index(), jax.process_count(), peer_timeout, host).start()
    if jax.process_index() != 0 and os.environ.get(ALL_LOGS_ENV) != "1":
        logger.setLevel(logging.WARNING)  # process 0 speaks for the group
    from estimax.records.writers import ensure_console

    ensure_console()  # the first line says which group this is, before any Estimator exists
    logger.info(
        "Process %d of %d joined the group (%s) at %s: %d local and %d global devices; a lost process stops "
        "the group within %g s",
        jax.process_index(),
        jax.process_count(),
        placement.manager if placement is not None else "estimax" if coordinator else "detected by JAX",
        coordinator or "(detected by JAX)",
        jax.local_device_count(),
        jax.device_count(),
        peers.bound_seconds(peer_timeout),
    )
    return True


def _int_or_none(env: str, value: int | None) -> int | None:
    if value is not None:
        return value
    text = os.environ.get(env)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{env}={text!r} is not an integer; expected e.g. {env}=2.") from None


def _tpu_vm() -> bool:
    """Whether this is a Cloud TPU VM, whose group JAX finds by itself through the metadata server."""
    try:  # TPU chips on the PCI bus: a local check
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # a private module of JAX: if it moved, the other managers still work
        return False


def _client():
    """JAX's coordination-service client (what ``multihost_utils`` uses too; not public API)."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


SyncTimeout = SyncTimeoutError  # the name of earlier releases


class Sync:
    """Named barriers with a timeout, and each process's last reported activity.

    With one process everything here is free and does nothing. With several,
    ``status(what)`` records what this process is doing (one small write to
    JAX's coordination service), and ``barrier(what)`` waits for every
    process; past ``timeout_seconds`` it raises ``SyncTimeoutError`` naming the
    processes that did not arrive and what they last reported.
    """

    def __init__(self, timeout_seconds: float = 300.0):
        self.timeout_seconds = timeout_seconds
        self._count = 0  # barriers are named by their order, the same on every process
        self._client = _client() if jax.process_count() > 1 else None

    def status(self, what: str) -> None:
        if self._client is not None:
            self._client.key_value_set(f"{_STATUS_KEY}{jax.process_index()}", what, allow_overwrite=True)

    def track_checkpoints(self, committed_step: Callable[[], int | None]) -> None:
        """``committed_step()`` gives the last committed checkpoint step, which the survivors name
        if a process of the group is lost."""
        watch = peers.this_process()
        if watch is not None:
            watch.track(committed_step)

    def barrier(self, what: str) -> None:
        if self._client is None:
            return
        self._count += 1
        arrived = f"waiting at barrier {self._count} ({what})"
        self.status(arrived)
        started = time.monotonic()
        try:
            self._client.wait_at_barrier(f"estimax/{self._count}", int(self.timeout_seconds * 1000))
        except Exception as error:  # jax's JaxRuntimeError: DEADLINE_EXCEEDED, or a peer gone
            raise SyncTimeoutError(self._late(what, arrived, time.monotonic() - started, error)) from error

    def share(self, what: str, value: str = "") -> str:
        """Process 0's ``value`` on every process (e.g. the outcome of taking the model_dir's lock);
        with one process, ``value`` itself."""
        if self._client is None:
            return value
        self._count += 1
        key = f"estimax/share/{self._count}"
        if jax.process_index() == 0:
            self._client.key_value_set(key, value)
            return value
        self.status(f"waiting for process 0 ({what})")
        try:
            return self._client.blocking_key_value_get(key, int(self.timeout_seconds * 1000))
        except Exception as error:
            raise SyncTimeoutError(
                f"Process {jax.process_index()} waited {self.timeout_seconds:g} s for process 0 ({what}); "
                f"JAX said: {str(error).splitlines()[0] if str(error) else type(error).__name__}. Fix: look at "
                "process 0's log."
            ) from error

    def gather(self, what: str, value: str) -> list[str]:
        """Every process's ``value``, in process order (a collective: each process calls it once
        at the same point); with one process, ``[value]``."""
        if self._client is None:
            return [value]
        self._count += 1
        key = f"estimax/gather/{self._count}/"
        self._client.key_value_set(f"{key}{jax.process_index()}", value)
        self.status(f"waiting for every process ({what})")
        try:
            return [
                self._client.blocking_key_value_get(f"{key}{p}", int(self.timeout_seconds * 1000))
                for p in range(jax.process_count())
            ]
        except Exception as error:
            raise SyncTimeoutError(
                f"Process {jax.process_index()} waited {self.timeout_seconds:g} s for every process ({what}); "
                f"JAX said: {str(error).splitlines()[0] if str(error) else type(error).__name__}. Fix: look at "
                "the other processes' logs."
            ) from error

    def _late(self, what: str, arrived: str, waited: float, error: Exception) -> str:
        statuses = {}
        try:
            statuses = {int(k.rsplit("/", 1)[1]): v for k, v in self._client.key_value_dir_get(_STATUS_KEY)}
        except Exception:  # the coordinator itself may be gone
            pass
        everyone = range(jax.process_count())
        late = {p: statuses.get(p, "nothing reported") for p in everyone if statuses.get(p) != arrived}
        named = "; ".join(f"process {p} was last: {doing}" for p, doing in sorted(late.items()))
        if statuses and not late:
            named = "none: this process is the late one (the others' barrier had already timed out)"
        said = str(error).splitlines()[0].rstrip(".") if str(error) else type(error).__name__
        return (
            f"Process {jax.process_index()} waited {waited:.0f} s at the barrier before '{what}' "
            f"(timeout {self.timeout_seconds:g} s); {len(late)} of {jax.process_count()} processes did not "
            f"arrive: {named or 'unknown (the coordination service did not answer)'}. JAX said: {said}. "
            "Fix: look at the late processes' logs (a crash, a slower input, a different command line); "
            "raise RunConfig(sync_timeout_seconds=...) if they are only slow. `estimax launch` restarts "
            "the group from the latest checkpoint."
        )
