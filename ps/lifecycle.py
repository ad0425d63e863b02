"""The life of a key in a table: admission, recency clock, eviction and expiry choices.

* ``Lifecycle`` holds a table's rules (part of its ``TableSpec``): admit a key only
  after ``admit_after`` lookups and/or with ``admit_probability``; delete rows idle
  for ``ttl_seconds``; delete instead of spilling rows looked up fewer than
  ``evict_below_frequency`` times.
* ``Admission`` counts lookups of keys that have no row yet, in a count-min sketch
  (4 rows of saturating uint8 counters: fixed memory whatever the key space).
* Recency is kept per row as a uint32 ``tick``: eighths of a second since
  2025-01-01 UTC (wraps in 2042). ``now_tick`` reads the clock.
* ``age_histogram`` and ``select_victims`` pick the least recently used rows of a
  table straight from its key index, in two passes and without sorting.

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

import numba
import numpy as np
import numpy.typing as npt

__all__ = [
    "TICKS_PER_S",
    "Admission",
    "Lifecycle",
    "age_histogram",
    "now_tick",
    "select_victims",
    "tick_to_unix",
]

TICKS_PER_S = 8
_EPOCH_UNIX = 1735689600  # 2025-01-01T00:00:00Z
_AGE_BINS = 1 << 16  # ages above ~2.3 hours share the last bin


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


@numba.njit(nogil=True, cache=True)
def _age_histogram(
    tslots: npt.NDArray[np.int32], last_access: npt.NDArray[np.uint32], now: np.uint32, hist: npt.NDArray[np.int64]
) -> None:
    top = hist.shape[0] - 1
    for i in range(tslots.shape[0]):
        s = tslots[i]
        if s < 0:
            continue
        hist[_age(now, last_access[s], top)] += 1


def age_histogram(
    index_slots: npt.NDArray[np.int32], last_access: npt.NDArray[np.uint32], now: np.uint32
) -> npt.NDArray[np.int64]:
    """Rows per age in ticks (``hist[a]``: rows last touched ``a`` ticks ago; the last bin
    collects every older row), over the live buckets of a key index."""
    hist = np.zeros(_AGE_BINS, dtype=np.int64)
    _age_histogram(index_slots, last_access, now, hist)
    return hist


@numba.njit(nogil=True, cache=True)
def _select(
    tkeys: npt.NDArray[np.int64],
    tslots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    now: np.uint32,
    min_age: int,
    quota_at_min: int,
    top: int,
    out_keys: npt.NDArray[np.int64],
    out_slots: npt.NDArray[np.int32],
) -> int:
    n = 0
    for i in range(tslots.shape[0]):
        s = tslots[i]
        if s < 0:
            continue
        age = _age(now, last_access[s], top)
        if age > min_age or (age == min_age and quota_at_min > 0):
            if age == min_age:
                quota_at_min -= 1
            out_keys[n] = tkeys[i]
            out_slots[n] = s
            n += 1
    return n


def select_victims(
    index_keys: npt.NDArray[np.int64],
    index_slots: npt.NDArray[np.int32],
    last_access: npt.NDArray[np.uint32],
    now: np.uint32,
    count: int,
    hist: npt.NDArray[np.int64] | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
    """The ``count`` least recently used rows as ``(keys, slots)``: every row older than a
    cut-off age, plus just enough rows of exactly that age. ``hist`` is this index's
    ``age_histogram`` if the caller already has it."""
    if hist is None:
        hist = age_histogram(index_slots, last_access, now)
    count = int(min(count, hist.sum()))
    if count <= 0:
        return np.empty(0, np.int64), np.empty(0, np.int32)
    from_oldest = np.cumsum(hist[::-1])
    j = int(np.searchsorted(from_oldest, count))  # first bin (from the oldest) reaching count
    min_age = hist.shape[0] - 1 - j
    older = int(from_oldest[j - 1]) if j > 0 else 0
    out_keys = np.empty(count, np.int64)
    out_slots = np.empty(count, np.int32)
    n = _select(
        index_keys, index_slots, last_access, now, min_age, count - older, hist.shape[0] - 1, out_keys, out_slots
    )
    return out_keys[:n], out_slots[:n]


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
