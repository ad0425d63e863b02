"""A training shard's change log: which keys each applied write changed, by version.

Every push a training shard applies (and every lookup that created rows) gets the next
*version* of the shard and is recorded here with the keys it changed, per table. A
serving shard that follows this one (``ps.replication.follow``) asks for the changes after the
last version it applied; the leader answers with the *current* values of the union of
those keys (``ps.replication.stream``), so a follower is never behind what a version promises, and
only the newest value of a row hot in many pushes travels.

The log keeps the key arrays of the most recent changes, up to ``max_keys`` keys in
all. A follower asking for a version older than that (or from another ``history``: the
leader restarted, and versions began again) gets a full snapshot instead.

Example:
    >>> log = ChangeLog(max_keys=5)
    >>> log.record([("item", np.array([1, 2]))]), log.record([("item", np.array([2, 3]))])
    (1, 2)
    >>> version, _, changed = log.since(0)
    >>> version, changed["item"].tolist()
    (2, [1, 2, 3])
    >>> _ = log.record([("item", np.array([4, 5, 6]))])  # the first change falls out
    >>> log.since(0) is None, log.since(1) is not None, log.holds(0), log.holds(1)
    (True, True, False, True)
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["ChangeLog"]

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class _Change:
    version: int
    unix_s: float
    keys: tuple[tuple[str, I64], ...]

    @property
    def size(self) -> int:
        return sum(k.shape[0] for _, k in self.keys)


class ChangeLog:
    """Versions and changed keys of one shard's writes, newest ``max_keys`` keys kept.

    Thread-safe. ``history`` is new for every log: versions are only comparable
    within one history.
    """

    def __init__(self, max_keys: int = 4_000_000) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys={max_keys}: must be >= 1")
        self.history = uuid.uuid4().hex
        self.max_keys = max_keys
        self._version = 0
        self._version_unix_s = time.time()
        self._changes: deque[_Change] = deque()
        self._held_keys = 0
        self._oldest_kept = 1  # the first version whose keys are still held
        self._wakes = 0
        self._cond = threading.Condition()

    @property
    def version(self) -> int:
        """The newest version (0 before the first write)."""
        return self._version

    def record(self, changes: Sequence[tuple[str, I64]]) -> int:
        """Give one applied write its version, keeping the keys it changed per table;
        returns the version. The arrays are kept as they are: the caller must not change
        them afterwards."""
        with self._cond:
            self._version += 1
            self._version_unix_s = now = time.time()
            change = _Change(self._version, now, tuple((t, k) for t, k in changes if k.shape[0]))
            self._changes.append(change)
            self._held_keys += change.size
            while self._held_keys > self.max_keys and len(self._changes) > 1:
                dropped = self._changes.popleft()
                self._held_keys -= dropped.size
                self._oldest_kept = dropped.version + 1
            self._cond.notify_all()
            return self._version

    def wait(self, after: int, timeout_s: float) -> int:
        """Block until the version passes ``after``, ``wake`` is called or ``timeout_s``
        passes; returns the version."""
        with self._cond:
            wakes = self._wakes
            self._cond.wait_for(lambda: self._version > after or self._wakes != wakes, timeout_s)
            return self._version

    def wake(self) -> None:
        """Wake every ``wait`` now (the shard is stopping, or a reshard froze it)."""
        with self._cond:
            self._wakes += 1
            self._cond.notify_all()

    def holds(self, after: int) -> bool:
        """Whether ``since(after)`` can answer: every change after version ``after`` is kept."""
        with self._cond:
            return self._oldest_kept <= after + 1 and after <= self._version

    def since(self, after: int) -> tuple[int, float, dict[str, I64]] | None:
        """``(version, when it was applied (unix s), distinct keys changed per table)`` for
        every change after version ``after``; None when the log no longer holds them all."""
        with self._cond:
            if not (self._oldest_kept <= after + 1 and after <= self._version):
                return None
            version, unix_s = self._version, self._version_unix_s
            parts: dict[str, list[I64]] = {}
            # Newest first: the versions after ``after`` are the tail of the deque.
            for change in reversed(self._changes):
                if change.version <= after:
                    break
                for table, keys in change.keys:
                    parts.setdefault(table, []).append(keys)
        merged = {t: np.unique(np.concatenate(p).view(np.uint64)).view(np.int64) for t, p in parts.items()}
        return version, unix_s, merged

    def applied_at(self, version: int) -> float:
        """When ``version`` was applied (unix s); the oldest held one's time if it is older,
        the newest one's if it is newer."""
        with self._cond:
            for change in self._changes:
                if change.version >= version:
                    return change.unix_s
            return self._version_unix_s
