"""ps.table.lifecycle (rules, admission sketch, recency clock, victim and expiry choice) and the
config around it: ``Durability``, ``ServerConfig``'s storage settings, ``TableSpec.lifecycle``
on the wire.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from protos import ps_pb2 as pb
from protos.rpc.settings import ConfigError
from ps.durability import Durability
from ps.errors import InvalidRequest
from ps.service import ServerConfig
from ps.table import (
    LFU_HALF_LIFE_S,
    Eviction,
    Lifecycle,
    OptimizerKind,
    OptimizerParams,
    TableSpec,
    now_tick,
    spec_from_proto,
    spec_to_proto,
)
from ps.table.lifecycle import (
    TICKS_PER_S,
    Admission,
    expired_keys,
    scan_ranks,
    select_victims,
    tick_to_unix,
    unchanged_ranks,
)

# -- Lifecycle ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"admit_after": -1}, "lifecycle.admit_after"),
        ({"admit_after": 256}, "lifecycle.admit_after"),
        ({"admit_probability": 0.0}, "lifecycle.admit_probability"),
        ({"admit_probability": 1.5}, "lifecycle.admit_probability"),
        ({"admit_probability": math.nan}, "lifecycle.admit_probability"),
        ({"ttl_seconds": -1.0}, "lifecycle.ttl_seconds"),
        ({"ttl_seconds": math.inf}, "lifecycle.ttl_seconds"),
        ({"ttl_seconds": math.nan}, "lifecycle.ttl_seconds"),
        ({"evict_below_frequency": -1}, "lifecycle.evict_below_frequency"),
        ({"evict_below_frequency": 2**32}, "lifecycle.evict_below_frequency"),
    ],
)
def test_lifecycle_validation_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + "="):
        Lifecycle(**kwargs)  # type: ignore[arg-type]


def test_lifecycle_limits_and_admits_all() -> None:
    Lifecycle(admit_after=255, admit_probability=1e-9, ttl_seconds=0.0, evict_below_frequency=2**32 - 1)
    assert Lifecycle().admits_all and Lifecycle(admit_after=1).admits_all
    assert not Lifecycle(admit_after=2).admits_all
    assert not Lifecycle(admit_probability=0.5).admits_all
    assert Lifecycle(ttl_seconds=5, evict_below_frequency=3).admits_all


# -- Admission ------------------------------------------------------------------------


def distinct_keys(n: int, seed: int = 0) -> npt.NDArray[np.int64]:
    rng = np.random.default_rng(seed)
    return np.unique(rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=n, dtype=np.int64))


@pytest.mark.parametrize("k", [1, 2, 3, 7, 255])
def test_admit_after_admits_exactly_on_the_kth_sighting(k: int) -> None:
    adm = Admission(Lifecycle(admit_after=k), seed=11)
    keys = distinct_keys(500)
    for sighting in range(1, k + 2):
        assert not adm.admitted(keys).any() if sighting <= k else adm.admitted(keys).all()
        got = adm.admit(keys)
        assert got.all() if sighting >= k else not got.any(), f"sighting {sighting}"
    assert adm.admitted(keys).all()


def test_admitted_does_not_count_a_sighting() -> None:
    adm = Admission(Lifecycle(admit_after=3), seed=0)
    keys = np.array([5, -5, 2**62], dtype=np.int64)
    for _ in range(50):
        assert not adm.admitted(keys).any()
    adm.admit(keys)
    for _ in range(50):
        assert not adm.admitted(keys).any()
    assert not adm.admit(keys).any()
    assert adm.admit(keys).all()


def test_sightings_within_one_batch_count() -> None:
    adm = Admission(Lifecycle(admit_after=3), seed=7)
    keys = np.array([1, 2, 1, 1, 2, 3], dtype=np.int64)
    assert adm.admit(keys).tolist() == [False, False, False, True, False, False]


def test_admit_probability_is_about_p_and_deterministic_given_the_seed() -> None:
    keys = distinct_keys(20000, seed=3)
    p = 0.25
    first = Admission(Lifecycle(admit_probability=p), seed=42).admit(keys)
    again = Admission(Lifecycle(admit_probability=p), seed=42).admit(keys)
    other = Admission(Lifecycle(admit_probability=p), seed=43).admit(keys)
    # sd of the fraction is ~0.003; 0.02 is a loose bound
    assert abs(first.mean() - p) < 0.02, first.mean()
    np.testing.assert_array_equal(first, again)
    assert (first != other).any()


def test_each_sighting_is_another_chance() -> None:
    keys = distinct_keys(20000, seed=4)
    adm = Admission(Lifecycle(admit_probability=0.5), seed=1)
    one = adm.admit(keys)
    two = adm.admit(keys)
    assert abs(one.mean() - 0.5) < 0.02 and abs(two.mean() - 0.5) < 0.02
    # independent draws: about a quarter of the keys fail both
    assert abs((~one & ~two).mean() - 0.25) < 0.02


@pytest.mark.parametrize("seed", [0, 1])
def test_admission_coin_keeps_advancing_across_calls(seed: int) -> None:
    # Each admit() call must continue the random sequence, whatever the state's value:
    # two later batches of equal size must not reuse one pattern of coins.
    adm = Admission(Lifecycle(admit_probability=0.5), seed=seed)
    patterns = [adm.admit(distinct_keys(1000, seed=100 + i)) for i in range(4)]
    for a, b in itertools.pairwise(patterns):
        assert (a != b).any()
        assert abs(a.mean() - 0.5) < 0.1


@pytest.mark.parametrize("seed", [0, 2**62, 2**63 - 1, 2**63, 2**64 - 1])
def test_admission_accepts_every_table_seed(seed: int) -> None:
    # TableSpec allows seeds in [0, 2**64); no coin here (admit_probability 1)
    adm = Admission(Lifecycle(admit_after=2), seed=seed)
    keys = distinct_keys(10)
    assert [adm.admit(keys).all() for _ in range(3)] == [False, True, True]


def test_admit_after_and_probability_both_apply() -> None:
    keys = distinct_keys(20000, seed=5)
    adm = Admission(Lifecycle(admit_after=2, admit_probability=0.5), seed=9)
    assert not adm.admit(keys).any()  # first sighting never admits
    second = adm.admit(keys)
    assert abs(second.mean() - 0.5) < 0.02
    # ``admitted`` (used by pushes) asks only the count, not the coin
    assert adm.admitted(keys).all()


def test_admission_memory_is_fixed() -> None:
    adm = Admission(Lifecycle(admit_after=2), seed=0, width=1 << 10)
    assert adm.memory_bytes() == 4 * (1 << 10)
    adm.admit(distinct_keys(100000))
    assert adm.memory_bytes() == 4 * (1 << 10)


# -- clock, age histogram, victims, expiry ----------------------------------------------


def test_now_tick_counts_eighths_of_a_second() -> None:
    assert TICKS_PER_S == 8
    t = now_tick()
    assert isinstance(t, np.uint32)
    assert abs(tick_to_unix(int(t)) - time.time()) < 1.0
    assert tick_to_unix(16) - tick_to_unix(0) == 2.0


def index_arrays(
    last_access: npt.NDArray[np.uint32], holes: int = 3, seed: int = 0
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
    """A key index's buckets: keys ``1000 + slot`` for slots 0..n-1, shuffled, with empty
    buckets (slot -1, key garbage) between them."""
    n = last_access.shape[0]
    rng = np.random.default_rng(seed)
    slots = np.concatenate([np.arange(n, dtype=np.int32), np.full(holes * n, -1, dtype=np.int32)])
    rng.shuffle(slots)
    keys = np.where(slots >= 0, 1000 + slots, rng.integers(0, 10, size=slots.shape[0])).astype(np.int64)
    return keys, slots


def never_looked_up(la: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    return np.zeros(la.shape[0], np.uint32)


def test_lru_histogram_counts_live_rows_by_modular_age() -> None:
    now = np.uint32(5)
    la = np.array([5, 4, 4, 2**32 - 3, 5 - 70000 + 2**32, 7], dtype=np.uint32)
    _, slots = index_arrays(la)
    hist = scan_ranks(slots, la, never_looked_up(la), now, "lru").hist
    assert hist.sum() == la.shape[0]
    assert hist[1] == 2 and hist[8] == 1  # 2**32-3 is 8 ticks before 5
    # a row touched after the caller read the clock is among the youngest, not the oldest
    assert hist[0] == 2
    assert hist[-1] == 1  # 70000 ticks old: the last bin


@pytest.mark.parametrize("count", [0, 1, 17, 50, 99, 100, 1000])
def test_lru_takes_exactly_count_oldest_rows(count: int) -> None:
    rng = np.random.default_rng(count)
    n = 100
    now = np.uint32(3)  # rows older than now wrap around 2**32
    ages = rng.integers(0, 30, size=n)  # many ties
    la = (np.int64(now) - ages).astype(np.uint32)
    keys, slots = index_arrays(la, seed=count)
    vk, vs, _ = select_victims(keys, slots, la, never_looked_up(la), now, count, "lru")
    assert vk.dtype == np.int64 and vs.dtype == np.int32
    assert vk.shape[0] == min(count, n) == vs.shape[0]
    assert len(set(vs.tolist())) == vs.shape[0] and (vk == 1000 + vs).all()
    rest = np.setdiff1d(np.arange(n), vs)
    if vs.size and rest.size:
        assert ages[vs].min() >= ages[rest].max()


def test_select_victims_picks_from_a_scan_of_the_same_buckets() -> None:
    la = np.arange(50, dtype=np.uint32)
    keys, slots = index_arrays(la)
    now = np.uint32(100)
    scan = scan_ranks(slots, la, never_looked_up(la), now, "lru")
    _, vs, _ = select_victims(keys, slots, la, never_looked_up(la), now, 10, "lru", scan)
    assert sorted(vs.tolist()) == list(range(10))
    # LFU, equal counts: ages by power of two, so any 10 of those 64 ticks old or more (slots 0-36).
    scan = scan_ranks(slots, la, never_looked_up(la), now, "lfu")
    _, vs, _ = select_victims(keys, slots, la, never_looked_up(la), now, 10, "lfu", scan)
    assert vs.shape[0] == 10 and vs.max() <= 36
    # The scan's ranks are used as they were: rows touched since it are still picked (the
    # caller checks victims with unchanged_ranks) ...
    scan = scan_ranks(slots, la, never_looked_up(la), now, "lru")
    touched = la.copy()
    touched[:10] = now
    _, vs, _ = select_victims(keys, slots, touched, never_looked_up(la), now, 10, "lru", scan)
    assert sorted(vs.tolist()) == list(range(10))
    # ... but a scan of other buckets (an index that has grown since) is not: they rank again.
    _, vs, _ = select_victims(keys, slots.copy(), touched, never_looked_up(la), now, 10, "lru", scan)
    assert sorted(vs.tolist()) == list(range(10, 20))


@pytest.mark.parametrize("count", [0, 1, 17, 50, 99, 100])
def test_lfu_takes_the_least_looked_up_rows_then_the_oldest(count: int) -> None:
    rng = np.random.default_rng(count)
    n = 100
    now = np.uint32(1000)
    ages = rng.integers(1, 30, size=n)  # none touched in this tick
    freq = rng.integers(0, 6, size=n).astype(np.uint32)  # many ties
    la = (np.int64(now) - ages).astype(np.uint32)
    keys, slots = index_arrays(la, seed=count)
    _, vs, _ = select_victims(keys, slots, la, freq, now, count, "lfu")
    assert vs.shape[0] == count and len(set(vs.tolist())) == count
    rest = np.setdiff1d(np.arange(n), vs)
    if vs.size and rest.size:
        assert freq[vs].max() <= freq[rest].min()
        # Among rows of the cut-off count, older (by power-of-two age) ones go first.
        cut = freq[vs].max()
        tied_in, tied_out = vs[freq[vs] == cut], rest[freq[rest] == cut]
        if tied_in.size and tied_out.size:
            assert np.log2(ages[tied_in]).astype(int).min() >= np.log2(ages[tied_out]).astype(int).max()


def test_lfu_keeps_rows_in_use_and_forgets_counts_of_idle_rows() -> None:
    now = np.uint32(10 * LFU_HALF_LIFE_S * TICKS_PER_S)
    half_life = LFU_HALF_LIFE_S * TICKS_PER_S
    # slot 0: looked up once, touched in this tick; slot 1: looked up once, 1 tick ago;
    # slot 2: 100 lookups, 1 tick ago; slot 3: 100 lookups, idle 7 half-lives (100 >> 7 == 0)
    la = np.array([now, now - 1, now - 1, now - 7 * half_life], dtype=np.uint32)
    freq = np.array([1, 1, 100, 100], dtype=np.uint32)
    keys, slots = index_arrays(la)
    order = []
    for count in range(1, 5):
        _, vs, _ = select_victims(keys, slots, la, freq, now, count, "lfu")
        order.append(sorted(set(vs.tolist()) - set(order))[0])
    assert order == [3, 1, 2, 0]  # the idle one first, the one in use last
    # LRU on the same rows: oldest first, counts ignored.
    _, vs, _ = select_victims(keys, slots, la, freq, now, 1, "lru")
    assert vs.tolist() == [3]


def reference_lfu_rank(now: int, last_access: int, frequency: int) -> int:
    """The LFU rank as the module docstring states it, in plain integers."""
    age = (now - last_access) % 2**32
    age = 0 if age >= 2**31 else min(age, 2**16 - 1)  # touched after `now`: the youngest
    if age == 0:
        return 0
    count = min(frequency >> min(age // (LFU_HALF_LIFE_S * TICKS_PER_S), 40), 4094)
    return 1 + (4094 - count) * 16 + age.bit_length() - 1


def test_lfu_ranks_match_the_stated_formula() -> None:
    rng = np.random.default_rng(8)
    n = 20_000
    now = np.uint32(7)  # most rows were touched before the clock wrapped
    ages = np.concatenate([rng.integers(0, 1 << 17, n), [0, 1, 2, 3, 4800, 4800 * 41, 2**31 - 1, 2**31, 2**32 - 1]])
    la = (np.int64(now) - ages).astype(np.uint32)
    freq = np.concatenate([rng.integers(0, 1 << 13, n // 2), rng.integers(0, 2**32, n - n // 2), [2**32 - 1] * 9])
    freq = freq.astype(np.uint32)
    _, slots = index_arrays(la, holes=1)
    scan = scan_ranks(slots, la, freq, now, "lfu")
    live = slots >= 0
    want = [reference_lfu_rank(int(now), int(la[s]), int(freq[s])) for s in slots[live]]
    assert scan.ranks[live].tolist() == want and (scan.ranks[~live] == 0).all()
    assert scan.hist.sum() == la.shape[0] and (np.bincount(want, minlength=1 << 16) == scan.hist).all()


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_victims_used_after_the_scan_are_told_apart(policy: Eviction) -> None:
    rng = np.random.default_rng(4)
    n = 200
    now = np.uint32(5000)
    la = (np.int64(now) - rng.integers(1, 3000, size=n)).astype(np.uint32)
    freq = rng.integers(0, 9, size=n).astype(np.uint32)
    keys, slots = index_arrays(la)
    vk, vs, ranks = select_victims(keys, slots, la, freq, now, 50, policy)
    assert vk.tolist() == (1000 + vs).tolist() and vs.shape[0] == ranks.shape[0] == 50
    assert unchanged_ranks(vs, ranks, la, freq, now, policy).all()
    # Rows used since the scan: one looked up now, one looked up once more (LFU only
    # counts that), and a slot that is gone (-1); the rest are still victims.
    la[vs[0]] = now
    freq[vs[1]] += 1
    unused = unchanged_ranks(np.where(np.arange(50) == 2, -1, vs), ranks, la, freq, now, policy)
    assert not unused[0] and not unused[2]
    assert unused[1] == (policy == "lru") and unused[3:].all()


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_rows_in_use_go_last_and_empty_buckets_never(policy: Eviction) -> None:
    # Empty buckets rank 0 in a scan, as rows touched in this tick do: asked for more
    # rows than are idle, selection takes rows in use, never an empty bucket.
    now = np.uint32(100)
    la = np.full(20, now, np.uint32)
    la[:5] = now - 3  # 5 idle rows, 15 in use
    keys, slots = index_arrays(la)
    vk, vs, ranks = select_victims(keys, slots, la, never_looked_up(la), now, 12, policy)
    assert vs.shape[0] == 12 and (vs >= 0).all() and (vk == 1000 + vs).all()
    assert set(range(5)) <= set(vs.tolist()) and (ranks[vs >= 5] == 0).all()
    assert select_victims(keys, slots, la, never_looked_up(la), now, 99, policy)[1].shape[0] == 20


def test_victim_scans_skip_slots_beyond_the_arrays_they_were_given() -> None:
    # A scan outside the table lock can meet a slot handed out after its snapshot of the
    # arena's columns (the arena grew meanwhile): such a bucket is not a row it knows.
    la = np.zeros(4, np.uint32)
    keys, slots = index_arrays(la)
    slots = np.concatenate([slots, np.array([4, 1 << 30], np.int32)])
    keys = np.concatenate([keys, np.array([1004, 1005], np.int64)])
    now = np.uint32(100)
    assert scan_ranks(slots, la, la, now, "lfu").hist.sum() == 4
    vk, vs, _ = select_victims(keys, slots, la, la, now, 10, "lfu")
    assert sorted(vs.tolist()) == [0, 1, 2, 3] and sorted(vk.tolist()) == [1000, 1001, 1002, 1003]


def test_eviction_policy_is_checked() -> None:
    la = np.zeros(3, np.uint32)
    keys, slots = index_arrays(la)
    with pytest.raises(ValueError, match="eviction='mru': must be one of lfu, lru"):
        select_victims(keys, slots, la, la, np.uint32(9), 1, "mru")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="eviction='fifo'"):
        ServerConfig(eviction="fifo")


def test_expired_keys_are_older_than_ttl() -> None:
    now = np.uint32(1000)
    ttl = 2.0  # 16 ticks: an age of 16 is not expired, 17 is
    ages = np.array([0, 15, 16, 17, 500], dtype=np.int64)
    la = (np.int64(now) - ages).astype(np.uint32)
    keys, slots = index_arrays(la)
    got = expired_keys(keys, slots, la, now, ttl)
    assert sorted(got.tolist()) == [1003, 1004]
    assert sorted(expired_keys(keys, slots, la, now, 15.0 / TICKS_PER_S).tolist()) == [1002, 1003, 1004]
    # a ttl of 0.3 s is 2 whole ticks: an age of 3 ticks is expired, 2 is not
    la = np.array([998, 997], dtype=np.uint32)
    keys, slots = index_arrays(la)
    assert expired_keys(keys, slots, la, now, 0.3).tolist() == [1001]
    assert expired_keys(keys[:0], slots[:0], la, now, ttl).shape == (0,)


# -- Durability and ServerConfig ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "interval_s"),
    [
        ("every-push", "every-push", 0.0),
        ("checkpoint-only", "checkpoint-only", 0.0),
        ("interval:2.5", "interval", 2.5),
        ("interval:5", "interval", 5.0),
    ],
)
def test_durability_parse(text: str, kind: str, interval_s: float) -> None:
    d = Durability.parse(text)
    assert (d.kind, d.interval_s) == (kind, interval_s)
    assert Durability.parse(str(d)) == d


@pytest.mark.parametrize(
    "text",
    [
        "interval:0",
        "interval:-1",
        "interval:x",
        "interval:",
        "interval:nan",
        "interval:inf",
        "interval",
        "foo",
        "",
        "every_push",
    ],
)
def test_durability_parse_rejects_listing_the_options(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        Durability.parse(text)
    message = str(info.value)
    assert repr(text) in message
    for option in ("every-push", "interval:SECONDS", "checkpoint-only"):
        assert option in message


def test_server_config_storage_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="memory_budget_bytes needs data_dir"):
        ServerConfig(memory_budget_bytes=1 << 20)
    with pytest.raises(ConfigError, match="restore_from needs data_dir"):
        ServerConfig(restore_from=tmp_path)
    with pytest.raises(ConfigError, match="memory_budget_bytes=-1"):
        ServerConfig(data_dir=tmp_path, memory_budget_bytes=-1)
    with pytest.raises(ConfigError, match="durability='sometimes'"):
        ServerConfig(durability="sometimes")
    cfg = ServerConfig(
        data_dir=tmp_path, memory_budget_bytes=1 << 20, durability="every-push", restore_from=tmp_path / "ck"
    )
    assert cfg.memory_budget_bytes == 1 << 20


# -- TableSpec.lifecycle on the wire ------------------------------------------------------


LC = Lifecycle(admit_after=3, admit_probability=0.25, ttl_seconds=7.5, evict_below_frequency=2)


def test_table_spec_lifecycle_round_trips_through_proto() -> None:
    spec = TableSpec("t", 8, optimizer=OptimizerParams(OptimizerKind.ADAM), seed=2**64 - 1, lifecycle=LC)
    msg = spec_to_proto(spec)
    assert msg.lifecycle.admit_after == 3 and msg.lifecycle.admit_probability == 0.25
    assert spec_from_proto(pb.TableSpec.FromString(msg.SerializeToString())) == spec
    assert spec_from_proto(spec_to_proto(TableSpec("t", 8))).lifecycle == Lifecycle()


def test_absent_lifecycle_fields_take_the_defaults() -> None:
    assert spec_from_proto(pb.TableSpec(name="t", dim=4)).lifecycle == Lifecycle()
    got = spec_from_proto(pb.TableSpec(name="t", dim=4, lifecycle=pb.Lifecycle(ttl_seconds=3)))
    assert got.lifecycle == Lifecycle(ttl_seconds=3.0)


@pytest.mark.parametrize(
    ("lc", "field"),
    [
        (pb.Lifecycle(admit_probability=0.0), "lifecycle.admit_probability"),
        (pb.Lifecycle(admit_probability=2.0), "lifecycle.admit_probability"),
        (pb.Lifecycle(admit_after=256), "lifecycle.admit_after"),
        (pb.Lifecycle(ttl_seconds=-1), "lifecycle.ttl_seconds"),
    ],
)
def test_bad_lifecycle_on_the_wire_is_an_invalid_request(lc: pb.Lifecycle, field: str) -> None:
    with pytest.raises(InvalidRequest, match=field.replace(".", r"\.")) as info:
        spec_from_proto(pb.TableSpec(name="t", dim=4, lifecycle=lc))
    assert "'t'" in str(info.value)


def test_differences_name_lifecycle_fields() -> None:
    assert TableSpec("t", 4).differences(TableSpec("t", 4, lifecycle=LC)) == [
        "lifecycle.admit_after: 0 != 3",
        "lifecycle.admit_probability: 1.0 != 0.25",
        "lifecycle.ttl_seconds: 0.0 != 7.5",
        "lifecycle.evict_below_frequency: 0 != 2",
    ]
    assert TableSpec("t", 4, lifecycle=LC).differences(TableSpec("t", 4, lifecycle=LC)) == []
