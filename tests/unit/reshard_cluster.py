"""In-process shards for live-reshard tests: ``deploy.scale`` driving real ``Shard``
objects whose new owners pull rows from old owners through ``Shard.move_rows`` (no
sockets), and the helpers those tests share."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import numpy as np
import numpy.typing as npt

from deploy.scale import RetryLater
from protos import ps_pb2 as pb
from protos.keys import shard_of
from ps.elastic import ClusterMap, ReshardSettings, Route
from ps.errors import Moving
from ps.shard import PushBatch, Shard
from ps.store import RowFormat, Rows, Storage
from ps.table import OptimizerKind, OptimizerParams, TableSpec

SGD = TableSpec("t", dim=4, seed=7, optimizer=OptimizerParams(OptimizerKind.SGD, lr=1.0))
ADAGRAD = TableSpec("a", dim=3, seed=9, optimizer=OptimizerParams(OptimizerKind.ADAGRAD, lr=0.5))
KEYS = np.arange(-600, 600, dtype=np.int64) * 7919


class Cluster:
    """In-process shards by address: ``deploy.scale``'s ``ShardCalls`` and the shards'
    ``MoveStream``."""

    def __init__(self) -> None:
        self.shards: dict[str, Shard] = {}
        self.closed = False
        self.reaches: dict[str, int] = {}  # an address that reaches another shard than its name says

    def add(self, index: int, num_shards: int, storage: Storage | None = None, **kwargs: object) -> Shard:
        resharding = ReshardSettings(self.stream, settle_s=0.5, identify=self.identify)
        shard = Shard(index, num_shards, storage, resharding=resharding, **kwargs)  # type: ignore[arg-type]
        shard.start()
        self.shards[f"s{index}"] = shard
        return shard

    def get_map(self, address: str) -> pb.GetMapResponse:
        return self._shard(address).get_map()

    def reshard(self, address: str, request: pb.ReshardRequest) -> pb.ReshardStatus:
        try:
            return self._shard(address).reshard_request(request)
        except Moving as exc:
            raise RetryLater(str(exc)) from None

    def identify(self, address: str) -> int | None:
        if address in self.reaches:
            return self.reaches[address]
        return self.shards[address].index if address in self.shards else None

    def _shard(self, address: str) -> Shard:
        if address not in self.shards:  # as a gRPC call to an address nobody listens on
            raise ConnectionError(f"{address}: no shard answers there")
        return self.shards[address]

    def stream(self, address: str, request: pb.MoveRowsRequest) -> Iterable[pb.MoveBatch]:
        to = ClusterMap.from_proto(request.to)
        return self.shards[address].move_rows(to, request.destination, lambda: not self.closed, 1 << 20)

    def close(self) -> None:
        self.closed = True
        for shard in self.shards.values():
            shard.shutdown()

    def addresses(self, n: int) -> list[str]:
        return [f"s{i}" for i in range(n)]


def running_cluster() -> Iterator[Cluster]:
    """A ``Cluster`` for one test (the ``cluster`` fixture of the test modules); closed after."""
    c = Cluster()
    yield c
    c.close()


def push(shard: Shard, table: str, keys: npt.NDArray[np.int64], grads: npt.NDArray[np.float32], **kw: object) -> None:
    batch = PushBatch([(table, keys, grads)], **kw)  # type: ignore[arg-type]
    shard.push(batch)


def routed(cluster: Cluster, n: int, epoch: int = 0) -> Route:
    return Route(num_shards=n, epoch=epoch)


def all_rows(shards: Iterable[Shard], table: str) -> Rows:
    parts = [s.table(table).export() for s in shards]
    rows = Rows.concat(parts, RowFormat(parts[0].dim, parts[0].state_width))
    return rows[np.argsort(rows.keys, kind="stable")]


def owners_ok(cluster: Cluster, n: int, table: str) -> None:
    """Every stored key sits on the shard that owns it under ``n`` shards, once."""
    seen: list[npt.NDArray[np.int64]] = []
    for i in range(n):
        keys = cluster.shards[f"s{i}"].table(table).export().keys
        assert (shard_of(keys, n) == i).all(), f"shard {i} holds keys of another shard"
        seen.append(keys)
    flat = np.concatenate(seen)
    assert np.unique(flat).shape == flat.shape, "a key is on two shards"


def wait_done(cluster: Cluster, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(s.reshard.move is not None and s.reshard.move.phase == "committed" for s in cluster.shards.values()):
        assert time.monotonic() < deadline, "old owners did not finish dropping the rows they gave away"
        time.sleep(0.02)


def seed_rows(cluster: Cluster, n: int, spec: TableSpec = ADAGRAD) -> None:
    """Create ``spec`` on the first ``n`` shards and push twice to every key of ``KEYS``."""
    rng = np.random.default_rng(3)
    owners = shard_of(KEYS, n)
    for i in range(n):
        shard = cluster.shards[f"s{i}"]
        shard.create_table(spec)
        mine = KEYS[owners == i]
        for seq in (1, 2):
            push(
                shard,
                spec.name,
                mine,
                rng.standard_normal((mine.size, spec.dim)).astype(np.float32),
                client_id="w",
                seq=seq,
            )


def growing_to_three(cluster: Cluster) -> tuple[Shard, ClusterMap]:
    """Two shards with table ``t`` seeded, a third started, and the move to three prepared on
    all: the new shard, and the map they move to."""
    for i in range(2):
        cluster.add(i, 2)
    seed_rows(cluster, 2, SGD)
    new = cluster.add(2, 3)
    src, dst = ClusterMap(0, 2, ("s0", "s1")), ClusterMap(1, 3, ("s0", "s1", "s2"))
    prepare = pb.ReshardRequest(phase=pb.ReshardRequest.PREPARE, to=dst.to_proto(), **{"from": src.to_proto()})
    for address in cluster.addresses(3):
        cluster.reshard(address, prepare)
    return new, dst
