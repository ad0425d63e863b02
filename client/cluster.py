"""The cluster as a client routes by it, and how that changes when the cluster does.

A ``ClusterView`` is one consistent picture: the epoch of the cluster map, each shard's
addresses, the replicas' health and the transport that reaches them. A call plans its
keys with one view and sends them with that same view, whatever another thread does
meanwhile. When a shard refuses keys because the cluster moved to a newer map (a live
reshard, ``ps-admin scale``), the client asks that shard for the map (``GetMap``) and
swaps in a new view (``ClusterViews.update``); calls then route again by it.

Example:
    >>> views = ClusterViews([["127.0.0.1:1"], ["127.0.0.1:2"]], ClientConfig(), connect=lambda a: _Nowhere(a))
    >>> views.current.num_shards, views.current.epoch
    (2, 0)
    >>> views.update(1, ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]).num_shards
    3
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from client.config import ClientConfig
from client.errors import PreconditionError
from client.replicas import Change, ReplicaSet, placeholder
from client.transport import Call, Transport

__all__ = ["ClusterView", "ClusterViews", "Connect"]

Connect = Callable[[list[str]], Transport]
"""Makes a transport to a list of endpoint addresses (a new view's)."""


@dataclass(frozen=True)
class ClusterView:
    """The cluster at one cluster-map ``epoch`` (see the module docstring). Its shards'
    replicas may change (``set_members``); its shards do not."""

    epoch: int
    replica_set: ReplicaSet
    transport: Transport
    entries: tuple[tuple[str, ...], ...]  # each shard's replicas as named (``dns:`` names unresolved)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def replicas(self) -> tuple[tuple[str, ...], ...]:
        """Each shard's member addresses."""
        return tuple(self.replica_set.members())

    @property
    def num_shards(self) -> int:
        return self.replica_set.num_shards

    @property
    def addresses(self) -> list[str]:
        """Every member's address, shard by shard (those of replicas that left are not)."""
        return self.replica_set.addresses

    def address(self, endpoint: int) -> str:
        return self.replica_set.address(endpoint)

    def set_members(
        self,
        shard: int,
        addresses: Sequence[str],
        *,
        admit: bool = False,
        server_names: Mapping[str, str] | None = None,
    ) -> Change:
        """``ReplicaSet.set_members``, with a channel for each replica new to the transport
        (``server_names``: the TLS name of a resolved address). Raises ``PreconditionError``
        when the transport cannot reach new addresses (it has no ``add``)."""
        with self._lock:
            if not self.transport.grows and any(a not in self.replica_set.all_addresses for a in addresses):
                raise PreconditionError(
                    f"shard {shard}: new replicas {', '.join(addresses)}, which this client's transport cannot reach"
                )
            change = self.replica_set.set_members(shard, addresses, admit=admit)
            for endpoint in change.joined:
                address = self.replica_set.address(endpoint)
                if self.transport.add(address, (server_names or {}).get(address)) != endpoint:
                    raise RuntimeError(f"shard {shard}: {address} numbered apart by the transport and the replicas")
            return change


class ClusterViews:
    """The client's current ``ClusterView`` and the ones it replaced (their transports
    close with the client: calls may still use them). ``replicas``: each shard's entries
    (addresses, or ``dns:`` names: their view starts with ``placeholder``s). Thread-safe."""

    def __init__(
        self,
        replicas: Sequence[Sequence[str]],
        config: ClientConfig,
        *,
        connect: Connect,
        transport: Transport | None = None,
    ) -> None:
        self._config, self._connect = config, connect
        self._lock = threading.Lock()
        self._started = False
        self._retired: list[Transport] = []
        self.current = self._view(0, replicas, transport)

    def _view(self, epoch: int, entries: Sequence[Sequence[str]], transport: Transport | None) -> ClusterView:
        c = self._config
        replica_set = ReplicaSet(
            [[placeholder(e) for e in shard] for shard in entries],
            eject_after_failures=c.eject_after_failures,
            eject_s=c.eject_s,
            eject_max_s=c.eject_max_s,
        )
        transport = transport if transport is not None else self._connect(replica_set.all_addresses)
        return ClusterView(epoch, replica_set, transport, tuple(tuple(shard) for shard in entries))

    def start(self) -> None:
        with self._lock:
            self.current.transport.start()
            self._started = True

    def close(self) -> None:
        with self._lock:
            for transport in [self.current.transport, *self._retired]:
                transport.close()
            self._retired.clear()
            self._started = False

    def update(self, epoch: int, addresses: Sequence[str]) -> ClusterView:
        """The view of the cluster map ``epoch`` with a shard at each of ``addresses`` (its
        replicas joined by ``+``; a ``dns:`` entry stands for what its name resolves to, see
        ``client.membership``), made current unless a newer one is; returns the current."""
        with self._lock:
            if epoch <= self.current.epoch:
                return self.current
            view = self._view(epoch, [a.split("+") for a in addresses], None)
            view.replica_set.refused_before = self.current.replica_set.refusals()
            if self._started:
                view.transport.start()
            self._retired.append(self.current.transport)
            self.current = view
            return view


class _Nowhere:
    """A transport that reaches nothing (for the module's example)."""

    def __init__(self, addresses: list[str]) -> None:
        self._addresses = addresses

    def start(self) -> None: ...

    def close(self) -> None: ...

    def address(self, endpoint: int) -> str:
        return self._addresses[endpoint]

    def call(self, endpoint: int, method: str, request: bytes, timeout_s: float) -> Call:
        raise ConnectionError(f"{self._addresses[endpoint]}: reaches nothing")
