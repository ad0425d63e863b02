"""ps.shard: the exactly-once ``PushLedger`` and the ``Shard``'s tables and request checks."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from ps.config import TableSpec
from ps.errors import InvalidRequest, ShardMismatch, ShuttingDown, TableExists, UnknownTable, WrongMode
from ps.initializers import InitializerParams
from ps.optimizers import OptimizerKind, OptimizerParams
from ps.shard import PushLedger, Shard


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


def test_shard_index_must_be_in_range() -> None:
    with pytest.raises(ValueError, match=r"shard=2: not in \[0, num_shards=2\)"):
        Shard(2, 2)
    with pytest.raises(ValueError):
        Shard(-1, 2)


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
        "t", 8,
        initializer=InitializerParams(low=-1.0),
        optimizer=OptimizerParams(OptimizerKind.ADAGRAD, lr=0.5),
        seed=3,
    )  # fmt: skip

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
    shard.check_request(3, 1)
    shard.check_request(3)
    shard.check_request(0)  # 0 and None skip the checks


def test_check_request_rejects_wrong_cluster_size() -> None:
    shard = Shard(1, 3)
    with pytest.raises(ShardMismatch, match=r"num_shards=2.*cluster of 3") as info:
        shard.check_request(2, 1)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_check_request_rejects_wrong_shard() -> None:
    shard = Shard(1, 3)
    with pytest.raises(ShardMismatch, match=r"request for shard 2 reached shard 1"):
        shard.check_request(3, 2)
    with pytest.raises(ShardMismatch):
        shard.check_request(0, 0)


def test_closed_shard_refuses_requests() -> None:
    shard = Shard(0, 2)
    shard.close()
    with pytest.raises(ShuttingDown, match="shard 0 is shutting down") as info:
        shard.check_request(2, 0)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_serving_shard_is_not_writable() -> None:
    shard = Shard(0, 1)
    shard.check_writable()
    shard.mode = "serve"
    with pytest.raises(WrongMode, match=r"read-only \(mode=serve\)") as info:
        shard.check_writable()
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_check_table_field_rejects_empty_name() -> None:
    Shard.check_table_field("t", "entries[0].table")
    with pytest.raises(InvalidRequest, match=r"entries\[3\]\.table: table name is empty"):
        Shard.check_table_field("", "entries[3].table")
