"""A client's link to one cluster: the cluster map it routes by, followed as the cluster
moves, and the calls that reach its shards.

``PSClient`` (lookups and pushes) and ``AdminClient`` (tables, stats, checkpoints) each
talk to the cluster through one ``ClusterLink``, and may share it. The link learns the
cluster map once before it routes anything (``current``: a client given the addresses of a
cluster that resharded since routes by the new map from its first call), follows a shard
that refuses keys under a newer map (``follow``), and re-reads a watched addresses file or
DNS name (``client.membership``). ``routed`` is the one loop that sends a call again when
the map moved under it.

Thread-safe; the constructor does no I/O (``start`` opens the channels).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError

from client.cluster import ClusterView, ClusterViews
from client.config import ClientConfig, TableConfig
from client.errors import InternalServerError, InvalidRequestError, PreconditionError, PSError
from client.membership import Members, MembershipWatcher
from client.retry import Answer, Rerouted, call_all
from client.tables import table_config
from client.transport import GrpcTransport, Transport
from protos import ps_pb2 as pb
from protos import wire

__all__ = ["Budget", "ClusterLink", "MAX_MAP_CHANGES"]

log = logging.getLogger(__name__)

Budget = tuple[ClientConfig, float]
"""A call's config and its deadline (``time.monotonic()``)."""

MAX_MAP_CHANGES = 8
"""Times the cluster map may change during one call before it gives up."""

_TRANSPORT_METHODS = (
    *("start", "close", "address", "call", "call_here", "tls", "client_certificate", "grows"),
    *("add", "drop", "check", "for_addresses"),
)
_WRITES = frozenset({"CreateTable", "Push", "Checkpoint", "LoadCheckpoint", "Publish", "Erase"})
_READS = frozenset({"Lookup", "ListTables"})  # may be hedged
_NO_MAP = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""GetMap failures a first call goes on past: a shard older than maps (epoch 0), or one not there."""
T = TypeVar("T")


class ClusterLink:
    """The link to the cluster of ``members`` (see the module docstring), over ``transport``
    (a test's in-process one; by default gRPC channels with ``config``'s TLS and token)."""

    def __init__(self, members: Members, config: ClientConfig, *, transport: Transport | None = None) -> None:
        if transport is not None:
            missing = [m for m in _TRANSPORT_METHODS if not hasattr(transport, m)]
            if missing:  # one that matches by shape alone must have them all
                raise TypeError(
                    f"transport {type(transport).__name__} lacks {', '.join(missing)}: subclass client.Transport, "
                    "whose defaults fill them"
                )
        self.config = config
        security = None
        if transport is None:
            security = config.caller_security()

        def connect(endpoints: list[str]) -> Transport:
            # A transport is addressed by endpoint: the index into a view's ``addresses``.
            if security is not None:
                return GrpcTransport(
                    endpoints,
                    config.max_message_bytes,
                    reconnect_max_s=config.backoff_max_s,
                    credentials=security.credentials,
                    metadata=security.metadata,
                    client_certificate=security.client_certificate,
                )
            assert transport is not None
            try:
                return transport.for_addresses(endpoints)
            except NotImplementedError as exc:
                raise PreconditionError(
                    f"the cluster moved to a new map, which this client cannot reach: {exc}"
                ) from None

        self._views = ClusterViews(members.spec, config, connect=connect, transport=transport)
        self._watcher = MembershipWatcher(self._views, members, config.membership_refresh_s)
        self._mapped = False  # whether the cluster map was asked for (``current``)
        self._lock = threading.Lock()
        self._started = False

    @property
    def view(self) -> ClusterView:
        """The cluster as routed now."""
        return self._views.current

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Open the channels (idempotent)."""
        with self._lock:
            if not self._started:
                self._views.start()
                self._watcher.start_if_needed()
                self._started = True

    def close(self) -> None:
        """Close the channels and stop watching the addresses."""
        with self._lock:
            self._watcher.close()
            if self._started:
                self._views.close()
                self._started = False

    # -- the cluster map ------------------------------------------------------------
    def budget(self, deadline_s: float | None = None, config: ClientConfig | None = None) -> Budget:
        """The config of a call (with its own ``deadline_s``, if given) and its deadline."""
        config = config or self.config
        if deadline_s is not None:
            if not (isinstance(deadline_s, int | float) and math.isfinite(deadline_s) and deadline_s > 0):
                raise InvalidRequestError(f"deadline_s={deadline_s!r}: must be a positive number of seconds")
            # An attempt limit that only followed the config's deadline follows this one.
            follows = config.attempt_timeout_s == config.deadline_s
            config = dataclasses.replace(
                config, deadline_s=deadline_s, attempt_timeout_s=None if follows else config.attempt_timeout_s
            )
        return config, time.monotonic() + config.deadline_s

    def current(self, budget: Budget) -> ClusterView:
        """The view calls route by. The first asks shard 0 for the cluster map (``GetMap``,
        once): a client given the addresses of a cluster that resharded since learns its
        epoch, or its new addresses, before it routes anything. If shard 0 does not answer,
        the call goes on with the addresses given; a shard that moved to a newer map refuses
        keys naming its epoch, and ``follow`` learns it then."""
        if not self._mapped:
            view = self._views.current
            once = (dataclasses.replace(budget[0], max_attempts=1), min(budget[1], time.monotonic() + 5.0))
            try:
                (answer,) = self.call("GetMap", [(0, b"")], budget=once, view=view)
            except PSError as exc:
                if exc.code not in _NO_MAP:
                    raise
            else:
                with self.reply("GetMap", 0, answer.endpoint, view):
                    reply = pb.GetMapResponse.FromString(answer.data)
                if reply.map.epoch > view.epoch and len(reply.map.addresses) == reply.map.num_shards:
                    self._views.update(reply.map.epoch, list(reply.map.addresses))
                    self._watcher.start_if_needed()
            self._mapped = True
        return self._views.current

    def refresh(self, budget: Budget) -> int:
        """Ask shard 0 for the cluster map now and route by it if it is newer; the epoch."""
        self._mapped = False
        return self.current(budget).epoch

    def follow(self, view: ClusterView, moved: Rerouted, budget: Budget) -> ClusterView:
        """The view of the map a shard refused a request for (a newer one than ``view``'s):
        asked of that shard (``GetMap``) and made current."""
        (answer,) = self.call("GetMap", [(moved.shard, b"")], budget=budget, pinned=[moved.endpoint], view=view)
        with self.reply("GetMap", moved.shard, answer.endpoint, view):
            reply = pb.GetMapResponse.FromString(answer.data)
        if reply.map.epoch <= view.epoch or len(reply.map.addresses) != reply.map.num_shards:
            raise InternalServerError(
                f"shard {moved.shard} ({view.address(moved.endpoint)}): refused keys under a newer cluster map "
                f"(epoch {moved.epoch}) but answers GetMap with epoch {reply.map.epoch}"
            )
        current = self._views.update(reply.map.epoch, list(reply.map.addresses))
        if current.epoch == reply.map.epoch and current is not view:
            log.info("the cluster moved to epoch %d: %s", current.epoch, ", ".join(current.addresses))
            self._watcher.start_if_needed()
        return current

    def routed(self, method: str, budget: Budget, attempt: Callable[[ClusterView], T | Rerouted]) -> T:
        """``attempt(view)`` under the current map, and again under the new one each time it
        comes back ``Rerouted`` (a shard refused keys under a newer map): the one place a
        call is routed again when the cluster moved. Raises ``PreconditionError`` after
        ``MAX_MAP_CHANGES`` moves during one call."""
        view = self.current(budget)
        for _ in range(MAX_MAP_CHANGES):
            result = attempt(view)
            if not isinstance(result, Rerouted):
                return result
            view = self.follow(view, result, budget)
        raise PreconditionError(f"{method}: the cluster map changed {MAX_MAP_CHANGES} times during one call")

    # -- calls ----------------------------------------------------------------------
    def call(
        self,
        method: str,
        requests: list[tuple[int, bytes]],
        *,
        budget: Budget | None = None,
        pinned: Sequence[int] | None = None,
        view: ClusterView | None = None,
    ) -> list[Answer]:
        """``send``, keeping the answers (for methods no shard refuses as rerouted)."""
        return [a for a in self.send(method, requests, budget, pinned=pinned, view=view) if isinstance(a, Answer)]

    def send(
        self,
        method: str,
        requests: list[tuple[int, bytes]],
        budget: Budget | None,
        *,
        pinned: Sequence[int] | None = None,
        degrade: bool = False,
        view: ClusterView | None = None,
    ) -> list[Answer | Rerouted | None]:
        """``call_all`` over ``view`` (the current one by default). Lookups and pushes come
        back ``Rerouted`` where a shard refused keys under a newer cluster map. A write to a
        shard with several replicas raises ``InvalidRequestError`` before any call."""
        if not self._started:
            self.start()
        view = view or self._views.current
        if method in _WRITES and pinned is None:  # pinned: the caller named each replica
            for s in sorted({s for s, _ in requests}):
                if len(view.replicas[s]) > 1:
                    raise InvalidRequestError(
                        f"{method}: shard {s} has {len(view.replicas[s])} replicas ({'|'.join(view.replicas[s])}); "
                        "replicas are read-only serving copies: push to the training shard they follow",
                        shard=s,
                    )
        config, deadline = budget or self.budget()
        return call_all(
            view.transport,
            view.replica_set,
            method,
            requests,
            config,
            deadline,
            pinned=pinned,
            hedge=method in _READS,
            degrade=degrade,
            epoch=view.epoch if method in ("Lookup", "Push", "Erase") else None,
        )

    def list_tables(self, budget: Budget) -> dict[str, TableConfig]:
        """Every table of the cluster, by name, as shard 0 (any of its replicas) reports them."""
        (answer,) = self.call("ListTables", [(0, b"")], budget=budget)
        with self.reply("ListTables", 0, answer.endpoint):
            reply = pb.ListTablesResponse.FromString(answer.data)
        return {t.name: table_config(t) for t in reply.tables}

    @contextlib.contextmanager
    def reply(self, method: str, shard: int, endpoint: int, view: ClusterView | None = None) -> Iterator[None]:
        """Turn an undecodable reply of ``shard`` (from ``endpoint``) into ``InternalServerError``."""
        try:
            yield
        except (wire.WireFormatError, DecodeError, json.JSONDecodeError) as exc:
            raise InternalServerError(
                f"shard {shard} ({(view or self._views.current).address(endpoint)}): {method} reply does not "
                f"decode ({exc}); is that address a ps-server of this version?",
                shard=shard,
            ) from exc
