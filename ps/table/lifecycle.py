"""The life of a key in a table: admission, recency clock, eviction and expiry choices.

* ``Lifecycle`` holds a table's rules (part of its ``TableSpec``): admit a key only
  after ``admit_after`` lookups and/or with ``admit_probability``; delete rows idle
  for ``ttl_seconds``; delete instead of spilling rows looked up fewer than
  ``evict_below_frequency`` times.
* ``Admission`` counts lookups of keys that have no row yet, in a count-min sketch
  (4 rows of saturating uint8 counters: fixed memory whatever the key space).
* Recency is kept per row as a uint32 ``tick``: eighths of a second since
  2025-01-01 UTC (wraps in 2042). ``now_tick`` reads the clock.
* ``scan_ranks`` and ``select_victims`` pick the rows to move out of RAM straight
  from a table's key index, in one pass and without sorting, by one of two
  policies (``Eviction``). ``"lru"``: the least recently used rows. ``"lfu"`` (the
  default): the rows looked up least often, their counts halving for every
  ``LFU_HALF_LIFE_S`` they sit idle, the least recently used first among equals; rows
  touched in the current tick go last, so a row looked up for a training step stays
  for its push. Under skewed traffic LFU keeps the popular rows that one-off keys
  would push out of an LRU (on Zipf(1.05) with 10% of the rows in RAM, the RAM hit rate
  goes from ~0.65 towards the 0.74 of keeping the most popular rows).

Example:
    >>> adm = Admission(Lifecycle(admit_after=2), seed=7)
    >>> keys = np.array([5, 6, 5], dtype=np.int64)
    >>> adm.admit(keys).tolist()  # key 5 reaches 2 sightings within the batch
    [False, False, True]
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal

import numba
import numpy as np
import numpy.typing as npt
from numba.cpython.unsafe.numbers import leading_zeros

from protos.hashing import mix64_step

__all__ = [
    "TICKS_PER_S",
    "Admission",
    "Lifecycle",
    "EVICTIONS",
    "LFU_HALF_LIFE_S",
    "Eviction",
    "EvictionScan",
    "now_tick",
    "scan_ranks",
    "select_victims",
    "tick_to_unix",
    "unchanged_ranks",
]

TICKS_PER_S = 8
_EPOCH_UNIX = 1735689600  # 2025-01-01T00:00:00Z
_RANK_BINS = 1 << 16  # LRU: ages above ~2.3 hours share the last bin
_LIVE_CHUNK = 4096  # buckets an eviction scan lists the live ones of, then ranks

Eviction = Literal["lfu", "lru"]
EVICTIONS: tuple[Eviction, ...] = ("lfu", "lru")
LFU_HALF_LIFE_S = 600
_HALF_LIFE_TICKS = LFU_HALF_LIFE_S * TICKS_PER_S
_FREQ_LEVELS = 4095  # LFU: rows looked up more often than this are equally hot
_AGE_LEVELS = 16  # LFU: among equal counts, ages by power of two: 1, 2-3, 4-7, ... ticks


def now_tick() -> np.uint32:
    """The recency clock: eighths of a second since 2025-01-01 UTC."""
    return np.uint32(int((time.time() - _EPOCH_UNIX) * TICKS_PER_S) & 0xFFFFFFFF)


def tick_to_unix(tick: int) -> float:
    """Unix seconds of a tick (for logs and tests)."""
    return _EPOCH_UNIX + tick / TICKS_PER_S


@dataclass(frozen=True)
class Lifecycle:
    """A table's feature-lifecycle rules; the defaults turn every rule off.

    Raises ``ValueError`` naming the field for out-of-range values.
    """

    admit_after: int = 0
    admit_probability: float = 1.0
    ttl_seconds: float = 0.0
    evict_below_frequency: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.admit_after <= 255:
            raise ValueError(f"lifecycle.admit_after={self.admit_after}: must be in [0, 255]")
        if not (math.isfinite(self.admit_probability) and 0.0 < self.admit_probability <= 1.0):
            raise ValueError(f"lifecycle.admit_probability={self.admit_probability}: must be in (0, 1]")
        if not (math.isfinite(self.ttl_seconds) and self.ttl_seconds >= 0):
            raise ValueError(f"lifecycle.ttl_seconds={self.ttl_seconds}: must be a finite number >= 0")
        if not 0 <= self.evict_below_frequency < 1 << 32:
            raise ValueError(f"lifecycle.evict_below_frequency={self.evict_below_frequency}: must be in [0, 2**32)")

    @property
    def admits_all(self) -> bool:
        """True when every key is stored on first sight."""
        return self.admit_after <= 1 and self.admit_probability >= 1.0


_SKETCH_ROWS = 4


@numba.njit(nogil=True, cache=True, inline="always")
def _hash(key: np.int64, salt: np.uint64) -> np.uint64:
    return mix64_step(np.uint64(key) ^ salt)


@numba.njit(nogil=True, cache=True)
def _sketch_admit(
    counters: npt.NDArray[np.uint8],
    salts: npt.NDArray[np.uint64],
    keys: npt.NDArray[np.int64],
    threshold: int,
    probability: float,
    rng_state: np.uint64,
    count: bool,
    out: npt.NDArray[np.bool_],
) -> np.uint64:
    width = counters.shape[1]
    for i in range(keys.shape[0]):
        est = np.int64(255)
        for r in range(counters.shape[0]):
            c = np.int64(_hash(keys[i], salts[r]) % np.uint64(width))
            v = counters[r, c]
            if count and v < 255:
                v += 1
                counters[r, c] = v
            est = min(est, np.int64(v))
        ok = bool(est >= threshold)
        if ok and probability < 1.0 and count:
            rng_state = _hash(np.int64(rng_state), np.uint64(0x9E3779B97F4A7C15))
            ok = bool((rng_state >> np.uint64(11)) * (1.0 / 9007199254740992.0) < probability)
        out[i] = ok
    return rng_state


class Admission:
    """Which keys without a row may get one (see ``Lifecycle``). Not thread-safe.

    ``admit(keys)`` counts a sighting of each key and says which are admitted (the
    table passes each request's distinct keys: a key repeated in one lookup is one
    sighting);
    ``admitted(keys)`` only asks (used by pushes: a push is not a sighting). A
    count-min sketch may over-count (a rare key sharing counters with frequent ones
    is admitted early), never under-count. Counters are in RAM only: they start from
    zero after a restart.
    """

    def __init__(self, lifecycle: Lifecycle, seed: int, width: int = 1 << 18) -> None:
        self.lifecycle = lifecycle
        self._counters = np.zeros((_SKETCH_ROWS, width), dtype=np.uint8)
        salt_rng = np.random.default_rng(seed)
        self._salts = salt_rng.integers(0, 2**63, size=_SKETCH_ROWS, dtype=np.int64).astype(np.uint64)
        self._rng = np.uint64((seed * 2 + 1) & 0xFFFFFFFFFFFFFFFF)

    def admit(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        out = np.empty(keys.shape[0], dtype=np.bool_)
        lc = self.lifecycle
        # numba hands the state back as a Python int: keep it uint64, or the next call
        # would type it int64 and mix signed with unsigned.
        self._rng = np.uint64(
            _sketch_admit(
                self._counters, self._salts, keys, max(1, lc.admit_after), lc.admit_probability, self._rng, True, out
            )
        )
        return out

    def admitted(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        out = np.empty(keys.shape[0], dtype=np.bool_)
        lc = self.lifecycle
        _sketch_admit(self._counters, self._salts, keys, max(1, lc.admit_after), 1.0, self._rng, False, out)
        return out

    def memory_bytes(self) -> int:
        return int(self._counters.nbytes)

    def counters(self) -> bytes:
        """The sketch's counters (a reshard sends them with the keys that move)."""
        return self._counters.tobytes()

    def merge(self, counters: bytes) -> None:
        """Take another shard's ``counters`` of this table (same seed, so the same
        hashing): each counter keeps the larger count, which over-counts at most."""
        other = np.frombuffer(counters, dtype=np.uint8)
        if other.shape[0] != self._counters.size:
            raise ValueError(f"admission counters of {other.shape[0]} bytes, expected {self._counters.size}")
        np.maximum(self._counters, other.reshape(self._counters.shape), out=self._counters)


@numba.njit(nogil=True, cache=True, inline="always")
def _age(now: np.uint32, last_access: np.uint32, top: int) -> np.int64:
    """Ticks since ``last_access``, in [0, top]. Signed, so that a row touched after the
    caller read ``now`` (a request on another thread) is the youngest, not the oldest."""
    age = np.int64(np.int32(np.uint32(now - last_access)))  # modular: survives the uint32 wrap
    if age < 0:
        return np.int64(0)
    return min(age, np.int64(top))


@numba.njit(nogil=True, cache=True, inline="always")
def _rank(now: np.uint32, last_access: np.uint32, frequency: np.uint32, lfu: bool, top: int) -> np.int64:
    """Where a row stands in the eviction order, in [0, top]: the higher, the sooner it goes."""
    age = _age(now, last_access, top)
    if not lfu:
        return age
    if age == 0:
        return np.int64(0)  # touched in this tick: in use
    # Unsigned division by the constant, and floor(log2(age)) from the leading zeros (age
    # >= 1): no sign fix-ups and no loop, 1.5x faster per row than the signed forms.
    halvings = min(np.uint64(age) // np.uint64(_HALF_LIFE_TICKS), np.uint64(40))
    count = np.int64(np.uint64(frequency) >> halvings)
    log2_age = np.int64(63) - np.int64(leading_zeros(np.uint64(age)))  # type: ignore[call-arg]  # numba intrinsic
    return 1 + (_FREQ_LEVELS - 1 - min(count, np.int64(_FREQ_LEVELS - 1))) * _AGE_LEVELS + log2_age


@numba.njit(nogil=True, cache=True)
def _rank_all(
    tslots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    lfu: bool,
    ranks: npt.NDArray[np.uint16],
    hist: npt.NDArray[np.int64],
) -> None:
    top = hist.shape[0] - 1
    rows = np.uint32(last_access.shape[0])
    # Each chunk's live buckets are listed first, without a branch (about 40% of buckets
    # are live: a branch on it mispredicts and stalls the random reads of the row columns).
    live = np.empty(_LIVE_CHUNK, np.int64)
    for start in range(0, tslots.shape[0], _LIVE_CHUNK):
        n = np.int64(0)
        for i in range(start, min(start + _LIVE_CHUNK, tslots.shape[0])):
            ranks[i] = 0
            live[n] = i
            # One unsigned compare: an empty bucket (-1), or a slot handed out after the
            # caller's snapshot of the arrays.
            n += np.uint32(tslots[i]) < rows
        for j in range(n):
            i = live[j]
            s = tslots[i]
            r = _rank(now, last_access[s], frequency[s], lfu, top)
            ranks[i] = r
            hist[r] += 1


@numba.njit(nogil=True, cache=True)
def _pick(
    ranks: npt.NDArray[np.uint16],
    tslots: npt.NDArray[np.int32],
    min_rank: int,
    quota_at_min: int,
    out: npt.NDArray[np.int64],
) -> int:
    n = 0
    for i in range(ranks.shape[0]):
        rank = np.int64(ranks[i])
        if rank > min_rank or (rank == min_rank and quota_at_min > 0):
            if rank == 0 and tslots[i] < 0:
                continue  # an empty bucket (ranked 0, as rows in use are)
            if rank == min_rank:
                quota_at_min -= 1
            if n == out.shape[0]:
                break
            out[n] = i
            n += 1
    return n


@dataclass(frozen=True)
class EvictionScan:
    """Every row's eviction rank, from one pass over a key index (``scan_ranks``).

    ``hist[r]`` rows go after every row of a higher rank (under ``"lru"`` the rank is the
    age in ticks; the last bin collects every older row). ``ranks`` holds one rank per
    bucket of ``index_slots`` (2 bytes; 0 for an empty one), so ``victims`` picks rows
    without ranking them again: a table passes the scan on to ``select_victims`` while
    its index is still these arrays.
    """

    index_slots: npt.NDArray[np.int32]
    ranks: npt.NDArray[np.uint16]
    hist: npt.NDArray[np.int64]

    def victims(
        self, index_keys: npt.NDArray[np.int64], count: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int64]]:
        """The first ``count`` rows in this scan's order, as ``(keys, slots, ranks)`` read
        from the index's buckets now (see ``select_victims``)."""
        hist = self.hist
        count = int(min(count, hist.sum()))
        if count <= 0:
            return np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.int64)
        from_top = np.cumsum(hist[::-1])
        j = int(np.searchsorted(from_top, count))  # first bin (from the top) reaching count
        min_rank = hist.shape[0] - 1 - j
        above = int(from_top[j - 1]) if j > 0 else 0
        picked = np.empty(count, np.int64)
        picked = picked[: _pick(self.ranks, self.index_slots, min_rank, count - above, picked)]
        return index_keys[picked], self.index_slots[picked], self.ranks[picked].astype(np.int64)


def scan_ranks(
    index_slots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    policy: Eviction,
) -> EvictionScan:
    """Rank the live buckets of a key index for eviction under ``policy``."""
    hist = np.zeros(_RANK_BINS, dtype=np.int64)
    ranks = np.empty(index_slots.shape[0], np.uint16)
    _rank_all(index_slots, last_access, frequency, now, _lfu(policy), ranks, hist)
    return EvictionScan(index_slots, ranks, hist)


def _lfu(policy: Eviction) -> bool:
    if policy not in EVICTIONS:
        raise ValueError(f"eviction={policy!r}: must be one of {', '.join(EVICTIONS)}")
    return policy == "lfu"


def select_victims(
    index_keys: npt.NDArray[np.int64],
    index_slots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    count: int,
    policy: Eviction,
    scan: EvictionScan | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """The first ``count`` rows in ``policy``'s eviction order as ``(keys, slots, ranks)``:
    every row above a cut-off rank, plus just enough rows of exactly that rank. ``scan``:
    ``scan_ranks`` of these arrays, if the caller already has it (one of other arrays, an
    index that has grown since, is not used). The arrays may change after the ranks were
    taken (a table scans outside its lock): ``unchanged_ranks`` then tells which victims
    nothing used meanwhile."""
    if scan is None or scan.index_slots is not index_slots:
        scan = scan_ranks(index_slots, last_access, frequency, now, policy)
    return scan.victims(index_keys, count)


@numba.njit(nogil=True, cache=True)
def _unchanged(
    slots: npt.NDArray[np.int32],
    ranks: npt.NDArray[np.int64],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    lfu: bool,
    top: int,
    out: npt.NDArray[np.bool_],
) -> None:
    for i in range(slots.shape[0]):
        s = slots[i]
        out[i] = s >= 0 and _rank(now, last_access[s], frequency[s], lfu, top) >= ranks[i]


def unchanged_ranks(
    slots: npt.NDArray[np.int32],
    ranks: npt.NDArray[np.int64],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    policy: Eviction,
) -> npt.NDArray[np.bool_]:
    """Which rows at ``slots`` still rank at least ``ranks`` (from ``select_victims`` with
    the same ``now``): a rank only falls when its row is used, so these were not."""
    out = np.empty(slots.shape[0], np.bool_)
    _unchanged(slots, ranks, last_access, frequency, now, _lfu(policy), _RANK_BINS - 1, out)
    return out


@numba.njit(nogil=True, cache=True)
def _expired(
    tkeys: npt.NDArray[np.int64],
    tslots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    now: np.uint32,
    max_age: int,
    out: npt.NDArray[np.int64],
) -> int:
    n = 0
    for i in range(tslots.shape[0]):
        s = tslots[i]
        if s >= 0 and np.int64(np.int32(np.uint32(now - last_access[s]))) > max_age:
            out[n] = tkeys[i]
            n += 1
    return n


def expired_keys(
    index_keys: npt.NDArray[np.int64],
    index_slots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    now: np.uint32,
    ttl_seconds: float,
) -> npt.NDArray[np.int64]:
    """Keys whose rows were last touched more than ``ttl_seconds`` ago."""
    out = np.empty(index_slots.shape[0], np.int64)
    n = _expired(index_keys, index_slots, last_access, now, int(ttl_seconds * TICKS_PER_S), out)
    return out[:n].copy()
