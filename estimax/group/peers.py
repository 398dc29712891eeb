"""A lost peer named within seconds: the group's heartbeat, watched by process 0.

Owns telling the survivors of a group that a process is gone. Every process
but 0 writes a counter into JAX's coordination service every
``timeout / 10`` seconds; process 0 watches the counters, and when one has
not moved for ``timeout`` seconds (the process was killed, froze, ended on
an error, or its host went away) it gives each survivor one line that names
the lost process (its rank and host) and the last committed checkpoint
step. Every survivor logs that line and exits with ``PEER_LOST_EXIT_CODE`` at
once, also while its main thread waits in a collective that will never
finish. A process that ends its program normally says so first, so that it
is not taken for lost.

Why estimax's own heartbeat: JAX's reaction to a lost process is to abort
every other one from C++ (SIGABRT, "Terminating process because the JAX
distributed service detected fatal errors"), and the callback it would call
instead cannot be a Python function (jaxlib cannot pass it the status: the
process ends on ``std::bad_cast``). So JAX's heartbeat is set to three times
estimax's timeout and stays as the backstop. When process 0 itself is lost,
the coordination service it hosts goes with it, and JAX aborts the survivors
about a tenth of a second later. So each survivor also holds a plain TCP
connection to process 0 (its lifeline): the kernel closes it the moment
process 0 dies, and the survivor says its line and exits before JAX's client
aborts it (JAX's error thread wakes at the same moment: on a loaded host its
last words may come before the line); a process 0 that ends normally sends
one byte first. Where that connection cannot be made (a network that allows
only JAX's port), the beat's next call finds the service gone, and the line
races JAX's abort.

Does not own forming the group (``distributed.py``) nor starting it again
(``cli/launch.py``, a cluster manager): the same command resumes from the
last committed checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

from estimax.errors import ConfigError, EstimaxError

logger = logging.getLogger("estimax")

PEER_LOST_EXIT_CODE = 69
"""The exit status of a process that stopped because another process of its group was lost:
``EX_UNAVAILABLE``, apart from a preemption (75) and an error (1). Run the same command again:
it resumes from the last committed checkpoint."""
TIMEOUT_ENV = "ESTIMAX_PEER_TIMEOUT_SECONDS"
"""The variable that sets how long a process may show no sign of life before the group stops."""
DEFAULT_TIMEOUT_SECONDS = 10.0
JAX_HEARTBEAT_FACTOR = 3  # JAX's own heartbeat timeout, a multiple of estimax's: the backstop
_ALIVE = "estimax/alive/"
_WORD = "estimax/word/"  # process 0's line to each process, or the process's own word that it leaves
_TOLD = "estimax/lost-told/"
_LIFELINE = "estimax/lifeline"  # process 0's "host:port", where the others connect
_LEAVING = b"L"  # process 0's byte on its lifelines when it ends normally
# How long process 0 keeps the coordination service up after the survivors said they read its line:
# each exits right after saying so, but a loaded host may run it a moment later, and JAX aborts a
# process whose service went away (SIGABRT instead of PEER_LOST_EXIT_CODE).
_TOLD_GRACE_SECONDS = 1.0
_LEFT = "left"


def timeout_seconds(value: float | None = None) -> float:
    """``value``, else ``ESTIMAX_PEER_TIMEOUT_SECONDS``, else 10 s; checked."""
    source = f"peer_timeout_seconds={value!r}"
    if value is None:
        text = os.environ.get(TIMEOUT_ENV, "")
        source, value = f"{TIMEOUT_ENV}={text!r}", DEFAULT_TIMEOUT_SECONDS
        if text:
            try:
                value = float(text)
            except ValueError:
                value = -1.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(
            f"distributed.initialize received {source}; expected a positive number of seconds, how long a process "
            f"may show no sign of life before the others stop. Fix: e.g. {TIMEOUT_ENV}=30."
        )
    return float(value)


def bound_seconds(timeout: float) -> float:
    """How long after a process is lost every other one has stopped: ``timeout`` of silence, plus up to
    one interval for process 0 to see the last beat, one to look again and one to ask for the last
    committed step."""
    return timeout + 3 * timeout / 10


_this_process: PeerWatch | None = None
"""The watch of this process's JAX group: a process-global, as JAX's group is (one per process).
``this_process()`` is the one place that reads it."""


def this_process() -> PeerWatch | None:
    """This process's watch, once ``distributed.initialize`` formed a group of several processes."""
    return _this_process


class PeerWatch:
    """This process's part in the heartbeat: a beat (processes but 0) or the watch (process 0)."""

    def __init__(self, client, process: int, num_processes: int, timeout: float, host: str | None = None):
        """``host``: the address at which the others reach process 0 (the coordinator's host), if known."""
        self.client, self.process, self.num_processes, self.timeout = client, process, num_processes, timeout
        self.host = host or socket.gethostname()
        self._lifelines: list[socket.socket] = []  # process 0: one connection from each other process
        self._server: socket.socket | None = None  # process 0: where they connect
        self._coordinator_host = host  # the others: process 0's host, from its lifeline
        self._stopping = threading.Lock()  # one line, whichever thread sees the loss first
        self.committed_step: Callable[[], int | None] = lambda: None  # the last committed checkpoint
        self._committed: int | None = None  # its last answer
        self._asking: threading.Thread | None = None
        self.interval = timeout / 10  # see bound_seconds
        self._leaving = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="estimax-peers")

    def track(self, committed_step: Callable[[], int | None]) -> None:
        """``committed_step()`` gives the last committed checkpoint step, which a lost peer's line names."""
        self.committed_step = committed_step

    def start(self) -> None:
        global _this_process
        _this_process = self
        lifeline = self._hold_lifelines if self.process == 0 else self._watch_lifeline
        if self.process == 0:
            self._server = socket.create_server(("", 0), backlog=self.num_processes)
            self.client.key_value_set(_LIFELINE, f"{self.host}:{self._server.getsockname()[1]}", allow_overwrite=True)
        else:  # the first beat before initialize returns: a process frozen right after is still named by host
            self._alive(0)
        threading.Thread(target=lifeline, daemon=True, name="estimax-lifeline").start()
        self._thread.start()
        atexit.register(self.leave)  # before JAX's own shutdown, registered when JAX was imported

    def leave(self) -> None:
        """This process ends: its thread ends before JAX's client does (a thread inside the client at
        exit ends the process on a C++ exception), and, if it ends normally, it is no longer watched."""
        if self._leaving.is_set():
            return
        error = getattr(sys, "last_value", None)  # the uncaught error that ends the program, if any
        failed = error is not None
        if failed and not isinstance(error, EstimaxError):  # often a collective's, after a peer was lost:
            self._thread.join(timeout=bound_seconds(self.timeout))  # the watch may name the loss first
        self._leaving.set()
        if self.process == 0 and not failed:
            for connection in list(self._lifelines):  # not lost: it ends normally
                with contextlib.suppress(OSError):
                    connection.sendall(_LEAVING)
        try:
            if self.process != 0:
                self.client.key_value_set(f"{_WORD}{self.process}", _LEFT, allow_overwrite=True)  # wakes the beat
            self._thread.join(timeout=self.interval + 1)
            if self.process != 0 and not failed:  # a failed one says nothing: process 0 names it as lost
                self.client.key_value_set(f"{_ALIVE}{self.process}", _LEFT, allow_overwrite=True)
        except Exception:  # the coordinator is gone already: nobody to tell
            pass

    def _run(self) -> None:
        try:
            self._watch() if self.process == 0 else self._beat()
        except Exception as error:
            if self._leaving.is_set():
                return
            if self.process == 0:
                logger.warning("The watch over the group's processes stopped: %s", _first_line(error))
                return
            cause = f"JAX's coordination service it hosts does not answer ({_first_line(error)})"
            self._stop(self._coordinator_lost(cause))

    def _hold_lifelines(self) -> None:
        """Process 0: accepts each other process's connection and keeps it open while it lives."""
        with contextlib.suppress(OSError):
            while len(self._lifelines) < self.num_processes - 1:
                self._lifelines.append(self._server.accept()[0])

    def _watch_lifeline(self) -> None:
        """Every other process: its connection to process 0 ends the moment process 0 does."""
        try:
            host, port = self.client.blocking_key_value_get(_LIFELINE, 60_000).rsplit(":", 1)
            self._coordinator_host = host
            connection = socket.create_connection((host, int(port)), timeout=10)
            connection.settimeout(None)
            ended = connection.recv(1)
        except Exception:  # no lifeline here (a closed port, the service gone first): the beat watches
            return
        if ended != _LEAVING and not self._leaving.is_set():
            self._stop(self._coordinator_lost("its connection to this process closed"))

    def _alive(self, count: int) -> None:
        self.client.key_value_set(f"{_ALIVE}{self.process}", f"{count} {socket.gethostname()}", allow_overwrite=True)

    def _beat(self) -> None:
        count = 0
        while not self._leaving.is_set():
            count += 1
            self._alive(count)
            self._ask_committed(wait=False)  # the step to name if process 0 is lost: known beforehand
            try:  # waits one interval for process 0's word
                word = self.client.blocking_key_value_get(f"{_WORD}{self.process}", int(self.interval * 1000))
            except Exception as error:
                if "DEADLINE_EXCEEDED" in str(error) or "NOT_FOUND" in str(error):
                    continue
                raise
            if self._leaving.is_set():
                return
            self._say(word)
            self.client.key_value_set(f"{_TOLD}{self.process}", "1")
            self._exit()

    def _watch(self) -> None:
        started = time.monotonic()
        last_seen: dict[int, tuple[str | None, float]] = {}  # process -> (its beat, when it changed here)
        while not self._leaving.wait(self.interval):
            now = time.monotonic()
            beats = {int(k.rsplit("/", 1)[1]): v for k, v in self.client.key_value_dir_get(_ALIVE)}
            silent, left = {}, {p for p, beat in beats.items() if beat == _LEFT}
            for p in range(1, self.num_processes):
                beat, (seen, since) = beats.get(p), last_seen.get(p, (None, started))
                if p in left:
                    continue
                if beat != seen:
                    last_seen[p], since = (beat, now), now
                if now - since > self.timeout:
                    silent[p] = (beat.split(" ", 1)[1] if beat else "unknown", now - since)
            if silent:
                self._report(silent, left)
            self._ask_committed(wait=False)

    def _ask_committed(self, wait: bool = True) -> bool:
        """Refreshes ``_committed`` from ``committed_step()``, asked aside; returns whether it answered
        (within an interval if ``wait``: Orbax holds a lock while a save waits at a barrier for every
        process, and for a lost one until its own timeout)."""
        if self._asking is None or not self._asking.is_alive():

            def ask():
                try:
                    self._committed = self.committed_step()
                except Exception:  # a closed checkpointer: the last answer stands
                    pass

            self._asking = threading.Thread(target=ask, daemon=True, name="estimax-peers-committed")
            self._asking.start()
        self._asking.join(timeout=self.interval if wait else 0)
        return not self._asking.is_alive()

    def _report(self, silent: dict[int, tuple[str, float]], left: set[int]) -> None:
        """Publishes the line for the survivors, says it, waits until they have read it, then stops."""
        names = " and ".join(f"process {p} (host {host})" for p, (host, _) in sorted(silent.items()))
        quiet = max(seconds for _, seconds in silent.values())
        answered = self._ask_committed()
        step = self._committed
        if step is None:
            resume = (
                "No checkpoint was committed in this run: the same command starts from the model_dir's latest, if any"
                if answered
                else "A checkpoint was being saved: the same command resumes from the latest committed one"
            )
        else:
            later = "" if answered else " (a later one was being saved: the latest committed is where it resumes)"
            resume = (
                f"The last committed checkpoint is step {step}{later}: resume from step {step} with the same command"
            )
        line = (
            f"lost {names} of the group of {self.num_processes}: no sign of life for {quiet:.1f} s (killed, "
            f"ended on an error, frozen, or its host is gone; {TIMEOUT_ENV}={self.timeout:g}). {resume} "
            "(estimax launch --max-restarts or a cluster manager's restart does it)."
        )
        survivors = [p for p in range(1, self.num_processes) if p not in silent and p not in left]
        for p in survivors:
            self.client.key_value_set(f"{_WORD}{p}", line, allow_overwrite=True)
        self._say(line)
        deadline = time.monotonic() + max(2.0, self.timeout)
        for p in survivors:  # they read the line from the service this process hosts: wait for them
            try:
                self.client.blocking_key_value_get(f"{_TOLD}{p}", max(1, int((deadline - time.monotonic()) * 1000)))
            except Exception:  # gone too, or stuck: JAX's heartbeat ends it
                pass
        time.sleep(_TOLD_GRACE_SECONDS if survivors else 0.0)
        self._exit()

    def _coordinator_lost(self, cause: str) -> str:
        """The line of a survivor of process 0, with the last committed step it knew of."""
        step = self._committed
        resume = (
            "No checkpoint was committed in this run as far as this process knows: the same command starts from the "
            "model_dir's latest, if any"
            if step is None
            else f"The last committed checkpoint is step {step}: resume from step {step} with the same command"
        )
        return (
            f"lost process 0 (the coordinator, host {self._coordinator_host or 'unknown'}) of the group of "
            f"{self.num_processes}: "
            f"{cause} (killed, ended on an error, or its host is gone). {resume} (estimax launch --max-restarts or a "
            "cluster manager's restart does it)."
        )

    def _stop(self, line: str) -> None:
        if not self._stopping.acquire(blocking=False):  # the other thread is saying it
            return
        self._say(line)
        self._exit()

    def _say(self, line: str) -> None:
        logger.error("Process %d: %s Stopping with exit code %d.", self.process, line, PEER_LOST_EXIT_CODE)
        for handler in logger.handlers:
            handler.flush()

    def _exit(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PEER_LOST_EXIT_CODE)  # the main thread may wait in a collective that never ends


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
