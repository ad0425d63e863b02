"""What a shard does while its data directory refuses writes (disk full, I/O error).

``StorageHealth`` is the shard's record of whether its data directory takes writes:

* a write that fails (``guard`` sees ``StorageFailed``) makes the shard read-only:
  pushes are refused with UNAVAILABLE, lookups go on, and the ``on_change`` listeners
  hear it (the server flips its ``Writes`` health service);
* the maintenance thread then calls ``recover`` when ``retry_due``, with backoff (0.5 s
  doubling to 5 s): it reopens RocksDB, which refuses every write after a failed one,
  and writes what was held back; once that works the shard is writable again and
  the listeners hear that too. Nothing needs a restart;
* a stopping shard's ``final_write`` keeps retrying for its grace period; if rows
  changed by acknowledged pushes are still only in RAM then, it hands over to a
  rescue dump (``ps.durability.rescue``).

The shard passes in what these steps do to its tables (reopen, flush, count what is
at risk, rescue), so this module holds the policy and none of the tables' locking.

Example:
    >>> health = StorageHealth(shard=0)
    >>> heard = []
    >>> health.on_change(heard.append)
    >>> health.failed("disk full")
    >>> health.writable, heard
    (False, [False])
    >>> health.recover(reopen=lambda: None, flush=lambda: 0)
    >>> health.writable, heard
    (True, [False, True])
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from protos.rpc.backoff import Backoff
from ps.durability import StopReport
from ps.shard.background import Listeners
from ps.store import Storage, StorageFailed

__all__ = ["ACKNOWLEDGED_ON_DISK", "ROWS_FROM_SOURCE", "StorageHealth", "reopen_if_refusing"]

log = logging.getLogger(__name__)

# Retries of a failed storage: the first after _RETRY_FIRST_S, then twice as long each
# time up to _RETRY_MAX_S (each try reopens RocksDB, which replays its write-ahead log).
_RETRY_FIRST_S = 0.5
_RETRY_MAX_S = 5.0


def _retry_backoff() -> Backoff:
    return Backoff(_RETRY_FIRST_S, _RETRY_MAX_S, jitter=0.0)


# Why a stop that could not write everything lost nothing (``final_write``'s ``why_safe``).
ROWS_FROM_SOURCE = (
    "this serving shard holds no acknowledged push: its rows come from its source, and a follower's restart "
    "streams again what was not written"
)
ACKNOWLEDGED_ON_DISK = (
    "every acknowledged push is on disk: what was not written is rows created by lookups (they come back "
    "identical) and access times"
)


class StorageHealth:
    """Whether shard ``shard``'s data directory takes writes (see the module docstring).

    ``writable`` and ``error`` (the latest storage error while not writable, else "")
    may be read from any thread; the state changes on the thread that saw the failure
    or ran the recovery, and listeners are called there.
    """

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.writable = True
        self.error = ""
        self.errors = 0  # storage failures seen (each failed write or recovery try)
        self._failed_at = 0.0
        self._retry_at = 0.0
        self._backoff = _retry_backoff()
        self._listeners = Listeners(lambda: self.writable)

    def on_change(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(writable)`` when the shard starts or stops accepting writes."""
        self._listeners.add(listener)

    def check(self) -> None:
        """Raise ``StorageFailed`` (UNAVAILABLE) while the data directory refuses writes."""
        if not self.writable:
            raise StorageFailed(
                f"shard {self.shard} refuses writes since its storage failed ({self.error}); "
                "lookups still work. It retries by itself and takes pushes again once its writes succeed: "
                "free space or fix the data dir, then retry the push"
            )

    def guard(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, noting a storage failure on the way out."""
        try:
            return fn(*args, **kwargs)
        except StorageFailed as exc:
            self.failed(str(exc))
            raise

    def failed(self, error: str) -> None:
        """The data directory refused a write: refuse writes from now on (once)."""
        self.errors += 1
        if not self.writable:
            return
        self.writable = False
        self.error = error
        self._failed_at = time.monotonic()
        self._backoff.reset()
        self._retry_at = self._failed_at + self._backoff.next_s()
        log.error("storage failed, refusing writes (reads continue); retrying in the background: %s", error)
        self._listeners.tell()

    def retry_due(self, now: float) -> bool:
        """True when the shard is read-only and its next recovery try is due (monotonic ``now``)."""
        return not self.writable and now >= self._retry_at

    def recover(self, reopen: Callable[[], None], flush: Callable[[], int]) -> None:
        """One try at taking writes again: ``reopen`` the data directory (if it refuses
        writes), then ``flush`` what was held back (returns rows written). Raises
        ``StorageFailed`` (and schedules the next try) when either fails."""
        if self.writable:
            return
        try:
            reopen()
            written = flush()
        except StorageFailed as exc:
            self.error = str(exc)
            self.errors += 1
            delay = self._backoff.next_s()
            self._retry_at = time.monotonic() + delay
            log.warning("storage still failing, next try in %.1f s: %s", delay, exc)
            raise
        self.writable = True
        self.error = ""
        log.warning(
            "storage writable again after %.1f s: wrote %d rows held back meanwhile; taking pushes again",
            time.monotonic() - self._failed_at,
            written,
        )
        self._listeners.tell()

    def final_write(
        self,
        grace_s: float,
        *,
        reopen: Callable[[], None],
        flush: Callable[[], int],
        at_risk: Callable[[], int | None],
        rescue: Callable[[str], StopReport],
        why_safe: str = ACKNOWLEDGED_ON_DISK,
    ) -> StopReport:
        """Write what is dirty one last time (a stopping shard): ``reopen`` first if the
        data directory refused writes, then ``flush``. If that fails, ``at_risk()`` says
        how many rows changed by acknowledged pushes are only in RAM (None: none, and no
        ledger entry either; the warning logged then gives ``why_safe``); while some are,
        retry with backoff until ``grace_s`` has passed, then hand the last error to
        ``rescue``. Blocks for up to ``grace_s`` plus the rescue."""
        deadline = time.monotonic() + grace_s
        backoff = _retry_backoff()
        while True:
            try:
                if not self.writable:
                    reopen()
                written = flush()
                log.info("final flush wrote %d rows", written)
                return StopReport()
            except StorageFailed as exc:
                self.failed(str(exc))
                error = str(exc)
            unwritten = at_risk()
            if unwritten is None:
                log.warning("final flush failed (%s), but %s", error, why_safe)
                return StopReport(error=error)
            left = deadline - time.monotonic()
            if left <= 0:
                return rescue(error)
            delay = backoff.next_s()
            log.warning(
                "final flush failed, %d rows changed by acknowledged pushes are only in RAM; retrying in %.1f s "
                "(grace period ends in %.1f s): %s",
                unwritten,
                min(delay, left),
                left,
                error,
            )
            time.sleep(min(delay, left))  # the last try is at the end of the grace period


def reopen_if_refusing(storage: Storage, quiesced: Callable[[], contextlib.AbstractContextManager[None]]) -> None:
    """Reopen ``storage``'s RocksDB, holding ``quiesced()`` (every other user kept out),
    unless a probe write goes through as it is. Raises ``StorageFailed`` when the data
    dir has no room to reopen it in (a reopen would fail, closing the handle reads
    still use) or the reopen fails."""
    try:
        storage.probe()
        return
    except StorageFailed:
        pass
    if not storage.has_room():
        raise StorageFailed(f"data dir {storage.path} has no room yet: writes stay refused, reads go on")
    with quiesced():
        storage.reopen()
