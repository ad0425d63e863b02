"""Lookups ahead of time and pushes behind, with bounded staleness and a fixed order.

``SparsePipeline`` runs lookups on one background thread and pushes on another, each in
submission order. The contract, for ``staleness`` s:

* the lookup for step t reads the rows after exactly the pushes of the steps up to
  t - 1 - s: it waits until those are applied, and the push of step k is held back
  until the lookup of step k + s has read its rows. Which pushes a lookup sees is
  therefore fixed by the step numbers, not by thread timing, so a single-worker run
  is reproducible to the bit (s = 0: fully synchronous);
* a held push is released early by an evaluation read (``lookup(None, ...)``), by a
  lookup that must see every push (``sees_all``), by ``flush()`` and ``close()``. A
  loop that stops must call one of them, or its last ``staleness`` steps' pushes are
  never sent;
* a failed background push is raised at the next ``check()`` (called by every
  forward, prefetch and ``flush()``), never dropped.

A step is "settled" once it can submit no more pushes: its push was submitted, or its
autograd graph was freed without a backward (``settle``). Waiting for that happens on
the lookup thread, so the training thread never blocks in ``lookup``.

Why no deadlock: the lookup of step t waits for pushes of steps k <= t - 1 - s, and
each of those waits only for the lookup of step k + s <= t - 1, which was submitted
earlier and runs earlier on the same thread. Held pushes wait in a list, not on the
push thread, so a push released early never queues behind one still held (autograd
may push a later step first when one backward spans two steps).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from client import DeadlineExceededError, PSClient, PushResult, TablePlan

__all__ = ["Rows", "SparsePipeline", "Updates"]

Rows = dict[str, npt.NDArray[np.float32]]
Keys = Mapping[str, npt.NDArray[np.int64] | TablePlan]
Updates = dict[str, tuple[npt.NDArray[np.int64] | TablePlan, npt.NDArray[np.float32]]]
# A push waiting for its release: push id, step, updates, future, seq.
_Held = tuple[int, int, "Updates | Callable[[], Updates]", "Future[PushResult]", int | None]


class SparsePipeline:
    """Background lookups and pushes for one ``DistributedEmbedding`` (not shared between modules).

    Thread-safe: the training thread, the autograd engine and the two background threads
    may all call it. Every failure it raises is a ``client.PSError``.
    """

    def __init__(self, client: PSClient, staleness: int) -> None:
        if staleness < 0:
            raise ValueError(f"staleness={staleness}: must be >= 0")
        self.client = client
        self.staleness = staleness
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="ps-lookup")
        self._pushes = ThreadPoolExecutor(1, thread_name_prefix="ps-push")
        self._cond = threading.Condition()
        self._next_push = 0  # id of the next push
        self._in_flight: dict[int, tuple[int, Future[PushResult]]] = {}  # push id -> (step, future)
        self._settled_through = -1  # every step <= this is settled
        self._settled: set[int] = set()  # settled steps above it
        self._read_through = -1  # highest training step whose lookup has read its rows
        self._release_below = 0  # pushes with a smaller id go out without waiting for a lookup
        self._error: BaseException | None = None
        self._discarded: set[Future[Rows]] = set()
        self._held: list[_Held] = []  # in push order
        self._closed = False
        self.push_count, self.push_s, self.push_max_s = 0, 0.0, 0.0  # acknowledged pushes and their latency
        self.push_duplicates = 0  # shard requests of acknowledged pushes that the shards had applied before

    def lookup(self, step: int | None, keys: Keys | Callable[[], Keys], *, sees_all: bool = False) -> Future[Rows]:
        """Start the lookup of ``keys`` for training ``step`` (never blocks). ``keys`` may be
        a function that returns them: it is called on the lookup thread, first (an
        exception it raises is the lookup's).

        ``step=None`` is a read outside training (evaluation): it sees every push
        submitted so far. ``sees_all`` does the same for a training step (used when
        prefetched lookups were discarded, so the order of reads and pushes stays fixed).
        """
        self.check()
        if step is not None and sees_all:
            with self._cond:
                # Discarded lookups may have read rows for this step or later ones; they must
                # not release pushes that the lookups submitted from now on should not see.
                self._read_through = min(self._read_through, step - 1)
        holder: list[Future[Rows]] = []
        future = self._lookups.submit(self._lookup, step, keys if callable(keys) else dict(keys), holder, sees_all)
        holder.append(future)
        return future

    def discard(self, future: Future[Rows]) -> None:
        """Give up a lookup whose step will never run, so it does not hold up later ones."""
        if not future.cancel() and not future.done():
            with self._cond:
                self._discarded.add(future)
                self._cond.notify_all()

    def _lookup(
        self, step: int | None, keys: Keys | Callable[[], Keys], holder: list[Future[Rows]], sees_all: bool
    ) -> Rows:
        if callable(keys):
            keys = keys()  # while the pushes this lookup waits for are still going
        with self._cond:
            if sees_all or step is None:
                self._release_below = self._next_push
                self._send_released()
                waits = [f for _, f in self._in_flight.values()]
            else:
                need = step - 1 - self.staleness
                timeout_s = self.client.config.deadline_s

                def ready() -> bool:
                    return (
                        self._settled_through >= need
                        or self._error is not None
                        or bool(holder and holder[0] in self._discarded)
                    )

                if not self._cond.wait_for(ready, timeout_s):
                    raise DeadlineExceededError(
                        f"the lookup for step {step} waited {timeout_s}s for step {need} to finish its backward "
                        f"(or be dropped): keep at most staleness={self.staleness} training forwards ahead of "
                        "their backward, or raise ClientConfig.deadline_s if a step really takes that long"
                    )
                if holder and holder[0] in self._discarded:
                    self._discarded.discard(holder[0])
                    return {}
                waits = [f for s, f in self._in_flight.values() if s <= need]
        for f in waits:
            f.exception()  # applied or failed; a failure is raised by check() on the training thread
        self.check()
        try:
            return self.client.lookup_many(keys)
        finally:
            if step is not None:
                with self._cond:
                    if holder and holder[0] in self._discarded:
                        self._discarded.discard(holder[0])
                    elif step > self._read_through:
                        self._read_through = step
                        self._send_released()

    def push(self, step: int, updates: Updates | Callable[[], Updates], wait: bool, seq: int | None = None) -> None:
        """Submit a push of ``step`` (a step may push more than once); with ``wait``, block until applied.
        ``updates`` may be a function that returns them: the push thread calls it (an
        exception it raises is the push's). ``seq``: the push's number for exactly-once
        (``PSClient.push_many``); None: the client numbers it.

        The push is held until the lookup of step ``step + staleness`` has read its rows
        (or an evaluation read, ``flush()`` or ``close()``), then sent in the background.
        """
        future: Future[PushResult] = Future()
        with self._cond:
            push_id = self._next_push
            self._next_push += 1
            self._in_flight[push_id] = (step, future)
            self._held.append((push_id, step, updates if callable(updates) else dict(updates), future, seq))
            self._send_released()
        future.add_done_callback(functools.partial(self._done, push_id, step))
        self.settle(step)
        if wait:
            future.result()

    def _send_released(self) -> None:
        """Hand the held pushes that may go now to the push thread, in push order (lock held)."""
        keep = []
        for item in self._held:
            push_id, step, updates, future, seq = item
            if self._read_through >= step + self.staleness or push_id < self._release_below:
                self._pushes.submit(self._send, updates, future, seq)
            else:
                keep.append(item)
        self._held = keep

    def _send(self, updates: Updates | Callable[[], Updates], future: Future[PushResult], seq: int | None) -> None:
        try:
            if callable(updates):
                updates = updates()
            t0 = time.perf_counter()
            result = self.client.push_many(updates, seq=seq)
            took = time.perf_counter() - t0
            self.push_count, self.push_s = self.push_count + 1, self.push_s + took  # only this thread writes
            self.push_max_s = max(self.push_max_s, took)
            self.push_duplicates += result.duplicates
            future.set_result(result)
        except BaseException as exc:  # the failure belongs to the push; check() raises it
            future.set_exception(exc)

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

    @property
    def closed(self) -> bool:
        """True once ``close()`` began: no push is taken any more."""
        return self._closed

    def check(self) -> None:
        """Raise the first background push failure, if any (once raised, it stays raised)."""
        if self._error is not None:
            raise self._error

    def _release_all(self) -> None:
        with self._cond:
            self._release_below = self._next_push
            self._send_released()

    def flush(self) -> None:
        """Wait for every submitted push; raise the first failure.

        Held pushes are released once the lookups already submitted have read their
        rows (so they see what they would have seen without the flush).
        """
        if not self._closed:
            self._lookups.submit(self._release_all).result()
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
            if not self._closed:
                self._closed = True
                self._release_all()  # in case flush failed before releasing: no push may stay held
            self._lookups.shutdown(wait=True)
            self._pushes.shutdown(wait=True)
