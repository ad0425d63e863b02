"""``Shard`` checkpoints and restarts on a real RocksDB: a shard without storage, version
numbering, refused paths, lifecycle specs kept across a reopen. Helpers and the fake
recency clock are those of ``test_tier.py``."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt
import pytest

import ps.shard.budget
import ps.table.table
from protos import ps_pb2 as pb
from ps.durability import Durability, copy_checkpoint
from ps.errors import TableExists
from ps.shard import Shard
from ps.store import RowFormat, Storage, read_manifest
from ps.table import Lifecycle, OptimizerKind, OptimizerParams, TableSpec, spec_from_proto
from ps.table.ledger import PushLedger
from tests.fakes import push_request
from tests.unit.test_tier import I64, SGD, Clock, assert_same_bits, grads_for, keys_of


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    for module in (ps.table.table, ps.shard.budget):
        monkeypatch.setattr(module, "now_tick", c)
    return c


# -- Shard: checkpoints and restarts ----------------------------------------------------------


def make_tables(shard: Shard) -> dict[str, npt.NDArray[np.int64]]:
    shard.create_table(TableSpec("a", 3, seed=1))
    shard.create_table(
        TableSpec(
            "b",
            4,
            optimizer=OptimizerParams(OptimizerKind.ADAM),
            seed=2,
            lifecycle=Lifecycle(ttl_seconds=60.0, evict_below_frequency=2),
        )
    )
    keys = {"a": keys_of(1, 2, I64.min), "b": keys_of(-5, 6, I64.max, 8)}
    for seq, name in enumerate(("a", "b", "a"), start=1):
        t = shard.table(name)
        t.lookup(keys[name])
        shard.push(push_request([(name, keys[name], grads_for(keys[name], t.dim, seed=seq))], "w", seq))
    return keys


def test_checkpoint_of_a_shard_without_storage_opens_read_only(tmp_path: Path, clock: Clock) -> None:
    shard = Shard(0, 1, checkpoint_root=tmp_path)
    keys = make_tables(shard)
    path, manifest = shard.checkpoint(tmp_path / "ck")
    assert path == tmp_path / "ck" / "shard-00000-of-00001" and not (path / "ps.lock").exists()
    assert manifest["rows"] == {"a": 3, "b": 4} and read_manifest(path)["rows"] == {"a": 3, "b": 4}
    assert manifest["rows_estimated"] == {"a": False, "b": False}
    assert len(shard.lineage) == 32 and manifest["lineage"] == shard.lineage
    with Storage(path, shard=0, num_shards=1, read_only=True) as ro:
        specs = {name: spec_from_proto(pb.TableSpec.FromString(blob)) for name, blob in ro.specs().items()}
        assert specs == {"a": shard.table("a").spec, "b": shard.table("b").spec}
        for name in ("a", "b"):
            t = shard.table(name)
            rows = ro.table(name, t.spec.row_format)
            found, rec = rows.get(keys[name])
            assert found.all()
            exported = t.export()
            exported = exported[np.argsort(exported.keys)]
            want = exported[np.searchsorted(exported.keys, keys[name])]
            assert_same_bits(rec.values, want.values)
            assert_same_bits(rec.state, want.state)
            assert sorted(r for r in rows.ledgers()) == ["w"]
        ledger_a = ro.table("a", RowFormat(3, 0)).ledgers()["w"]
        assert PushLedger.decode(ledger_a) == (1, [(3, 3)])  # a got seqs 1 and 3; 2 went to b
    # and a shard restored from it has the rows and refuses the same pushes again
    copy_checkpoint(path, tmp_path / "restored")
    restored = Shard(0, 1, Storage(tmp_path / "restored", shard=0, num_shards=1))
    try:
        assert restored.lineage == shard.lineage, "the checkpoint's data dir carries the shard's lineage"
        for name in ("a", "b"):
            assert_same_bits(restored.table(name).lookup(keys[name]), shard.table(name).lookup(keys[name]))
        t = restored.table("a")
        assert restored.push(push_request([("a", keys["a"], grads_for(keys["a"], 3))], "w", 3)) == (False, 0)
    finally:
        restored.shutdown()


def test_checkpoint_with_storage_flushes_and_numbers_versions(tmp_path: Path, clock: Clock) -> None:
    shard = Shard(0, 1, Storage(tmp_path / "data", shard=0, num_shards=1), Durability.parse("checkpoint-only"))
    try:
        keys = make_tables(shard)
        shard.table("a").evict(1, clock.advance(1))  # one row only on disk
        p1, m1 = shard.checkpoint()
        p2, _ = shard.checkpoint()
        assert (p1.parent.name, p2.parent.name) == ("000001", "000002") and p1.name == "shard-00000-of-00001"
        assert p1.parent.parent == tmp_path / "data" / "checkpoints"
        assert m1["rows"] == {"a": 3, "b": 4} and m1["shard"] == 0 and m1["num_shards"] == 1
        with Storage(p1, shard=0, num_shards=1, read_only=True) as ro:
            for name in ("a", "b"):
                t = shard.table(name)
                found, rec = ro.table(name, t.spec.row_format).get(keys[name])
                assert found.all()
                assert_same_bits(rec.values, t.lookup(keys[name], create=False))
    finally:
        shard.shutdown()


@pytest.mark.parametrize("with_storage", [True, False])
def test_checkpoint_to_an_existing_path_is_refused_without_failing_the_shard(
    tmp_path: Path, with_storage: bool
) -> None:
    st = Storage(tmp_path / "data", shard=0, num_shards=1) if with_storage else None
    shard = Shard(0, 1, st, checkpoint_root=tmp_path)
    try:
        shard.create_table(SGD)
        (tmp_path / "ck" / "shard-00000-of-00001").mkdir(parents=True)  # this shard's part of "ck"
        with pytest.raises(Exception, match="exists") as info:
            shard.checkpoint(tmp_path / "ck")
        # an operator's mistake: the shard keeps taking pushes, and clients must not retry it
        assert shard.writable
        assert getattr(info.value, "code", None) != grpc.StatusCode.UNAVAILABLE
    finally:
        shard.shutdown()


def test_reopened_shard_keeps_lifecycle_specs(tmp_path: Path) -> None:
    spec = TableSpec(
        "t", 4, lifecycle=Lifecycle(admit_after=2, admit_probability=0.5, ttl_seconds=3.5, evict_below_frequency=4)
    )
    first = Shard(0, 1, Storage(tmp_path, shard=0, num_shards=1))
    first.create_table(spec)
    first.shutdown()
    again = Shard(0, 1, Storage(tmp_path, shard=0, num_shards=1))
    try:
        assert again.table("t").spec == spec
        assert again.create_table(spec) is False
        with pytest.raises(TableExists, match=r"lifecycle\.ttl_seconds: 3\.5 != 4\.0"):
            again.create_table(
                TableSpec(
                    "t",
                    4,
                    lifecycle=Lifecycle(admit_after=2, admit_probability=0.5, ttl_seconds=4.0, evict_below_frequency=4),
                )
            )
    finally:
        again.shutdown()
