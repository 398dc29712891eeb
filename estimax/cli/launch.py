"""``estimax launch``: a group of processes on this machine, supervised like torchrun.

Owns starting N copies of a command on 127.0.0.1 with a fresh coordinator
port (each told its place through ``ESTIMAX_COORDINATOR``,
``ESTIMAX_NUM_PROCESSES`` and ``ESTIMAX_PROCESS_ID``, which
``distributed.initialize`` reads), prefixing their output with the process
id, and supervising them. Failure in ``jax.distributed`` is fate-shared: when
one process exits with an error or dies, the others are stopped and the whole
group starts again (the command resumes from its latest checkpoint), up to
``max_restarts`` times. A preemption exit (75) is passed through, never
restarted: the machine is going away. Inside a cluster manager's step the
children get none of its variables (they are a group of their own) and an
equal share of the visible GPUs each. SIGTERM or Ctrl-C to the launcher is
forwarded to every process as SIGTERM (save, then exit 75).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from estimax.errors import PREEMPTED_EXIT_CODE, ConfigError, DistributedError
from estimax.group import clusters
from estimax.group.clusters import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV, free_port
from estimax.group.peers import PEER_LOST_EXIT_CODE

RESTART_ENV = "ESTIMAX_RESTART"  # 0 for the first start of the group, then 1, 2, ...
POLL_SECONDS = 0.05


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    max_restarts: int = 0,
    output=None,
) -> int:
    """Runs ``command`` as ``num_processes`` processes until they all end; returns the exit code.

    ``devices_per_process`` simulates that many CPU devices in each process
    (``JAX_NUM_CPU_DEVICES``, CPU platform), for trying multi-host code on
    one machine. Returns 0 when every process succeeded, 75 when the group
    was preempted, else the failing process's code (128 + signal if killed).
    """
    if not command:
        raise ConfigError(
            "estimax launch received no command; expected one after `--`, e.g. "
            "`estimax launch --num-processes 2 -- estimax train`."
        )
    for name, value, least in (("num_processes", num_processes, 1), ("max_restarts", max_restarts, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"launch({name}={value!r}); expected an integer >= {least}.")
    if devices_per_process is not None and devices_per_process < 1:
        raise ConfigError(f"launch(devices_per_process={devices_per_process!r}); expected an integer >= 1.")
    _refuse_inside_a_group(os.environ)
    printer = _Printer(output or sys.stdout)
    for restart in range(max_restarts + 1):
        group = _Group(command, num_processes, devices_per_process, restart, printer)
        code, failed = group.wait()
        if not failed or group.signalled or restart == max_restarts:
            if failed:
                printer.line("launch", f"giving up after {restart} restart(s); exit code {code}")
            return code
        printer.line("launch", f"restarting the group from its latest checkpoint ({restart + 1} of {max_restarts})")
    return 1  # not reached


class _Printer:
    """Whole lines from every process, each prefixed with its source, never interleaved."""

    def __init__(self, stream):
        self.stream, self._lock = stream, threading.Lock()

    def line(self, source, text: str) -> None:
        with self._lock:
            self.stream.write(f"[{source}] {text.rstrip()}\n")
            self.stream.flush()

    def follow(self, source, pipe) -> threading.Thread:
        def run():
            for text in iter(pipe.readline, ""):
                self.line(source, text)
            pipe.close()

        thread = threading.Thread(target=run, daemon=True, name=f"estimax-launch-{source}")
        thread.start()
        return thread


class _Group:
    """One start of the N processes, and how it ended."""

    def __init__(self, command, num_processes, devices_per_process, restart, printer: _Printer):
        port = free_port()
        self.printer, self.signalled = printer, False
        printer.line("launch", f"starting {num_processes} processes, coordinator 127.0.0.1:{port}: {' '.join(command)}")
        self.processes, self.readers = [], []
        # Inside a managed step (srun, mpirun, a pod): the children form a group of their own, so the
        # manager's variables stay out of their environment, and each gets its share of the GPUs.
        inherited = clusters.without_manager(os.environ)
        gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        if devices_per_process is None and clusters.idle_gpus(gpus, num_processes):
            printer.line("launch", f"warning: {num_processes} processes {clusters.idle_gpus(gpus, num_processes)}")
        for i in range(num_processes):
            env = dict(inherited)
            share = clusters.local_gpus(i, num_processes, len(gpus)) if len(gpus) >= num_processes else None
            if share is not None and devices_per_process is None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[g] for g in share)
            env.update(
                {
                    COORDINATOR_ENV: f"127.0.0.1:{port}",
                    NUM_PROCESSES_ENV: str(num_processes),
                    PROCESS_ID_ENV: str(i),
                    RESTART_ENV: str(restart),
                    "PYTHONUNBUFFERED": "1",
                }
            )
            if devices_per_process is not None:
                env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices_per_process))
            process = subprocess.Popen(
                list(command),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # its own process group: stopping it stops its workers too
            )
            self.processes.append(process)
            self.readers.append(printer.follow(i, process.stdout))

    def wait(self) -> tuple[int, bool]:
        """``(exit code, whether it failed)``, once every process has ended."""
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
        try:
            while True:
                codes = [p.poll() for p in self.processes]
                bad = [(i, c) for i, c in enumerate(codes) if c is not None and c not in (0, PREEMPTED_EXIT_CODE)]
                if bad:
                    i, code = min(bad, key=_consequence_rank)
                    also = "; ".join(f"process {j} {_describe(c)}" for j, c in bad if j != i)
                    also = f" (already ended: {also})" if also else ""
                    self.printer.line("launch", f"process {i} {_describe(code)}; stopping the others{also}")
                    self._kill()
                    return _exit_code(code), True
                if all(c is not None for c in codes):
                    self._drain()
                    return (PREEMPTED_EXIT_CODE if PREEMPTED_EXIT_CODE in codes else 0), False
                time.sleep(POLL_SECONDS)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _forward(self, signum, frame) -> None:
        """A scheduler's SIGTERM (or Ctrl-C) reaches every process as SIGTERM: they save and exit 75."""
        if self.signalled:  # the second time: stop now
            self._kill()
            return
        self.signalled = True
        self.printer.line("launch", f"{signal.Signals(signum).name}: asking every process to save and exit")
        for p in self.processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)

    def _kill(self) -> None:
        # SIGKILL, not SIGTERM: in a broken group the others are stuck in a collective and
        # cannot save anyway; the latest complete checkpoint is where the restart begins.
        for p in self.processes:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.processes:
            p.wait()
        self._drain()

    def _drain(self) -> None:
        for reader in self.readers:
            reader.join(timeout=5)


def _consequence_rank(failure: tuple[int, int]) -> tuple[int, int]:
    """Orders failures found at one poll, the likeliest cause first: when one process dies, another
    may abort within milliseconds (its collective's peer is gone: SIGABRT) or stop on losing it (69)."""
    process, code = failure
    return {PEER_LOST_EXIT_CODE: 2, -signal.SIGABRT: 1}.get(code, 0), process


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _refuse_inside_a_group(env) -> None:
    """One launcher per machine: a copy in every task of a larger group would each start a group."""
    try:
        placement = clusters.detect(env)
    except DistributedError:  # incomplete variables: the children do not see them anyway
        return
    if placement is not None and placement.num_processes != 1:
        raise ConfigError(
            f"estimax launch runs in a process of a {placement.manager} group; expected one launcher per "
            "machine: each copy would start a group of its own. Fix: start it as one task (`srun --ntasks=1 "
            f"--nodes=1 estimax launch ...`), or let {placement.manager} start every process without estimax "
            "launch (`srun estimax train ...`)."
        )
