"""A shard's place in its cluster: the map it routes by, and a reshard it takes part in.

The *cluster map* is the cluster's shard count, its shard addresses in order and an
*epoch*, which every reshard moves one on: epoch 0 is the cluster the shards were
started as (``--num-shards``; the shards do not know its addresses, clients do). Keys
belong to ``protos.keys.shard_of(key, num_shards)`` of the map; jump hash moves only
the keys whose owner changes (about ``|M - N| / max(M, N)`` of them).

A *reshard* from map ``src`` to map ``dst`` (``ps.elastic.reshard``) goes through phases that
every shard of both maps records here, in its data dir, before it acts on them:

* ``copying``: new owners pull the keys that move to them from their old owners
  (``MoveRows``) while pushes go on;
* ``frozen``: an old owner refuses pushes to its moving keys and sends their last
  changes and push ledgers; a new owner has made every row it got durable;
* ``committed``: the shard routes by ``dst``; an old owner drops the rows it no longer
  owns (``done`` once dropped).

A shard restarted in any phase comes back in it: a frozen old owner stays frozen until
``ps-admin scale`` commits or aborts the reshard.

Example:
    >>> m = ClusterMap(0, 4)
    >>> m.owns(np.array([1, 2, 3]), 0).tolist()
    [True, False, True]
    >>> ClusterMap.from_json(ClusterMap(1, 3, ("a:1", "b:1", "c:1")).to_json())
    ClusterMap(epoch=1, num_shards=3, addresses=('a:1', 'b:1', 'c:1'))
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos.keys import shard_of
from ps.errors import InvalidRequest

__all__ = ["PHASES", "ClusterMap", "MoveState", "Phase", "Route"]

Phase = Literal["copying", "frozen", "committed", "done"]
PHASES: tuple[Phase, ...] = ("copying", "frozen", "committed", "done")


@dataclass(frozen=True)
class Route:
    """Where a client sent a request: the cluster size it planned with (0: not checked),
    the shard it meant (None: not checked), and the epoch of its cluster map."""

    num_shards: int = 0
    shard: int | None = None
    epoch: int = 0


@dataclass(frozen=True)
class ClusterMap:
    """The shards of a cluster in order, at one epoch (see the module docstring)."""

    epoch: int
    num_shards: int
    addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.epoch < 0 or self.num_shards < 1:
            raise InvalidRequest(f"cluster map: epoch {self.epoch}, num_shards {self.num_shards}: need >= 0 and >= 1")
        if self.addresses and len(self.addresses) != self.num_shards:
            raise InvalidRequest(
                f"cluster map: {len(self.addresses)} addresses for {self.num_shards} shards: give one per shard"
            )

    def owners(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        """The shard of each key under this map."""
        return shard_of(keys, self.num_shards)

    def owns(self, keys: npt.NDArray[np.int64], index: int) -> npt.NDArray[np.bool_]:
        """Which of ``keys`` shard ``index`` owns under this map."""
        if index >= self.num_shards:
            return np.zeros(keys.shape[0], np.bool_)
        owned: npt.NDArray[np.bool_] = self.owners(keys) == index
        return owned

    def to_proto(self) -> pb.ClusterMap:
        return pb.ClusterMap(epoch=self.epoch, num_shards=self.num_shards, addresses=list(self.addresses))

    @classmethod
    def from_proto(cls, message: pb.ClusterMap, field_name: str = "map") -> ClusterMap:
        try:
            return cls(int(message.epoch), int(message.num_shards), tuple(message.addresses))
        except InvalidRequest as exc:
            raise InvalidRequest(f"{field_name}: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "num_shards": self.num_shards, "addresses": list(self.addresses)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterMap:
        return cls(int(data["epoch"]), int(data["num_shards"]), tuple(data.get("addresses", ())))

    def describe(self) -> str:
        where = f" ({', '.join(self.addresses)})" if self.addresses else ""
        return f"epoch {self.epoch}: {self.num_shards} shards{where}"


@dataclass
class MoveState:
    """What shard ``index`` recorded of a reshard from ``src`` to ``dst``: its ``phase``,
    and (as a new owner) the old owners whose rows arrived whole and are durable here.
    ``committed_unix_s``: when it committed here; ``settled``: the push ledgers it kept
    apart for the keys that came (``ps.table.ledger.TableLedgers``) merged back since;
    ``max_rows_per_s``: the pace of each copy (0: as fast as it goes)."""

    index: int
    src: ClusterMap
    dst: ClusterMap
    phase: Phase = "copying"
    complete: set[int] = field(default_factory=set)
    committed_unix_s: float = 0.0
    settled: bool = False  # a new owner's push ledgers merged back after the commit
    max_rows_per_s: float = 0.0  # per copy, 0: no limit

    @property
    def sources(self) -> list[int]:
        """The old owners of keys that move to this shard (none if it gains no keys)."""
        if self.index >= self.dst.num_shards:
            return []
        if self.dst.num_shards > self.src.num_shards:  # growing: new shards take keys from every old one
            return list(range(self.src.num_shards)) if self.index >= self.src.num_shards else []
        # Shrinking: the shards that go hand their keys to the ones that stay.
        return list(range(self.dst.num_shards, self.src.num_shards))

    @property
    def is_source(self) -> bool:
        """Whether some keys of this shard move to another one."""
        if self.index >= self.src.num_shards:
            return False
        return self.dst.num_shards > self.src.num_shards or self.index >= self.dst.num_shards

    def moving(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """Which of ``keys`` (this shard's under ``src``) have another owner under ``dst``."""
        return ~self.dst.owns(keys, self.index)

    def to_json(self) -> str:
        return json.dumps(
            {
                "index": self.index,
                "src": self.src.to_json(),
                "dst": self.dst.to_json(),
                "phase": self.phase,
                "complete": sorted(self.complete),
                "committed_unix_s": self.committed_unix_s,
                "settled": self.settled,
                "max_rows_per_s": self.max_rows_per_s,
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> MoveState:
        data = json.loads(raw)
        phase = data["phase"]
        if phase not in PHASES:
            raise ValueError(f"reshard phase {phase!r}: expected one of {', '.join(PHASES)}")
        return cls(
            int(data["index"]),
            ClusterMap.from_json(data["src"]),
            ClusterMap.from_json(data["dst"]),
            phase,
            set(int(i) for i in data.get("complete", ())),
            float(data.get("committed_unix_s", 0.0)),
            bool(data.get("settled", False)),
            float(data.get("max_rows_per_s", 0.0)),
        )
