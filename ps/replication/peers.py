"""A serving replica's peers: the other replicas of its serving shard, asked for their map.

A replica started after a live reshard (an autoscaler's, a replacement) follows its
training shard, but routes by the cluster map it started with, while the others switched
to a newer serving map (``ps-admin scale --serving-to``): clients route by that one and
skip this replica (it refuses with ``BehindMap``). Given ``--serving-peers`` (addresses,
or a ``dns:`` name such as its shard's headless Service), a ``PeerMaps`` thread asks
them for their map (``GetMap``) as the shard starts and every ``PEER_MAP_EVERY_S``, and
takes a newer one, as a ``Reshard`` COMMIT from ``ps-admin`` would. A peer that does not
answer is skipped; the replica asks itself too when its name lists it, which changes
nothing.

Example (a serving shard, see ``ps.service.server``):
    peers = PeerMaps(shard, ["dns:ps-serve-0.ml.svc:50051"]).start()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import grpc

from protos import ps_pb2 as pb
from protos.rpc.names import addresses_of, dns_name
from protos.rpc.tls import open_channel
from protos.services import PS_SERVICE
from ps.errors import ShardError

__all__ = ["PEER_MAP_EVERY_S", "MapHolder", "PeerMaps"]

log = logging.getLogger(__name__)

PEER_MAP_EVERY_S = 5.0
"""How often a serving replica asks its peers for their map."""


class MapHolder(Protocol):
    """The serving shard whose map ``PeerMaps`` keeps current (``ps.shard.Shard`` is one)."""

    index: int

    def get_map(self) -> pb.GetMapResponse: ...

    def reshard_request(self, request: pb.ReshardRequest) -> pb.ReshardStatus: ...


class PeerMaps:
    """Asks ``peers`` for their serving map and has ``shard`` route by a newer one (see the
    module docstring); ``credentials`` and ``metadata`` (a bearer token) as for ``--follow``."""

    def __init__(
        self,
        shard: MapHolder,
        peers: Sequence[str],
        *,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
        every_s: float = PEER_MAP_EVERY_S,
    ) -> None:
        self.shard, self.peers = shard, list(peers)
        self._credentials, self._metadata, self._every_s = credentials, metadata, every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.adopted = 0

    def start(self) -> PeerMaps:
        self._thread = threading.Thread(target=self._run, name=f"ps-shard{self.shard.index}-peers", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            try:
                self.check()
            except Exception:  # the next round tries again
                log.exception("asking the serving peers for their map failed")
            if self._stop.wait(self._every_s):
                return

    def check(self) -> bool:
        """Ask every peer once; True if this shard took a newer map from one."""
        for entry in self.peers:
            try:
                addresses = addresses_of(entry)
            except OSError:
                continue  # not resolvable now (no replica ready yet): next round
            name = dns_name(entry)  # a resolved address's TLS certificate carries the name
            for address in addresses:
                answer = self._get_map(address, None if name is None else name[0])
                if answer is None or not self._newer(answer.map):
                    continue
                try:
                    self.shard.reshard_request(pb.ReshardRequest(phase=pb.ReshardRequest.COMMIT, to=answer.map))
                except ShardError as exc:  # e.g. still dropping the rows of its last switch: next round
                    log.info("serving map of %s not taken yet: %s", address, exc)
                    continue
                self.adopted += 1
                log.info("took the serving map of peer %s (epoch %d)", address, answer.map.epoch)
                return True
        return False

    def _newer(self, theirs: pb.ClusterMap) -> bool:
        mine = self.shard.get_map().map
        return bool(theirs.epoch > mine.epoch and len(theirs.addresses) == theirs.num_shards)

    def _get_map(self, address: str, server_name: str | None) -> Any:
        options = (
            [] if server_name is None or self._credentials is None else [("grpc.ssl_target_name_override", server_name)]
        )
        with open_channel(address, self._credentials, options) as channel:
            call = channel.unary_unary(f"/{PS_SERVICE}/GetMap", None, pb.GetMapResponse.FromString)
            try:
                return call(pb.GetMapRequest().SerializeToString(), timeout=2.0, metadata=self._metadata)
            except grpc.RpcError:
                return None
