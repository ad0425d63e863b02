"""``ReadAhead``: a stream's next batches read and parsed on a thread of their own.

The online trainer's step would otherwise wait for the source to read a batch and for
its rows to be parsed (a few milliseconds per 512 Criteo rows) before it can start; here
that happens while the previous steps train (the parser's kernels release the GIL).
Batches come out in the source's order, each with its ``Lines`` (whose ``end`` is the
position after it): the reader runs at most ``depth`` batches ahead, and what it read
but was never taken is simply not trained, its position not saved.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from worker.stream import Lines, StreamSource

__all__ = ["ReadAhead"]

B = TypeVar("B")
_POLL_S = 0.1  # how often an idle reader looks at whether it should stop


class ReadAhead(Generic[B]):
    """``source``'s batches of ``batch_size`` rows, parsed by ``parse``, ``depth`` ahead. Start it
    with ``with`` (or ``start()``); ``get`` takes the next one; a reader failure (a malformed
    row, a stream that cannot be read) is raised by the ``get`` that would have returned it."""

    def __init__(self, source: StreamSource, parse: Callable[[Lines], B], batch_size: int, depth: int = 2) -> None:
        self.source, self.parse, self.batch_size = source, parse, batch_size
        self._queue: queue.Queue[tuple[Lines, B] | BaseException] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream-reader", daemon=True)
        self._busy = False  # a batch is being parsed, or waits for room in the queue
        self._last_rows_at = time.monotonic()  # when the source last gave rows (or the reader started)

    def __enter__(self) -> ReadAhead[B]:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._thread.start()

    def get(self, timeout_s: float) -> tuple[Lines, B] | None:
        """The next batch, waiting up to ``timeout_s`` (0: only one ready now); None: none yet."""
        try:
            item = self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            self._stop.set()
            raise item
        return item

    def quiet_s(self) -> float:
        """Seconds since the source last gave rows, 0 while some are being parsed or wait to be
        taken: how long the stream itself has been quiet (``--idle-exit-s``)."""
        if self._busy or not self._queue.empty():
            return 0.0
        return time.monotonic() - self._last_rows_at

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                lines = self.source.next_batch(self.batch_size, _POLL_S)
                if lines is None:
                    continue
                self._busy, self._last_rows_at = True, time.monotonic()
                item = (lines, self.parse(lines))
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=_POLL_S)
                        break
                    except queue.Full:
                        continue
                self._busy, self._last_rows_at = False, time.monotonic()
        except BaseException as exc:  # raised where the batch would have been taken
            self._queue.put(exc)
