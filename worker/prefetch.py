"""Lookups ahead of time and pushes behind, with bounded staleness.

``SparsePipeline`` runs lookups on one background thread and pushes on another (in
step order, so runs are reproducible). The contract, for ``staleness`` s:

* the lookup for step t starts only after every push of the steps up to t - 1 - s has
  been applied, so rows are at most s steps behind (s = 0: fully synchronous);
* a failed background push is raised at the next ``check()`` (called by every
  forward, prefetch and ``flush()``), never dropped.

A step counts as "pushed" once its push was submitted, or once it is known to have
none (``settle``), e.g. an evaluation forward.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from client import PSClient, PushResult

__all__ = ["SparsePipeline"]

Rows = dict[str, npt.NDArray[np.float32]]


class SparsePipeline:
    """Background lookups and pushes for one ``DistributedEmbedding`` (not shared between modules).

    Thread-safe for one training thread calling it plus its own background threads.
    """

    def __init__(self, client: PSClient, staleness: int) -> None:
        if staleness < 0:
            raise ValueError(f"staleness={staleness}: must be >= 0")
        self.client = client
        self.staleness = staleness
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="ps-lookup")
        self._pushes = ThreadPoolExecutor(1, thread_name_prefix="ps-push")
        self._lock = threading.Condition()
        self._push_futures: dict[int, Future[PushResult]] = {}
        self._settled_through = -1  # every step <= this has its push submitted or has none
        self._settled: set[int] = set()
        self._error: BaseException | None = None

    def lookup(self, step: int, keys: Mapping[str, npt.NDArray[np.int64]]) -> Future[Rows]:
        """Start the lookup of ``keys`` for ``step``; the rows honour the staleness bound.

        Blocks only while an earlier step it depends on has not even been submitted
        (which cannot happen in a normal loop: prefetch is for the next step).
        """
        self.check()
        need = step - 1 - self.staleness
        with self._lock:
            while self._settled_through < need and self._error is None:
                if not self._lock.wait(timeout=self.client.config.deadline_s):
                    raise TimeoutError(
                        f"lookup for step {step} waits for the push of step {need}, which was never "
                        "submitted: call backward (or nothing) for each forward before prefetching further"
                    )
            waits = [f for s, f in self._push_futures.items() if s <= need]
        self.check()
        return self._lookups.submit(self._lookup, waits, dict(keys))

    def _lookup(self, waits: list[Future[PushResult]], keys: dict[str, npt.NDArray[np.int64]]) -> Rows:
        for f in waits:
            f.result()  # a failure here is also recorded by _done and raised by check()
        return self.client.lookup_many(keys)

    def push(self, step: int, updates: Mapping[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]],
             wait: bool) -> None:  # fmt: skip
        """Submit the push of ``step``; with ``wait`` block until applied (raising its error)."""
        future = self._pushes.submit(self.client.push_many, dict(updates))
        future.add_done_callback(functools.partial(self._done, step))
        with self._lock:
            self._push_futures[step] = future
        self.settle(step)
        if wait:
            future.result()

    def settle(self, step: int) -> None:
        """Record that ``step`` will submit no (further) push."""
        with self._lock:
            self._settled.add(step)
            while self._settled_through + 1 in self._settled:
                self._settled_through += 1
                self._settled.discard(self._settled_through)
            self._lock.notify_all()

    def _done(self, step: int, future: Future[PushResult]) -> None:
        exc = future.exception()
        with self._lock:
            if exc is not None and self._error is None:
                exc.add_note(f"(raised by the background push of step {step})")
                self._error = exc
            if exc is None:
                self._push_futures.pop(step, None)
            self._lock.notify_all()

    def check(self) -> None:
        """Raise the first background push failure, if any (once raised, it stays raised)."""
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Wait for every submitted push; raise the first failure."""
        with self._lock:
            pending = list(self._push_futures.values())
        for f in pending:
            try:
                f.result()
            except BaseException:
                pass
        self.check()

    def close(self) -> None:
        """Flush, then stop the background threads."""
        try:
            self.flush()
        finally:
            self._lookups.shutdown(wait=True)
            self._pushes.shutdown(wait=True)


