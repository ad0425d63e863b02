"""ps.shard: the exactly-once ``PushLedger``, the ``Shard``'s tables and request checks,
and its request path (``lookup``, ``push``, modes, hit rate)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from protos import ps_pb2 as pb
from protos import wire
from protos.keys import shard_of
from ps.elastic import Route
from ps.errors import (
    InvalidRequest,
    RequestTooLarge,
    ShardMismatch,
    ShuttingDown,
    TableExists,
    UnknownTable,
    WrongMode,
    WrongShard,
)
from ps.service.report import shard_stats
from ps.service.servicer import lookup_response
from ps.shard import Shard
from ps.store import Storage
from ps.table import InitializerParams, OptimizerKind, OptimizerParams, TableSpec, spec_from_proto, spec_to_proto
from ps.table.ledger import PushLedger
from tests.fakes import lookup_rows, push_request


class _Abandon(Exception):
    """Raised inside ``claim`` so that the claimed seq is not recorded."""


def apply(ledger: PushLedger, client: str, seq: int) -> bool:
    """Claim and finish ``seq``; True if it was applied now, False if it was a duplicate."""
    with ledger.claim(client, seq) as fresh:
        return fresh


def would_apply(ledger: PushLedger, client: str, seq: int) -> bool:
    """Whether ``seq`` would be applied, without recording it (the ``with`` body fails)."""
    answer = None
    with pytest.raises(_Abandon):
        with ledger.claim(client, seq) as fresh:
            answer = fresh
            raise _Abandon
    assert answer is not None
    return answer


# -- PushLedger -----------------------------------------------------------------------


def test_seq_zero_always_applies_and_is_not_counted() -> None:
    ledger = PushLedger()
    assert [apply(ledger, "c", 0) for _ in range(3)] == [True, True, True]
    assert ledger.duplicates == 0
    assert apply(ledger, "c", 1)  # seq 0 did not occupy anything


def test_same_seq_twice_is_a_duplicate() -> None:
    ledger = PushLedger()
    assert apply(ledger, "c", 1)
    assert ledger.duplicates == 0
    assert not apply(ledger, "c", 1)
    assert not apply(ledger, "c", 1)
    assert ledger.duplicates == 2
    assert apply(ledger, "c", 2)


def test_out_of_order_seqs_apply_once_each() -> None:
    ledger = PushLedger()
    assert [apply(ledger, "c", s) for s in (3, 1, 2)] == [True, True, True]
    assert [apply(ledger, "c", s) for s in (1, 2, 3)] == [False, False, False]
    assert ledger.duplicates == 3
    assert apply(ledger, "c", 5) and apply(ledger, "c", 4)
    assert not apply(ledger, "c", 4) and not apply(ledger, "c", 5)


def test_failed_body_does_not_record_the_seq() -> None:
    ledger = PushLedger()
    with pytest.raises(RuntimeError, match="boom"):
        with ledger.claim("c", 7) as fresh:
            assert fresh
            raise RuntimeError("boom")
    assert apply(ledger, "c", 7)  # the retry applies
    assert not apply(ledger, "c", 7)
    assert ledger.duplicates == 1


def test_clients_are_independent() -> None:
    ledger = PushLedger()
    assert apply(ledger, "a", 1)
    assert apply(ledger, "b", 1)
    assert not apply(ledger, "a", 1)
    assert apply(ledger, "b", 2)
    assert ledger.duplicates == 1


@pytest.mark.parametrize("first_succeeds", [True, False])
def test_concurrent_claims_of_one_seq_apply_exactly_once(first_succeeds: bool) -> None:
    ledger = PushLedger()
    inside, release = threading.Event(), threading.Event()
    second_answered = threading.Event()
    answers: dict[str, bool] = {}

    def first() -> None:
        with ledger.claim("c", 4) as fresh:
            answers["first"] = fresh
            inside.set()
            release.wait(10)
            if not first_succeeds:
                raise _Abandon

    def second() -> None:
        inside.wait(10)
        answers["second"] = apply(ledger, "c", 4)
        second_answered.set()

    with ThreadPoolExecutor(2) as pool:
        f1, f2 = pool.submit(first), pool.submit(second)
        assert inside.wait(10)
        # The second arrival waits while the first is still applying the push.
        assert not second_answered.wait(0.2)
        release.set()
        f2.result(timeout=10)
        if first_succeeds:
            f1.result(timeout=10)
        else:
            with pytest.raises(_Abandon):
                f1.result(timeout=10)

    assert answers["first"] is True
    # Exactly one of the two applied: the second only if the first failed.
    assert answers["second"] is (not first_succeeds)
    assert ledger.duplicates == (1 if first_succeeds else 0)
    assert not apply(ledger, "c", 4)


def test_window_gives_up_a_gap_after_more_than_window_later_seqs() -> None:
    # The documented trade-off: to bound memory, a client that leaves more than `window`
    # later pushes applied above a gap is taken to have abandoned the gap's push; that
    # seq then reads as a duplicate and can never be applied.
    ledger = PushLedger(window=4)
    for seq in (2, 3, 4, 5):  # exactly `window` seqs above the gap at 1
        assert apply(ledger, "c", seq)
    assert would_apply(ledger, "c", 1)  # still within the window

    assert apply(ledger, "c", 6)  # one more: the gap is given up

    assert not apply(ledger, "c", 1)
    assert [apply(ledger, "c", s) for s in range(2, 7)] == [False] * 5
    assert apply(ledger, "c", 7)


def test_window_low_never_moves_back_when_a_given_up_seq_completes() -> None:
    ledger = PushLedger(window=4)
    inside, release = threading.Event(), threading.Event()

    def slow_push() -> None:
        with ledger.claim("c", 1) as fresh:
            assert fresh
            inside.set()
            release.wait(10)

    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(slow_push)
        assert inside.wait(10)
        for seq in range(2, 7):  # 5 > window seqs above the in-flight seq 1: 1 is given up
            assert apply(ledger, "c", seq)
        release.set()
        slow.result(timeout=10)  # seq 1 finishes successfully after all

    for seq in range(8, 12):  # a gap at 7, then `window` seqs above it: overflow again
        assert apply(ledger, "c", seq)

    # Seqs 2..6 were applied: a retry of any of them must be a duplicate.
    assert [would_apply(ledger, "c", s) for s in range(2, 7)] == [False] * 5


def test_max_clients_forgets_least_recently_seen_client() -> None:
    ledger = PushLedger(max_clients=2)
    assert apply(ledger, "a", 1)
    assert apply(ledger, "b", 1)
    assert apply(ledger, "a", 2)  # a is now the most recently seen
    assert apply(ledger, "c", 1)  # a third client: b is forgotten

    assert not would_apply(ledger, "a", 1)  # a is remembered
    assert apply(ledger, "b", 1)  # b's history is gone: its seq 1 applies again
    # Remembering b again pushed out c (a was seen more recently by the probe above).
    assert apply(ledger, "c", 1)


# -- Shard ----------------------------------------------------------------------------


def test_shard_index_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match=r"shard=-1"):
        Shard(-1, 2)


def test_a_shard_past_the_end_of_its_cluster_is_a_spare_owning_nothing() -> None:
    spare = Shard(2, 2)
    spare.create_table(TableSpec("t", dim=4))
    with pytest.raises(WrongShard, match="shard 2 is a spare outside the cluster of 2 shards"):
        lookup_rows(spare, "t", np.array([1, 2, 3], dtype=np.int64))


def test_create_table_is_idempotent() -> None:
    shard = Shard(0, 1)
    spec = TableSpec("item", dim=8, seed=5)
    assert shard.create_table(spec) is True
    table = shard.table("item")
    assert shard.create_table(TableSpec("item", dim=8, seed=5)) is False
    assert shard.table("item") is table
    assert table.spec == spec and table.dim == 8


def test_concurrent_create_table_creates_once() -> None:
    shard = Shard(0, 1)
    spec = TableSpec("t", dim=4)
    with ThreadPoolExecutor(8) as pool:
        created = list(pool.map(lambda _: shard.create_table(spec), range(32)))
    assert created.count(True) == 1
    assert [t.spec.name for t in shard.tables()] == ["t"]


def test_create_table_with_other_spec_names_every_difference() -> None:
    shard = Shard(0, 1)
    shard.create_table(TableSpec("t", 4))
    other = TableSpec(
        "t",
        8,
        initializer=InitializerParams(low=-1.0),
        optimizer=OptimizerParams(OptimizerKind.ADAGRAD, lr=0.5),
        seed=3,
    )

    with pytest.raises(TableExists) as info:
        shard.create_table(other)

    message = str(info.value)
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert "table 't'" in message
    for diff in [
        "dim: 4 != 8",
        "seed: 0 != 3",
        "initializer.low: -0.05 != -1.0",
        "optimizer.kind: SGD != ADAGRAD",
        "optimizer.lr: 0.01 != 0.5",
        "optimizer.eps: 1e-08 != 1e-10",  # each kind's default eps differs too
    ]:
        assert diff in message
    assert "high" not in message and "beta1" not in message  # equal fields are not listed
    assert shard.table("t").dim == 4  # the existing table is untouched


def test_unknown_table_lists_existing_tables() -> None:
    shard = Shard(1, 3)
    with pytest.raises(UnknownTable, match=r"'x' does not exist on shard 1 \(tables: none\)"):
        shard.table("x")
    shard.create_table(TableSpec("user", 4))
    shard.create_table(TableSpec("ad", 4))
    with pytest.raises(UnknownTable, match=r"'x' does not exist on shard 1 \(tables: ad, user\)") as info:
        shard.table("x")
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    assert [t.spec.name for t in shard.tables()] == ["ad", "user"]


def test_check_request_accepts_matching_or_unset_routing() -> None:
    shard = Shard(1, 3)
    shard.check_request(Route(3, 1))
    shard.check_request(Route(3))
    shard.check_request(Route(0))  # 0 and None skip the checks


def test_check_request_rejects_wrong_cluster_size() -> None:
    shard = Shard(1, 3)
    with pytest.raises(ShardMismatch, match=r"num_shards=2.*cluster of 3") as info:
        shard.check_request(Route(2, 1))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_check_request_rejects_wrong_shard() -> None:
    shard = Shard(1, 3)
    with pytest.raises(ShardMismatch, match=r"request for shard 2 reached shard 1"):
        shard.check_request(Route(3, 2))
    with pytest.raises(ShardMismatch):
        shard.check_request(Route(0, 0))


def test_closed_shard_refuses_requests() -> None:
    shard = Shard(0, 2)
    shard.close()
    with pytest.raises(ShuttingDown, match="shard 0 is shutting down") as info:
        shard.check_request(Route(2, 0))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_serving_shard_is_not_writable() -> None:
    Shard(0, 1).check_writable()
    with pytest.raises(WrongMode, match=r"read-only \(mode=serve\)") as info:
        Shard(0, 1, mode="serve").check_writable()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_shard_is_built_training_or_serving_and_stays_so() -> None:
    with pytest.raises(ValueError, match="only a serving shard"):
        Shard(0, 1, source=lambda shard: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(AttributeError):
        Shard(0, 1).mode = "serve"  # type: ignore[misc]


def test_check_table_field_rejects_empty_name() -> None:
    Shard.check_table_field("t", "entries[0].table")
    with pytest.raises(InvalidRequest, match=r"entries\[3\]\.table: table name is empty"):
        Shard.check_table_field("", "entries[3].table")


# -- Shard: the request path --------------------------------------------------------------


def lookup_request(*entries: tuple[str, list[int], int], **routing: int) -> pb.LookupRequest:
    return pb.LookupRequest(
        entries=[pb.LookupEntry(table=t, keys=wire.encode_keys(np.array(k, np.int64)), dtype=d) for t, k, d in entries],  # type: ignore[arg-type]
        **routing,
    )


def test_lookup_gathers_every_entry_into_one_response_in_its_dtype() -> None:
    shard = Shard(0, 1)
    shard.create_table(TableSpec("a", 4, seed=1))
    shard.create_table(TableSpec("b", 3, seed=2))
    request = lookup_request(("a", [5, 6, 5], wire.FLOAT32), ("b", [7], wire.FLOAT16), ("a", [], wire.FLOAT32))
    results = wire.decode_lookup_response(lookup_response(shard, request, 1 << 20))
    assert [(r.table, r.dim, r.dtype) for r in results] == [
        ("a", 4, wire.FLOAT32),
        ("b", 3, wire.FLOAT16),
        ("a", 4, wire.FLOAT32),
    ]
    a = shard.table("a").lookup(np.array([5, 6, 5]), create=False)
    b = shard.table("b").lookup(np.array([7]), create=False)
    np.testing.assert_array_equal(wire.decode_rows(results[0].rows, 3, 4, wire.FLOAT32, "a"), a)
    np.testing.assert_array_equal(wire.decode_rows(results[1].rows, 1, 3, wire.FLOAT16, "b"), b.astype(np.float16))
    assert len(results[2].rows) == 0
    assert len(shard.table("a")) == 2 and len(shard.table("b")) == 1
    np.testing.assert_array_equal(lookup_rows(shard, "a", [6]), a[1:2])


def test_lookup_checks_every_entry_before_it_creates_a_row() -> None:
    shard = Shard(0, 2)
    shard.create_table(TableSpec("a", 4))
    bad = [
        (lookup_request(("a", [1], 1), ("nope", [2], 1)), UnknownTable, "'nope' does not exist"),
        (lookup_request(("a", [1], 1), ("", [2], 1)), InvalidRequest, r"entries\[1\]\.table: table name is empty"),
        (lookup_request(("a", [1], 1), ("a", [2], 9)), wire.WireFormatError, r"entries\[1\]\.dtype: unknown dtype 9"),
        (lookup_request(("a", [1], 1), num_shards=3), ShardMismatch, "num_shards=3"),
        (lookup_request(("a", [1], 1), shard=1), ShardMismatch, "request for shard 1 reached shard 0"),
        (lookup_request(("a", list(range(40)), 1)), RequestTooLarge, "max_message_bytes=4608"),
    ]
    for request, error, message in bad:
        with pytest.raises(error, match=message):
            lookup_response(shard, request, 4608)
    raw = pb.LookupRequest(entries=[pb.LookupEntry(table="a", keys=b"\x01" * 12)])
    with pytest.raises(wire.InvalidKeys, match=r"entries\[0\]\.keys \(table 'a'\): 12 bytes is not a multiple of 8"):
        lookup_response(shard, raw, 4608)
    assert len(shard.table("a")) == 0 and shard.table("a").counters.lookups == 0


def test_push_checks_every_entry_before_it_applies_any() -> None:
    shard = Shard(0, 1)
    shard.create_table(TableSpec("a", 2))
    grads = np.ones((1, 2), np.float32)
    with pytest.raises(InvalidRequest, match=r"table 'a': grads\[0\]\[1\] is nan"):
        shard.push(push_request([("a", [1], grads), ("a", [2], np.array([[0.0, np.nan]], np.float32))], "w", 1))
    with pytest.raises(UnknownTable):
        shard.push(push_request([("a", [1], grads), ("b", [2], grads)], "w", 1))
    assert len(shard.table("a")) == 0 and shard.duplicate_pushes() == 0
    assert shard.push(push_request([("a", [1, 1, 3], np.ones((3, 2), np.float32))], "w", 1)) == (True, 2)
    assert shard.push(push_request([("a", [1], grads)], "w", 1)) == (False, 0)


def test_mode_is_train_or_serve() -> None:
    assert Shard(0, 1).mode == "train" and Shard(0, 1, mode="serve").mode == "serve"
    with pytest.raises(ValueError, match="mode='predict': expected one of train, serve"):
        Shard(0, 1, mode="predict")  # type: ignore[arg-type]


def test_serving_shard_reads_missing_keys_as_zeros_and_refuses_pushes(tmp_path: Path) -> None:
    trained = Shard(0, 1, Storage(tmp_path, shard=0, num_shards=1))
    trained.create_table(TableSpec("t", 3, seed=4))
    known = lookup_rows(trained, "t", [1, 2])
    trained.shutdown()

    shard = Shard(0, 1, Storage(tmp_path, shard=0, num_shards=1), mode="serve")
    try:
        rows = lookup_rows(shard, "t", [2, 99, 1])
        np.testing.assert_array_equal(rows, np.stack([known[1], np.zeros(3, np.float32), known[0]]))
        t = shard.table("t")
        assert t.counters.rows_created == 0 and len(t) == 2  # 2 and 1 read back from disk, 99 not created
        with pytest.raises(WrongMode, match=r"Push refused: shard 0 is read-only \(mode=serve\)") as info:
            shard.push(push_request([("t", [1], np.ones((1, 3), np.float32))], "w", 1))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(WrongMode, match=r"CreateTable refused: .*mode=serve"):
            shard.create_table(TableSpec("u", 3))
        with pytest.raises(WrongMode, match=r"Checkpoint refused: .*mode=serve"):
            shard.checkpoint("c1")
        assert shard_stats(shard).mode == "serve" and t.counters.pushes == 0 and shard.specs() == [t.spec]
    finally:
        shard.shutdown()


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_serving_lookups_count_row_use_only_for_a_memory_budget(tmp_path: Path, budget: int) -> None:
    # Eviction ranks rows by their use; a serving shard with no budget evicts nothing and
    # leaves those counters alone (two fewer cache misses per row looked up).
    trained = Shard(0, 1, Storage(tmp_path, shard=0, num_shards=1))
    trained.create_table(TableSpec("t", 3, seed=4))
    known = lookup_rows(trained, "t", [1, 2])
    trained.shutdown()

    shard = Shard(0, 1, Storage(tmp_path, shard=0, num_shards=1), memory_budget_bytes=budget, mode="serve")
    try:
        lookup_rows(shard, "t", [1, 2])  # read back from disk into RAM
        ram = shard.table("t")._ram
        slots = ram.slots(np.array([1, 2]))
        before = ram.arena.frequency[slots].copy()
        np.testing.assert_array_equal(lookup_rows(shard, "t", [1, 2, 1]), known[[0, 1, 0]])
        expected = before + np.array([2, 1], np.uint32) if budget else before
        np.testing.assert_array_equal(ram.arena.frequency[slots], expected)
    finally:
        shard.shutdown()


def test_hit_rate_of_a_shard_without_storage_is_one() -> None:
    shard = Shard(0, 1)
    shard.create_table(TableSpec("t", 2))
    lookup_rows(shard, "t", [1, 2, 3, 3])  # new rows: neither hits nor misses
    (stats,) = shard_stats(shard).tables
    assert (stats.ram_hits, stats.ram_misses, stats.ram_hit_rate, stats.rows_created) == (0, 0, 1.0, 3)
    lookup_rows(shard, "t", [1, 2, 3, 4])
    (stats,) = shard_stats(shard).tables
    assert (stats.ram_hits, stats.ram_misses, stats.ram_hit_rate, stats.rows_created) == (3, 0, 1.0, 4)


def test_serving_default_initial_reads_the_row_training_would_create() -> None:
    spec = TableSpec("t", 4, seed=9, serving_default="initial")
    trained = Shard(0, 1)
    trained.create_table(spec)
    serving = Shard(0, 1, mode="serve")
    serving.install_table(spec)
    serving.install_table(TableSpec("z", 4, seed=9))  # the default: zeros
    rows = lookup_rows(serving, "t", [5, 6])
    np.testing.assert_array_equal(rows, lookup_rows(trained, "t", [5, 6]))  # the initializer's rows
    assert rows.any() and not lookup_rows(serving, "z", [5, 6]).any()
    t = serving.table("t")
    assert len(t) == 0 and t.counters.rows_created == 0 and t.counters.lookups_not_admitted == 0
    assert spec_from_proto(spec_to_proto(spec)) == spec


# -- Shard: keys it does not own, read-only callers ---------------------------------------


def test_shard_refuses_a_request_with_keys_it_does_not_own_before_applying_any() -> None:
    keys = np.arange(100, dtype=np.int64)
    owners = shard_of(keys, 3)
    mine, theirs = keys[owners == 1], keys[owners != 1]
    shard = Shard(1, 3)
    shard.create_table(TableSpec("a", 4))
    shard.create_table(TableSpec("b", 4))
    created = shard.changes.version  # each new table is a change (followers take its spec)
    mixed = np.concatenate([mine[:5], theirs[:7]])
    request = lookup_request(("a", mine.tolist(), 1), ("b", mixed.tolist(), 1))
    with pytest.raises(WrongShard) as info:
        lookup_response(shard, request, 1 << 20)
    first = int(theirs[0])
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and isinstance(info.value, ShardMismatch)
    assert info.value.owner == int(owners[first]) and info.value.trailing_metadata == (
        ("ps-wrong-shard", str(owners[first])),
        ("ps-map-epoch", "0"),
    )
    assert str(info.value) == (
        f"Lookup refused: key {first} (table 'b') belongs to shard {owners[first]} of 3, not shard 1; "
        f"7 of {mine.size + 12} keys in this request are not this shard's: route keys with "
        "protos.keys.shard_of and the cluster's address list"
    )
    assert len(shard.table("a")) == len(shard.table("b")) == 0 and shard.changes.version == created == 2
    grads = np.ones((mixed.size, 4), np.float32)
    with pytest.raises(WrongShard, match=r"Push refused: key \d+ \(table 'b'\) belongs to shard [02] of 3"):
        shard.push(push_request([("a", mine, np.ones((mine.size, 4), np.float32)), ("b", mixed, grads)], "w", 1))
    assert len(shard.table("a")) == 0 and shard.changes.version == created
    shard.push(push_request([("a", mine, np.ones((mine.size, 4), np.float32))], "w", 1))  # its own keys: fine
    assert len(shard.table("a")) == mine.size
    serving = Shard(1, 3, mode="serve")  # a serving shard (a follower holds its leader's index) checks the same
    serving.swap_tables({"a": shard.table("a")})
    with pytest.raises(WrongShard, match="belongs to shard"):
        lookup_response(serving, lookup_request(("a", theirs[:1].tolist(), 1)), 1 << 20)


def test_read_only_lookup_on_a_training_shard_creates_counts_and_records_nothing() -> None:
    shard = Shard(0, 1)
    shard.create_table(TableSpec("z", 4))
    shard.create_table(TableSpec("i", 4, serving_default="initial"))
    existing = lookup_rows(shard, "z", [1, 2])
    version, table = shard.changes.version, shard.table("z")
    request = lookup_request(("z", [1, 2, 3, 4], 1), ("i", [5], 1))
    z, i = wire.decode_lookup_response(lookup_response(shard, request, 1 << 20, read_only=True))
    rows = wire.decode_rows(z.rows, 4, 4, wire.FLOAT32, "z")
    np.testing.assert_array_equal(rows[:2], existing)
    assert not rows[2:].any()
    initial = Shard(0, 1)
    initial.create_table(TableSpec("i", 4, serving_default="initial"))
    np.testing.assert_array_equal(wire.decode_rows(i.rows, 1, 4, wire.FLOAT32, "i"), lookup_rows(initial, "i", [5]))
    assert (len(table), table.counters.rows_created, len(shard.table("i"))) == (2, 2, 0)
    assert shard.changes.version == version  # nothing for followers
    lookup_rows(shard, "z", [3])  # a writer's lookup still creates
    assert len(table) == 3 and shard.changes.version > version
