"""The life of a key in a table: admission, recency clock, eviction and expiry choices.

* ``Lifecycle`` holds a table's rules (part of its ``TableSpec``): admit a key only
  after ``admit_after`` lookups and/or with ``admit_probability``; delete rows idle
  for ``ttl_seconds``; delete instead of spilling rows looked up fewer than
  ``evict_below_frequency`` times.
* ``Admission`` counts lookups of keys that have no row yet, in a count-min sketch
  (4 rows of saturating uint8 counters: fixed memory whatever the key space).
* Recency is kept per row as a uint32 ``tick``: eighths of a second since
  2025-01-01 UTC (wraps in 2042). ``now_tick`` reads the clock.
* ``eviction_histogram`` and ``select_victims`` pick the rows to move out of RAM
  straight from a table's key index, in two passes and without sorting, by one of two
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

__all__ = [
    "TICKS_PER_S",
    "Admission",
    "Lifecycle",
    "EVICTIONS",
    "LFU_HALF_LIFE_S",
    "Eviction",
    "eviction_histogram",
    "now_tick",
    "select_victims",
    "tick_to_unix",
    "unchanged_ranks",
]

TICKS_PER_S = 8
_EPOCH_UNIX = 1735689600  # 2025-01-01T00:00:00Z
_RANK_BINS = 1 << 16  # LRU: ages above ~2.3 hours share the last bin

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
_MUL = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


@numba.njit(nogil=True, cache=True, inline="always")
def _hash(key: np.int64, salt: np.uint64) -> np.uint64:
    z = np.uint64(key) ^ salt
    z = (z ^ (z >> np.uint64(31))) * _MUL
    z = (z ^ (z >> np.uint64(29))) * _MUL2
    return z ^ (z >> np.uint64(32))


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
    count = np.int64(frequency) >> min(age // _HALF_LIFE_TICKS, np.int64(40))
    return 1 + (_FREQ_LEVELS - 1 - min(count, np.int64(_FREQ_LEVELS - 1))) * _AGE_LEVELS + _log2(age)


@numba.njit(nogil=True, cache=True, inline="always")
def _log2(age: np.int64) -> np.int64:
    """floor(log2(age)) for age in [1, 2**16), without a loop (data-dependent trip counts
    mispredict: the eviction passes ran 2.5x slower with one)."""
    bits = np.int64(0)
    for step in (8, 4, 2, 1):
        up = np.int64(age >= np.int64(1) << step) * step
        age >>= up
        bits += up
    return bits


@numba.njit(nogil=True, cache=True)
def _rank_histogram(
    tslots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    lfu: bool,
    hist: npt.NDArray[np.int64],
) -> None:
    top = hist.shape[0] - 1
    rows = np.uint32(last_access.shape[0])
    for i in range(tslots.shape[0]):
        s = tslots[i]
        # One unsigned compare: an empty bucket (-1), or a slot handed out after the
        # caller's snapshot of the arrays.
        if np.uint32(s) >= rows:
            continue
        hist[_rank(now, last_access[s], frequency[s], lfu, top)] += 1


def eviction_histogram(
    index_slots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    policy: Eviction,
) -> npt.NDArray[np.int64]:
    """Rows per eviction rank over the live buckets of a key index: ``hist[r]`` rows go
    after every row of a higher rank. Under ``"lru"`` the rank is the age in ticks (the
    last bin collects every older row)."""
    hist = np.zeros(_RANK_BINS, dtype=np.int64)
    _rank_histogram(index_slots, last_access, frequency, now, _lfu(policy), hist)
    return hist


def _lfu(policy: Eviction) -> bool:
    if policy not in EVICTIONS:
        raise ValueError(f"eviction={policy!r}: must be one of {', '.join(EVICTIONS)}")
    return policy == "lfu"


@numba.njit(nogil=True, cache=True)
def _select(
    tkeys: npt.NDArray[np.int64],
    tslots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    lfu: bool,
    min_rank: int,
    quota_at_min: int,
    top: int,
    out_keys: npt.NDArray[np.int64],
    out_slots: npt.NDArray[np.int32],
    out_ranks: npt.NDArray[np.int64],
) -> int:
    n = 0
    rows = np.uint32(last_access.shape[0])
    for i in range(tslots.shape[0]):
        s = tslots[i]
        if np.uint32(s) >= rows:  # see _rank_histogram
            continue
        rank = _rank(now, last_access[s], frequency[s], lfu, top)
        if rank > min_rank or (rank == min_rank and quota_at_min > 0):
            if rank == min_rank:
                quota_at_min -= 1
            if n == out_keys.shape[0]:
                break  # rows changed under a scan outside the table lock: enough found
            out_keys[n] = tkeys[i]
            out_slots[n] = s
            out_ranks[n] = rank
            n += 1
    return n


def select_victims(
    index_keys: npt.NDArray[np.int64],
    index_slots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    frequency: npt.NDArray[np.uint32],
    now: np.uint32,
    count: int,
    policy: Eviction,
    hist: npt.NDArray[np.int64] | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """The first ``count`` rows in ``policy``'s eviction order as ``(keys, slots, ranks)``:
    every row above a cut-off rank, plus just enough rows of exactly that rank. ``hist`` is
    this index's ``eviction_histogram`` if the caller already has it. The arrays may change
    during the scan (a table scans outside its lock): ``unchanged_ranks`` then tells which
    victims nothing used meanwhile."""
    lfu = _lfu(policy)
    if hist is None:
        hist = eviction_histogram(index_slots, last_access, frequency, now, policy)
    count = int(min(count, hist.sum()))
    if count <= 0:
        return np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.int64)
    from_top = np.cumsum(hist[::-1])
    j = int(np.searchsorted(from_top, count))  # first bin (from the top) reaching count
    min_rank = hist.shape[0] - 1 - j
    above = int(from_top[j - 1]) if j > 0 else 0
    out_keys = np.empty(count, np.int64)
    out_slots = np.empty(count, np.int32)
    out_ranks = np.empty(count, np.int64)
    top = hist.shape[0] - 1
    n = _select(index_keys, index_slots, last_access, frequency, now, lfu, min_rank, count - above, top, out_keys,
                out_slots, out_ranks)  # fmt: skip
    return out_keys[:n], out_slots[:n], out_ranks[:n]


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
