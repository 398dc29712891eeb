"""Dynamic batching and warm-up for one loaded version of a served model.

Owns joining concurrent requests into one call of the program (``Batcher``),
padding a joined batch to the sizes compiled ahead, and compiling those sizes
before a version answers its first request (``calibrate``, ``warm_up``).
Does not own HTTP (``server.py``), nor which version answers (``versions.py``).
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported only to serve: `estimax --help` stays light
    import numpy as np

CALIBRATION_REPEATS = 3


def batch_sizes(max_batch: int) -> list[int]:
    """The sizes the batcher pads to: powers of two below ``max_batch``, and ``max_batch``."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch]


def calibrate(model, max_batch: int) -> int:
    """The batch size up to ``max_batch`` (powers of two) with the most rows per second here.

    Compiles every size the batcher can use before the port opens, so no
    request waits for a compilation. Larger batches are not always faster
    per row: on CPUs, convolutions can cost more per row at batch 64 than at 1.
    """
    best, best_rate = 1, 0.0
    for size in batch_sizes(max_batch):
        batch = {k: empty(size, s) for k, s in model.inputs.items()}
        model.run(batch)  # compiles
        seconds = []
        for _ in range(CALIBRATION_REPEATS):
            start = time.perf_counter()
            model.run(batch)
            seconds.append(time.perf_counter() - start)
        rate = size / min(seconds)
        if rate > best_rate * 1.1:  # a larger batch must be clearly faster: it costs latency
            best, best_rate = size, rate
    print(f"Calibrated batch sizes 1 to {max_batch}: {best} rows per call ({best_rate:.0f} rows/s)", file=sys.stderr)
    return best


def warm_up(model, max_batch: int) -> None:
    """Compiles and runs every batch size the batcher can use, so no request waits for a compilation."""
    for size in batch_sizes(max_batch):
        model.run({k: empty(size, s) for k, s in model.inputs.items()})


class Batcher:
    """Dynamic batching: requests waiting while the model runs are joined into one call.

    A call takes up to ``max_batch`` rows; when fewer are waiting it waits up
    to ``max_wait`` seconds for more. The joined batch is padded to a power of
    two rows (or ``max_batch``), the sizes ``calibrate`` compiled.
    """

    def __init__(self, model, max_batch: int, max_wait: float, executor):
        self.model, self.max_batch, self.max_wait, self.executor = model, max_batch, max_wait, executor
        self._waiting: collections.deque = collections.deque()
        self._arrived = asyncio.Event()

    async def predict(self, prepared: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((prepared, rows_of(prepared), future))
        self._arrived.set()
        return await future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            batch = [self._waiting.popleft()]
            rows, deadline = batch[0][1], time.monotonic() + self.max_wait
            while rows < self.max_batch:
                if not self._waiting:
                    if self.max_batch == 1 or time.monotonic() >= deadline:
                        break
                    self._arrived.clear()
                    try:
                        await asyncio.wait_for(self._arrived.wait(), deadline - time.monotonic())
                    except TimeoutError:
                        break
                    continue
                if rows + self._waiting[0][1] > self.max_batch:
                    break
                item = self._waiting.popleft()
                batch.append(item)
                rows += item[1]
            try:
                outputs = await loop.run_in_executor(self.executor, self._run, [item[0] for item in batch], rows)
            except Exception as error:
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            start = 0
            for _, count, future in batch:
                if not future.done():  # a client that went away cancelled its future
                    future.set_result({k: v[start : start + count] for k, v in outputs.items()})
                start += count

    def _run(self, parts: list[dict], rows: int) -> dict[str, np.ndarray]:
        import numpy as np

        if len(parts) == 1 and (rows == 0 or self.max_batch == 1):
            return self.model.run(parts[0])
        padded = rows if rows > self.max_batch else min(1 << (rows - 1).bit_length(), self.max_batch)
        joined = {
            k: np.concatenate(
                [p[k] for p in parts] + [np.zeros((padded - rows, *parts[0][k].shape[1:]), parts[0][k].dtype)]
            )
            for k in parts[0]
        }
        return {k: v[:rows] for k, v in self.model.run(joined).items()}


def empty(rows: int, spec):
    """Zeros of one input: ``rows`` examples of its trailing shape and dtype."""
    import numpy as np

    return np.zeros((rows, *spec.trailing), spec.dtype)


def rows_of(prepared: dict) -> int:
    return len(next(iter(prepared.values())))
