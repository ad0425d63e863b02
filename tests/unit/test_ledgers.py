"""``TableLedgers``: the push records a new owner keeps apart after a reshard, and when
they merge back."""

from __future__ import annotations

from ps.table.ledger import PushLedger, TableLedgers


def record(ledger: PushLedger, client: str, *seqs: int) -> None:
    for seq in seqs:
        with ledger.claim(client, seq):
            pass


def test_records_stay_apart_while_a_client_left_a_push_half_applied() -> None:
    ledgers = TableLedgers()
    ledgers.import_moved(0, {"w": PushLedger.pack(10, [])})
    ledgers.import_moved(1, {"w": PushLedger.pack(9, [])})  # push 10 never reached shard 1
    ledgers.activate(native_keys=False, since=0.0)
    assert ledgers.applied("w", 10, 0) and not ledgers.applied("w", 10, 1)
    assert ledgers.pending(now=100.0, settle_s=10.0) == 1 and not ledgers.collapse(100.0, 10.0)
    record(ledgers.group(1), "w", 10)  # the retry of its part planned for shard 1
    assert ledgers.collapse(100.0, 10.0) and not ledgers.active
    assert ledgers.main.entry("w") == (10, []) and ledgers.pending(now=100.0, settle_s=10.0) == 0


def test_records_stay_apart_for_the_settle_time_even_when_they_agree() -> None:
    # A push from before the reshard, applied nowhere yet, may still come in parts (one per
    # shard it was planned for): until clients stopped retrying, the records stay apart.
    ledgers = TableLedgers()
    ledgers.import_moved(0, {"w": PushLedger.pack(10, [])})
    ledgers.import_moved(1, {"w": PushLedger.pack(10, [])})
    ledgers.activate(native_keys=False, since=1000.0)
    assert ledgers.pending(now=1005.0, settle_s=10.0) == 1 and not ledgers.collapse(1005.0, 10.0)
    assert ledgers.collapse(1011.0, 10.0)


def test_a_push_planned_after_the_reshard_counts_for_every_group() -> None:
    ledgers = TableLedgers()
    ledgers.import_moved(0, {"w": PushLedger.pack(10, [])})
    ledgers.activate(native_keys=True, since=0.0)
    record(ledgers.main, "w", *range(1, 11))
    assert ledgers.post is not None
    record(ledgers.post, "w", 11, 12)
    assert all(ledgers.applied("w", s, o) for s in (11, 12) for o in (None, 0))
    assert not ledgers.applied("w", 13, 0)
    stored = dict(ledgers.take_changed())
    assert "\0post\0w" in stored and "\0" + "0\0w" in stored
    assert ledgers.collapse(1.0, 0.0)
    gone = dict(ledgers.take_changed())
    assert gone["\0post\0w"] == b"" and gone["\0" + "0\0w"] == b"" and PushLedger.decode(gone["w"]) == (12, [])
