"""KeyIndex against a plain dict model: slots, `created`, slot reuse, growth, deletion."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ps.table.keyindex import KeyIndex, _home

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
EXTREMES = [0, -1, 1, INT64_MIN, INT64_MAX, INT64_MIN + 1, INT64_MAX - 1, 2**32, -(2**32)]

# A small pool makes hits, duplicates inside a batch and re-inserts of removed keys common;
# arbitrary int64 values keep misses and hash spread honest.
key_st = st.one_of(
    st.sampled_from(EXTREMES),
    st.integers(0, 40),
    st.integers(INT64_MIN, INT64_MAX),
)
batch_st = st.lists(key_st, max_size=40)


def arr(keys: list[int]) -> np.ndarray:
    return np.array(keys, dtype=np.int64)


class KeyIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model: dict[int, int] = {}
        self.issued = 0  # slots handed out so far == expected slot_capacity
        self.index = KeyIndex(1)

    @initialize(capacity=st.sampled_from([1, 2, 3, 8]))
    def start(self, capacity: int) -> None:
        self.index = KeyIndex(capacity)

    def freed(self) -> set[int]:
        return set(range(self.issued)) - set(self.model.values())

    @rule(keys=batch_st)
    def lookup(self, keys: list[int]) -> None:
        slots = self.index.lookup(arr(keys))
        assert slots.dtype == np.int32
        assert slots.tolist() == [self.model.get(k, -1) for k in keys]

    @rule(keys=batch_st)
    def lookup_or_insert(self, keys: list[int]) -> None:
        slots, created = self.index.lookup_or_insert(arr(keys))
        assert slots.dtype == np.int32 and created.dtype == np.bool_
        for key, slot, new in zip(keys, slots.tolist(), created.tolist()):
            if key in self.model:
                assert (slot, new) == (self.model[key], False)
                continue
            assert new
            free = self.freed()
            if free:
                assert slot in free, "a released slot must be reused before a fresh one"
            else:
                assert slot == self.issued
                self.issued += 1
            self.model[key] = slot

    @rule(n=st.integers(50, 400), base=st.integers(INT64_MIN, INT64_MAX - 400))
    def bulk_insert(self, n: int, base: int) -> None:
        # Pushes a tiny initial table through several doublings.
        self.lookup_or_insert(list(range(base, base + n)))

    @rule(keys=batch_st)
    def remove(self, keys: list[int]) -> None:
        slots = self.index.remove(arr(keys))
        assert slots.dtype == np.int32
        assert slots.tolist() == [self.model.pop(k, -1) for k in keys]

    @rule(data=st.data())
    def remove_live(self, data: st.DataObject) -> None:
        if self.model:
            live = sorted(self.model)
            self.remove(data.draw(st.lists(st.sampled_from(live), max_size=60)))

    @invariant()
    def matches_model(self) -> None:
        assert len(self.index) == len(self.model)
        assert self.index.slot_capacity == self.issued
        keys, slots = self.index.items()
        assert keys.dtype == np.int64 and slots.dtype == np.int32
        assert dict(zip(keys.tolist(), slots.tolist())) == self.model
        assert len(np.unique(slots)) == len(slots)
        assert slots.size == 0 or (slots.min() >= 0 and slots.max() < self.index.slot_capacity)


TestKeyIndexMachine = KeyIndexMachine.TestCase
TestKeyIndexMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_empty_batches() -> None:
    index = KeyIndex()
    empty = np.empty(0, dtype=np.int64)
    assert index.lookup(empty).shape == (0,)
    slots, created = index.lookup_or_insert([])
    assert slots.shape == created.shape == (0,)
    assert index.remove(empty).shape == (0,)
    keys, slots = index.items()
    assert keys.shape == slots.shape == (0,)
    assert len(index) == 0 and index.slot_capacity == 0


@pytest.mark.parametrize("shape", [(), (2, 3), (0, 1)])
def test_rejects_non_1d(shape: tuple[int, ...]) -> None:
    index = KeyIndex()
    bad = np.zeros(shape, dtype=np.int64)
    for method in (index.lookup, index.lookup_or_insert, index.remove):
        with pytest.raises(ValueError, match=str(shape).replace("(", r"\(").replace(")", r"\)")):
            method(bad)


def test_rejects_float_keys() -> None:
    with pytest.raises(TypeError, match="float64"):
        KeyIndex().lookup_or_insert(np.array([1.5]))


def test_accepts_any_integer_dtype_and_layout() -> None:
    index = KeyIndex()
    strided = np.arange(20, dtype=np.int64)[::2]
    slots, _ = index.lookup_or_insert(strided)
    assert index.lookup(np.arange(0, 20, 2, dtype=np.int32)).tolist() == slots.tolist()
    assert index.lookup(np.arange(0, 20, 2, dtype=np.uint16)).tolist() == slots.tolist()
    assert index.lookup([0, 2]).tolist() == slots[:2].tolist()


def test_initial_capacity_rounds_up_to_power_of_two() -> None:
    assert KeyIndex(1000).memory_bytes() == 1024 * 12
    with pytest.raises(ValueError):
        KeyIndex(0)


def test_random_round_trip_200k() -> None:
    rng = np.random.default_rng(7)
    keys = np.unique(rng.integers(INT64_MIN, INT64_MAX, 200_000, dtype=np.int64, endpoint=True))
    rng.shuffle(keys)
    index = KeyIndex(16)
    slots, created = index.lookup_or_insert(keys)
    assert created.all() and len(index) == keys.size == index.slot_capacity
    assert np.array_equal(np.sort(slots), np.arange(keys.size, dtype=np.int32))
    assert np.array_equal(index.lookup(keys), slots)
    # Load factor stays <= 0.75 and memory stays near 20-32 bytes per key.
    assert index.memory_bytes() / keys.size <= 33

    gone, kept = keys[::2], keys[1::2]
    assert np.array_equal(index.remove(gone), slots[::2])
    assert np.array_equal(index.lookup(gone), np.full(gone.size, -1, np.int32))
    assert np.array_equal(index.lookup(kept), slots[1::2])

    again, created = index.lookup_or_insert(gone)
    assert created.all() and index.slot_capacity == keys.size  # only freed slots were used
    assert set(again.tolist()) == set(slots[::2].tolist())
    k, s = index.items()
    order = np.argsort(k)
    expect_k = np.concatenate([kept, gone])
    expect_s = np.concatenate([slots[1::2], again])
    expect_order = np.argsort(expect_k)
    assert np.array_equal(k[order], expect_k[expect_order])
    assert np.array_equal(s[order], expect_s[expect_order])


def test_backward_shift_across_the_wraparound() -> None:
    # Keys whose home buckets are the last two and the first of a 64-bucket table, so their
    # probe runs wrap from the end of the array to the start; remove them in every position.
    mask = 63
    picked: list[int] = []
    for key in range(100_000):
        if _home(np.int64(key), mask) in (62, 63, 0) and len(picked) < 12:
            picked.append(key)
    for victim in range(len(picked)):
        index = KeyIndex(64)
        slots, _ = index.lookup_or_insert(arr(picked))
        assert index.remove(arr([picked[victim]])).tolist() == [slots[victim]]
        expect = slots.copy()
        expect[victim] = -1
        assert np.array_equal(index.lookup(arr(picked)), expect)


@given(st.lists(key_st, min_size=1, max_size=30))
@settings(max_examples=50, deadline=None)
def test_overflow_is_all_or_nothing(keys: list[int]) -> None:
    index = KeyIndex(4)
    index.lookup_or_insert(arr(keys[:1]))
    index._max_slots = 3  # stand-in for 2**31 - 1
    before = dict(zip(*(a.tolist() for a in index.items())))
    distinct_new = len(set(keys) - set(before))
    if len(before) + distinct_new <= 3:
        index.lookup_or_insert(arr(keys))
        return
    with pytest.raises(OverflowError, match="out of slots"):
        index.lookup_or_insert(arr(keys))
    assert dict(zip(*(a.tolist() for a in index.items()))) == before
    assert len(index) == len(before)


def test_duplicates_in_one_batch() -> None:
    index = KeyIndex(2)
    slots, created = index.lookup_or_insert(arr([5, 5, INT64_MIN, 5, INT64_MIN]))
    assert slots.tolist() == [0, 0, 1, 0, 1]
    assert created.tolist() == [True, False, True, False, False]
    assert index.remove(arr([5, 5, 9])).tolist() == [0, -1, -1]
    assert len(index) == 1
