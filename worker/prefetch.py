"""Lookups ahead of time and pushes behind, with bounded staleness.

``SparsePipeline`` runs lookups on one background thread and pushes on another (in
submission order, so runs are reproducible). The contract, for ``staleness`` s:

* the lookup for step t starts only after every push of the steps up to t - 1 - s has
  been applied, so rows are at most s steps behind (s = 0: fully synchronous);
* a failed background push is raised at the next ``check()`` (called by every
  forward, prefetch and ``flush()``), never dropped.

A step is "settled" once it can submit no more pushes: its push was submitted, or its
autograd graph was freed without a backward (``settle``). Waiting for that happens on
the lookup thread, so the training thread never blocks in ``lookup``.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from client import PSClient, PushResult

__all__ = ["Rows", "SparsePipeline"]

Rows = dict[str, npt.NDArray[np.float32]]


class SparsePipeline:
    """Background lookups and pushes for one ``DistributedEmbedding`` (not shared between modules).

    Thread-safe: the training thread, the autograd engine and the two background threads
    may all call it.
    """

    def __init__(self, client: PSClient, staleness: int) -> None:
        if staleness < 0:
            raise ValueError(f"staleness={staleness}: must be >= 0")
        self.client = client
        self.staleness = staleness
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="ps-lookup")
        self._pushes = ThreadPoolExecutor(1, thread_name_prefix="ps-push")
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._in_flight: dict[int, tuple[int, Future[PushResult]]] = {}  # push id -> (step, future)
        self._settled_through = -1  # every step <= this is settled
        self._settled: set[int] = set()  # settled steps above it
        self._error: BaseException | None = None
        self._discarded: set[Future[Rows]] = set()

    def lookup(self, step: int | None, keys: Mapping[str, npt.NDArray[np.int64]]) -> Future[Rows]:
        """Start the lookup of ``keys`` for training ``step`` (never blocks).

        ``step=None`` is a read outside training (evaluation): it sees every push
        submitted so far.
        """
        self.check()
        holder: list[Future[Rows]] = []
        future = self._lookups.submit(self._lookup, step, dict(keys), holder)
        holder.append(future)
        return future

    def discard(self, future: Future[Rows]) -> None:
        """Give up a lookup whose step will never run, so it does not hold up later ones."""
        if not future.cancel():
            with self._cond:
                self._discarded.add(future)
                self._cond.notify_all()

    def _lookup(self, step: int | None, keys: dict[str, npt.NDArray[np.int64]], holder: list[Future[Rows]]) -> Rows:
        with self._cond:
            if step is not None:
                need = step - 1 - self.staleness
                timeout_s = self.client.config.deadline_s

                def ready() -> bool:
                    return self._settled_through >= need or self._error is not None or bool(
                        holder and holder[0] in self._discarded
                    )

                if not self._cond.wait_for(ready, timeout_s):
                    raise TimeoutError(
                        f"the lookup for step {step} waited {timeout_s}s for step {need} to finish its backward "
                        "(or be dropped); keep at most `staleness` training forwards ahead of their backward"
                    )
                if holder and holder[0] in self._discarded:
                    self._discarded.discard(holder[0])
                    return {}
                waits = [f for s, f in self._in_flight.values() if s <= need]
            else:
                waits = [f for _, f in self._in_flight.values()]
        for f in waits:
            f.exception()  # applied or failed; a failure is raised by check() on the training thread
        self.check()
        return self.client.lookup_many(keys)

    def push(self, step: int, updates: Mapping[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]],
             wait: bool) -> None:  # fmt: skip
        """Submit a push of ``step`` (a step may push more than once); with ``wait``, block until applied."""
        push_id = next(self._ids)
        with self._cond:
            future = self._pushes.submit(self.client.push_many, dict(updates))
            self._in_flight[push_id] = (step, future)
        future.add_done_callback(functools.partial(self._done, push_id, step))
        self.settle(step)
        if wait:
            future.result()

    def settle(self, step: int) -> None:
        """Record that ``step`` will submit no (further) push."""
        with self._cond:
            if step <= self._settled_through:
                return
            self._settled.add(step)
            while self._settled_through + 1 in self._settled:
                self._settled_through += 1
                self._settled.discard(self._settled_through)
            self._cond.notify_all()

    def _done(self, push_id: int, step: int, future: Future[PushResult]) -> None:
        exc = future.exception()
        with self._cond:
            if exc is not None and self._error is None:
                exc.add_note(f"(raised by the background push of step {step})")
                self._error = exc
            self._in_flight.pop(push_id, None)
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the first background push failure, if any (once raised, it stays raised)."""
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Wait for every submitted push; raise the first failure."""
        with self._cond:
            pending = [f for _, f in self._in_flight.values()]
        for f in pending:
            f.exception()
        self.check()

    def close(self) -> None:
        """Flush, then stop the background threads."""
        try:
            self.flush()
        finally:
            self._lookups.shutdown(wait=True)
            self._pushes.shutdown(wait=True)
