"""Workers come and go: epochs split anew from a resume point, worker checkpoints, and the
seqs a step pushes under (``worker.dataset.EpochPlan``, ``worker.resume``,
``DistributedEmbedding.forward(seq=)``).

The data split is checked on sample ids: a log whose labels are its row numbers, trained
by W workers up to a checkpoint and by W' from there, uses every row exactly once an
epoch. The seqs are read from the push requests the shards received.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import PSClient
from protos import ps_pb2 as pb
from ps.shard import Shard
from tests.fakes import InProcessTransport
from tests.unit.client_cluster import FAST, addresses
from worker import DistributedEmbedding, EmbeddingTableConfig, FeatureConfig, JaggedIds, dataset
from worker.config import TrainerConfig
from worker.data import ClickLog, ColumnSchema
from worker.dataset import EpochPlan, RunData, epoch_batches, micro_batches, open_data
from worker.distributed import Dist
from worker.resume import CheckpointDir, CheckpointError, Progress, resume
from worker.synthetic import synthetic_criteo


def _log(rows: int) -> ClickLog:
    """A log whose label of row i is i: a batch's labels are its sample ids."""
    return ClickLog(
        np.arange(rows, dtype=np.float32), np.zeros((rows, 1), np.float32), np.zeros((1, rows), np.int64), ("f",)
    )


def _ids_of_one_epoch(data: RunData, config: TrainerConfig, batch: int, worlds: list[int], steps: int) -> list[int]:
    """Sample ids trained in one epoch by a group of ``worlds[0]`` workers for ``steps`` steps
    (a checkpoint), then ``worlds[1]`` from there, then ``worlds[2]`` to the end. Every rank
    takes exactly the batches its ``EpochPlan`` names, in step order."""
    total = micro_batches(data.train_rows, batch)
    start, ids = 0, []
    for n, world in enumerate(worlds):
        last = n == len(worlds) - 1
        plans = [EpochPlan(total, start, world, r) for r in range(world)]
        runs = min(plans[0].steps, plans[0].steps if last else steps)
        for r, plan in enumerate(plans):
            it = epoch_batches(config, r, world, data, batch, 0, start=start)
            for j in range(runs):
                index = plan.index(j)
                if index is None:
                    continue
                b = next(it)
                ids += [int(x) for x in b.labels.tolist()]
        assert len({p.steps for p in plans}) == 1, "every rank takes the same number of steps"
        start = plans[0].position(runs - 1)
    return ids


@pytest.mark.parametrize("worlds", [[3, 2, 5], [1, 4, 1], [2, 2, 2], [4, 3, 7]])
def test_a_group_resumed_with_another_size_uses_every_sample_once_an_epoch(worlds: list[int]) -> None:
    rows, batch = 1000, 16  # 63 micro-batches, the last one short
    log = _log(rows)
    data = RunData("criteo", rows, 0, train=log, test=log, rows=log)
    ids = _ids_of_one_epoch(data, TrainerConfig(), batch, worlds, steps=4)
    assert sorted(ids) == list(range(rows)), "each sample exactly once"


def test_a_streamed_log_resumes_at_the_same_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ids.csv"
    path.write_text("".join(f"0,{i},c{i}\n" for i in range(300)))  # the row number as a dense value
    monkeypatch.setitem(
        dataset.SCHEMAS, "criteo", lambda: ColumnSchema("y", ["n"], ["c"], sep=",", names=["y", "n", "c"])
    )
    config = TrainerConfig(data=str(path))
    data = RunData("criteo", 300, 0, path=path)
    whole = list(epoch_batches(config, 0, 1, data, 32, 0))
    for start, world in [(0, 3), (4, 2), (7, 4)]:
        for r in range(world):
            got = list(epoch_batches(config, r, world, data, 32, 0, start=start))
            want = whole[start + r :: world]
            assert len(got) == len(want) and all(g.dense.equal(w.dense) for g, w in zip(got, want))


def test_synthetic_batches_resumed_on_any_group_are_those_of_one_worker() -> None:
    whole = list(synthetic_criteo(1100, 100, seed=5))
    for start, world in [(3, 2), (5, 4), (10, 3)]:
        for r in range(world):
            got = list(synthetic_criteo(1100, 100, seed=5, rank=r, world_size=world, start=start))
            want = whole[start + r :: world]
            assert len(got) == len(want) and all(g.labels.equal(w.labels) for g, w in zip(got, want))


@pytest.mark.parametrize("total,start,world", [(7, 0, 3), (7, 2, 2), (9, 9, 4), (1, 0, 5), (64, 13, 6)])
def test_an_epoch_plan_deals_every_micro_batch_once_and_numbers_it(total: int, start: int, world: int) -> None:
    plans = [EpochPlan(total, start, world, r, seq_base=100) for r in range(world)]
    steps = plans[0].steps
    dealt = [p.index(j) for j in range(steps) for p in plans]
    assert sorted(i for i in dealt if i is not None) == list(range(start, total))
    for j in range(steps):
        assert plans[0].active(j) == sum(p.index(j) is not None for p in plans)
    assert plans[0].position(steps - 1) == total if steps else start == total
    assert plans[0].seq(start) == 100 + start + 1


# --- checkpoints


def _progress(**kw: Any) -> dict[str, Any]:
    return {"progress": dataclasses.asdict(Progress("r", 32, 10, 2, **kw)), "fingerprint": {}}


def test_checkpoints_are_replaced_whole_and_the_newest_two_kept(tmp_path: Path) -> None:
    ckpts = CheckpointDir(tmp_path)
    for step in (0, 10, 20, 30):
        ckpts.save(_progress(steps=step), step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000000020.pt", "checkpoint-000000030.pt"]
    newest = ckpts.newest()
    assert newest is not None and newest["progress"]["steps"] == 30
    (tmp_path / "checkpoint-000000040.pt").write_bytes(b"torn")  # not ours: skipped, with a warning
    (tmp_path / ".checkpoint-000000050.pt.1.tmp").write_bytes(b"left by a writer that died")
    newest = ckpts.newest()
    assert newest is not None and newest["progress"]["steps"] == 30
    ckpts.save(_progress(steps=50), 50)
    assert not list(tmp_path.glob(".*.tmp"))
    assert CheckpointDir(tmp_path / "none").newest() is None
    (tmp_path / "file").write_text("")
    with pytest.raises(
        CheckpointError, match=r"--checkpoint-dir .*file: cannot write a checkpoint there \(File exists\)"
    ):
        CheckpointDir(tmp_path / "file").save(_progress(), 0)


def _resume(config: TrainerConfig, out: Path) -> tuple[Progress, dict[str, Any]]:
    return resume(config, Dist(), lambda b: micro_batches(1000, b), 64, 3, lambda c, p: out)


def test_a_run_keeps_its_id_across_restarts_and_refuses_another_configuration(tmp_path: Path) -> None:
    config = TrainerConfig(checkpoint_dir=tmp_path / "ckpt", train_samples=1000)
    first, dense = _resume(config, tmp_path / "out")
    assert dense == {} and (first.batch_size, first.micro_batches, first.epochs) == (64, 16, 3)
    written = CheckpointDir(tmp_path / "ckpt").newest()
    assert written is not None and written["pushed_through"] == 0, "the run id is written before anything is pushed"
    again, _ = resume(config, Dist(), lambda b: micro_batches(1000, b), 128, None, lambda c, p: tmp_path / "out")
    assert again.run_id == first.run_id and again.batch_size == 64 and again.epochs == 3  # the run's own
    with pytest.raises(CheckpointError, match=r"another run \(dim='16' there, '32' here\).*--checkpoint-dir"):
        _resume(dataclasses.replace(config, dim=32), tmp_path / "out")
    assert _resume(dataclasses.replace(config, mode="sync", checkpoint_every=7), tmp_path / "out")[0] == again
    fresh, _ = _resume(TrainerConfig(train_samples=1000), tmp_path / "out")  # no checkpoint dir: a new id each time
    assert fresh.run_id != first.run_id


def test_open_data_and_the_checkpoint_agree_on_the_batches_of_an_epoch(tmp_path: Path) -> None:
    config = TrainerConfig(checkpoint_dir=tmp_path, train_samples=1000)
    _resume(config, tmp_path / "out")
    changed = dataclasses.replace(config, train_samples=2000)
    with pytest.raises(CheckpointError, match="another run"):
        resume(changed, Dist(), lambda b: micro_batches(open_data(changed).train_rows, b), 64, 3, lambda c, p: tmp_path)


# --- seqs


@pytest.fixture
def cluster() -> Iterator[tuple[InProcessTransport, list[Shard]]]:
    shards = [Shard(i, 2) for i in range(2)]
    yield InProcessTransport(shards), shards


TABLES = [EmbeddingTableConfig("a", 4, "sgd", params={"lr": 0.5}), EmbeddingTableConfig("b", 2, "adagrad")]
FEATURES = [FeatureConfig("x", "a"), FeatureConfig("y", "b")]


def _batch(step: int) -> dict[str, JaggedIds]:
    y = [[]] * 3 if step % 3 == 0 else [[step], [], [step + 50]]  # every third step: no keys of table b
    return {"x": JaggedIds.from_lists([[step, 7], [step + 1], [100 + step]]), "y": JaggedIds.from_lists(y)}


def _train(emb: DistributedEmbedding, seqs: range) -> None:
    batches = {s: _batch(s) for s in seqs}
    for s in seqs:
        if s + 1 in batches:
            emb.prefetch(batches[s + 1])
        out = emb(batches[s], seq=s)
        (out["x"].sum() + out["y"].pow(2).sum()).backward()
    emb.flush()


def _pushed(transport: InProcessTransport, client_id: str) -> list[tuple[int, str, int]]:
    """``(shard, table, seq)`` of every push entry the shards received from ``client_id``."""
    out = []
    for shard, method, request in transport.calls:
        if method == "Push":
            r = pb.PushRequest.FromString(request)
            if r.client_id == client_id:
                out += [(shard, e.table, e.seq or r.seq) for e in r.entries]
    return out


@pytest.mark.parametrize("mode", ["sync", "pipelined"])
def test_each_step_pushes_every_table_under_its_seq_once(
    cluster: tuple[InProcessTransport, list[Shard]], mode: str
) -> None:
    transport, _ = cluster
    with PSClient(addresses(2), FAST, transport=transport, client_id="run/0") as client:
        emb = DistributedEmbedding(TABLES, FEATURES, client, mode=mode)  # type: ignore[arg-type]
        _train(emb, range(1, 8))
        freed = emb(_batch(8), seq=8)  # a step whose graph is freed without a backward
        del freed
        emb.push_nothing(9)  # a step without a batch
        emb.close()
    pushed = _pushed(transport, "run/0")
    assert sorted(pushed) == sorted((s, t, q) for s in range(2) for t in "ab" for q in range(1, 10))


def test_a_resumed_module_replays_steps_as_duplicates(cluster: tuple[InProcessTransport, list[Shard]]) -> None:
    transport, shards = cluster
    keys = np.arange(0, 200, dtype=np.int64)
    with PSClient(addresses(2), FAST, transport=transport, client_id="run/1") as client:
        first = DistributedEmbedding(TABLES, FEATURES, client, mode="pipelined")
        _train(first, range(1, 7))
        first.close()
        after = client.lookup("a", keys), client.lookup("b", keys)
    # A restarted process: a module of its own, the same client id, the steps from a checkpoint at 4.
    with PSClient(addresses(2), FAST, transport=transport, client_id="run/1") as client:
        again = DistributedEmbedding(TABLES, FEATURES, client, mode="pipelined")
        _train(again, range(4, 7))
        assert again.push_latency()["push_duplicates"] == 3 * 2  # 3 steps, each to 2 shards
        again.close()
        np.testing.assert_array_equal(client.lookup("a", keys), after[0])
        np.testing.assert_array_equal(client.lookup("b", keys), after[1])
    assert sum(s.duplicate_pushes() for s in shards) == 3 * 2 * 2  # and per table
