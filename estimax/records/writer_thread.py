"""Writers off the training thread: each file or tracker writer runs on a thread of its own.

Training hands a writer its records through a bounded queue and goes on (the
thread writes them every ``BATCH_SECONDS``, not at each record): a
slow disk, a bucket or a tracker's server costs the device no time, and a
full disk or a dead server never blocks training. A writer that fails stops
taking records; the next record handed to it (or ``close``) raises a
``WriterError`` naming the writer, where it writes, and the cause, so that
training saves the checkpoint due and stops with one line. Every wait here
is bounded: a full queue for ``PUT_TIMEOUT`` seconds, the last records at
``close`` for ``CLOSE_TIMEOUT``. ``writable()`` says whether the writer may
write at all (a lost lease on the model_dir: nothing more is written). Owns the thread and the queue; does not own
what a writer writes (``writers.py``, ``trackers.py``).
"""

from __future__ import annotations

import logging
import queue
import threading

from estimax.errors import LeaseLostError, StoreUnavailableError, WriterError

logger = logging.getLogger("estimax")

_CLOSE = object()


class InBackground:
    """``writer`` behind a queue of at most ``max_pending`` calls, run on its own daemon thread."""

    PUT_TIMEOUT = 60.0
    CLOSE_TIMEOUT = 120.0
    # The thread wakes this often (at once to close, when the queue fills, or on ``wake``) and writes what it was handed
    # since: a wake-up per record would take Python's lock from the training thread after every loop.
    BATCH_SECONDS = 0.25

    def __init__(self, writer, where: str, writable=lambda: True, max_pending: int = 1024):
        self.writer, self.where, self.writable = writer, where, writable
        self.every_step = getattr(writer, "every_step", False)
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._error: BaseException | None = None
        self._closed = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"estimax {type(writer).__name__}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"InBackground({type(self.writer).__name__}, {self.where!r})"

    def write(self, split: str, step: int, values) -> None:
        self._put((self.writer.write, (split, step, dict(values))))

    def write_steps(self, split: str, first_step: int, columns, sampled=()) -> None:
        self._put((self.writer.write_steps, (split, first_step, columns, sampled)))

    def write_summary(self, split: str, step: int, values: bytes) -> None:
        self._put((self.writer.write_summary, (split, step, values)))

    @property
    def takes_summaries(self) -> bool:
        """Whether the writer takes images, histograms and text (``summaries.py``): TensorBoard's does."""
        return hasattr(self.writer, "write_summary")

    def flush(self) -> None:
        """Returns once what was handed so far is written and flushed to where it goes (on a store,
        uploaded), waiting at most ``CLOSE_TIMEOUT``; raises the writer's error. A writer without a
        ``flush`` of its own (a tracker) is not waited for: a checkpoint waits on the run's own files."""
        if not hasattr(self.writer, "flush"):
            return
        done = threading.Event()
        self._put((self._flushed, (done,)))
        self._wake.set()
        if not done.wait(self.CLOSE_TIMEOUT):
            raise WriterError(
                f"{type(self.writer).__name__} to {self.where} did not write its records within "
                f"{self.CLOSE_TIMEOUT:.0f} s. Expected a writable location that answers. Fix: check that location "
                "(a stalled mount or server), or turn the writer off."
            )
        self._raise_if_failed()

    def _flushed(self, done: threading.Event) -> None:
        try:
            self.writer.flush()
        finally:
            done.set()

    def _put(self, call) -> None:
        self._raise_if_failed()
        if self._queue.qsize() >= self._queue.maxsize // 2:
            self._wake.set()
        try:
            self._queue.put(call, timeout=self.PUT_TIMEOUT)
        except queue.Full:
            raise WriterError(
                f"{type(self.writer).__name__} to {self.where} did not keep up: {self._queue.qsize()} records "
                f"waited {self.PUT_TIMEOUT:.0f} s. Expected a writable location that answers. Fix: check that "
                "location (a stalled mount or server), log less often (log_every_steps), or turn the writer off."
            ) from None

    def _run(self) -> None:
        closing = False
        while not closing:
            self._wake.wait(self.BATCH_SECONDS)
            self._wake.clear()
            while not closing:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                closing = item is _CLOSE
                if closing or self._error is not None or not self.writable():
                    if not closing and item[0] == self._flushed:
                        item[1][0].set()  # nothing more is written: the waiter finds out why
                    continue  # failed, or the model_dir's lease is lost (training says so): records are dropped
                function, args = item
                try:
                    function(*args)
                except BaseException as error:  # noqa: BLE001 - handed to the training thread
                    self._error = error
        if self._error is None and self.writable():
            try:
                self.writer.close()
            except BaseException as error:  # noqa: BLE001
                self._error = error

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            failure = self._failure()
            raise failure from (None if failure is self._error else self._error)

    def _failure(self) -> WriterError | StoreUnavailableError:
        if isinstance(self._error, StoreUnavailableError | LeaseLostError):
            return self._error  # the store's or the lock's own line and exit code (74) say it all
        return WriterError(
            f"{type(self.writer).__name__} to {self.where} failed: {type(self._error).__name__}: {self._error}. "
            "Fix: free space or fix access there, or turn this writer off (RunConfig(tensorboard=False), "
            "trackers=())."
        )

    def close(self) -> None:
        """Writes the records left (waiting at most ``CLOSE_TIMEOUT``), closes the writer, and raises
        its error, once."""
        if not self._closed:
            self._closed = True
            try:
                self._queue.put(_CLOSE, timeout=self.CLOSE_TIMEOUT)
                self._wake.set()
                self._thread.join(self.CLOSE_TIMEOUT)
            except queue.Full:
                pass
            if self._thread.is_alive():
                logger.warning(
                    "%s to %s: %d records were not written within %.0f s.",
                    type(self.writer).__name__,
                    self.where,
                    self._queue.qsize(),
                    self.CLOSE_TIMEOUT,
                )
        if self._error is not None:
            failure, cause, self._error = self._failure(), self._error, None
            raise failure from (None if failure is cause else cause)
