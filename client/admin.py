"""``AdminClient``: operate a cluster. Its tables, each replica's ``Stats`` and health as
this client sees it, checkpoints, and pinning serving shards to one; and the calls a live
reshard makes to one shard by its address (``get_map``, ``reshard``).

The data path (lookups, pushes) is ``PSClient``'s; ``PSClient.admin`` is an
``AdminClient`` over the same link to the cluster.

Example (needs running shards, see the README):
    with AdminClient(["127.0.0.1:50051", "127.0.0.1:50052"]) as admin:
        [s["version"] for s in admin.stats()]
        admin.checkpoint()[0]["name"]                          # "000001" with --data-dir
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError, Message

from client.cluster import ClusterView
from client.config import ClientConfig, TableConfig
from client.errors import InternalServerError, InvalidRequestError, PSError, error_for, tls_hint
from client.link import Budget, ClusterLink
from client.membership import members_of
from client.retry import Answer, Rerouted
from client.tables import message_dict
from client.transport import Transport
from protos import ps_pb2 as pb
from protos import wire
from protos.keys import shard_of
from protos.rpc.security import CallerSecurity
from protos.rpc.tls import open_channel
from protos.services import PS_SERVICE

__all__ = ["AdminClient", "CheckpointError", "ShardByAddress"]


class CheckpointError(PSError):
    """A checkpoint some shards refused after others wrote their part: the first refusal's
    status and message, and ``written``, the shards that wrote (an incomplete checkpoint,
    to remove or to write again under a new name). A checkpoint no shard wrote raises the
    refusal itself."""

    def __init__(self, first: PSError, written: Sequence[int]) -> None:
        super().__init__(str(first), code=first.code, shard=first.shard, hint=first.hint)
        self.written = tuple(written)


class AdminClient:
    """Operating the cluster at ``addresses`` (as ``PSClient`` takes them), or over a
    ``PSClient``'s ``link``. The constructor does no I/O; channels open on first use.
    Thread-safe. Calls block and raise ``client.errors.PSError`` subclasses; a reply's
    dicts are new and the caller's."""

    def __init__(
        self,
        addresses: Sequence[str | Sequence[str]] | None = None,
        config: ClientConfig | None = None,
        *,
        addresses_file: str | os.PathLike[str] | None = None,
        transport: Transport | None = None,
        link: ClusterLink | None = None,
    ) -> None:
        if link is None:
            link = ClusterLink(members_of(addresses, addresses_file), config or ClientConfig(), transport=transport)
            self._owns_link = True
        else:
            self._owns_link = False
        self._link = link
        self.config = link.config
        self._by_address = ShardByAddress(self.config)

    # -- lifecycle ------------------------------------------------------------------
    def __enter__(self) -> AdminClient:
        self._link.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close what this client opened (a shared link stays open)."""
        self._by_address.close()
        if self._owns_link:
            self._link.close()

    @property
    def addresses(self) -> list[str]:
        """Every replica's address, shard by shard (the order of ``stats()``)."""
        return self._link.view.addresses

    @property
    def replicas(self) -> list[tuple[str, ...]]:
        return list(self._link.view.replicas)

    @property
    def num_shards(self) -> int:
        return self._link.view.num_shards

    def refresh_map(self) -> int:
        """Route by the cluster's newest map (``PSClient.refresh_map``); the epoch."""
        return self._link.refresh(self._link.budget())

    # -- the cluster ----------------------------------------------------------------
    def tables(self) -> dict[str, TableConfig]:
        """Every table of the cluster (as shard 0, any of its replicas, reports them), by name."""
        return self._link.list_tables(self._link.budget())

    def stats(self) -> list[dict[str, Any]]:
        """Each replica's ``Stats`` as a dict with its ``"address"`` added, in the order of
        ``addresses`` (shard order when every shard has one address)."""
        view = self._link.view
        endpoints = view.replica_set.endpoints()
        requests = [(view.replica_set.shard_of(e), b"") for e in endpoints]
        replies = self._link.call("Stats", requests, pinned=endpoints, view=view)
        out = []
        for (s, _), r in zip(requests, replies):
            with self._link.reply("Stats", s, r.endpoint, view):
                out.append({**message_dict(pb.StatsResponse.FromString(r.data)), "address": view.address(r.endpoint)})
        return out

    def replica_health(self) -> list[dict[str, Any]]:
        """This client's view of each replica, in the order of ``addresses``: ``address``,
        ``shard``, ``state`` (``in_service``, ``ejected``, or ``probing``: its probe is in
        flight), ``ejected_for_s`` (time left), ``inflight`` calls, ``failures`` in a row and
        ``refused``: attempts it refused for load. Needs no I/O."""
        return self._link.view.replica_set.health()

    def refusals(self) -> int:
        """Attempts of this client the shards refused for load (RESOURCE_EXHAUSTED at their
        ``--threads`` limit, retried after a backoff) since it started. Needs no I/O."""
        return self._link.view.replica_set.refusals()

    def checkpoint(self, name: str | None = None, *, deadline_s: float | None = None) -> list[dict[str, Any]]:
        """Have every shard write its part of the checkpoint ``name``; blocks until all are done.

        ``name`` is a directory under each shard's ``--checkpoint-root`` (relative: resolved
        under it; absolute: must lie below it), and shard ``i`` of ``n`` writes
        ``name/shard-{i:05d}-of-{n:05d}`` (see ``ps.durability.checkpoint``). None: the next
        version number, which shard 0 picks (its root's next one) and every other shard
        then takes, so that the whole cluster's checkpoint has one name. The shards write in
        parallel (after shard 0 when it picks the name). Returns, in shard order, ``{"name":
        the checkpoint's name, "path": the part written, "manifest": its manifest.json}``;
        ``name`` is what ``serve_from`` takes. Not retried (a checkpoint whose answer was
        lost has still been written). Raises the first refusal's ``PSError`` when no shard
        wrote its part, ``CheckpointError`` (naming the shards that did) when some did.
        """
        budget = self._link.budget(deadline_s, dataclasses.replace(self.config, max_attempts=1))
        written: dict[int, dict[str, Any]] = {}
        if name is None:
            written.update(self._checkpoint([0], "", budget, written))
            name = posixpath.basename(posixpath.dirname(written[0]["path"]))
        else:
            name = str(name)
        written.update(self._checkpoint(range(len(written), self.num_shards), name, budget, written))
        return [{**written[s], "name": name} for s in range(self.num_shards)]

    def _checkpoint(
        self, shards: range | list[int], name: str, budget: Budget, written: dict[int, dict[str, Any]]
    ) -> dict[int, dict[str, Any]]:
        """Each of ``shards`` writes its part, in parallel; raises ``CheckpointError`` (naming
        every shard that wrote, ``written`` included) when one refuses."""
        body = pb.CheckpointRequest(path=name).SerializeToString()

        def one(s: int) -> dict[str, Any]:
            (answer,) = self._link.call("Checkpoint", [(s, body)], budget=budget)
            with self._link.reply("Checkpoint", s, answer.endpoint):
                reply = pb.CheckpointResponse.FromString(answer.data)
                return {"path": reply.path, "manifest": json.loads(reply.manifest_json or "{}")}

        shards = list(shards)
        if not shards:
            return {}
        with ThreadPoolExecutor(len(shards), thread_name_prefix="ps-checkpoint") as pool:
            futures = {s: pool.submit(one, s) for s in shards}
        out, refused = {}, []
        for s, future in futures.items():
            error = future.exception()
            if error is None:
                out[s] = future.result()
            elif isinstance(error, PSError):
                refused.append(error)
            else:
                raise error
        if refused:
            first = refused[0]
            also = "".join(f"; and {str(e).splitlines()[0]}" for e in refused[1:])  # each names its shard
            first = first.reworded(f"{first}{also}") if also else first
            done = sorted([*written, *out])
            if not done:  # nothing was written: the refusal as it is
                raise first
            raise CheckpointError(first, done) from first
        return out

    def load_checkpoint(
        self, name: str, num_shards: int, tables: Sequence[str], *, deadline_s: float | None = None
    ) -> list[dict[str, Any]]:
        """Make the rows of ``tables`` on every shard exactly those of checkpoint ``name``, which
        a cluster of ``num_shards`` shards wrote (``checkpoint()``'s name): each shard drops its
        rows of those tables and installs the checkpoint's rows it owns, in parallel. The
        cluster may have another size than the one that wrote it; every shard then reads every
        part under its own checkpoint root (a root the shards share holds them all). Returns, in
        shard order, ``{"rows": {table: rows installed}, "parts": [parts read]}``. Not retried.
        Raises the first shard's ``PSError`` (each names its shard); the shards that answered
        have loaded their part, so a failed load is repaired by loading again. Load before
        training pushes to those tables: a push that lands while a shard loads may be
        overwritten by the checkpoint's row."""
        budget = self._link.budget(deadline_s, dataclasses.replace(self.config, max_attempts=1))
        body = pb.LoadCheckpointRequest(checkpoint=name, num_shards=num_shards, tables=list(tables)).SerializeToString()

        def one(s: int) -> dict[str, Any]:
            (answer,) = self._link.call("LoadCheckpoint", [(s, body)], budget=budget)
            with self._link.reply("LoadCheckpoint", s, answer.endpoint):
                reply = pb.LoadCheckpointResponse.FromString(answer.data)
                return {"rows": dict(reply.rows), "parts": list(reply.parts)}

        with ThreadPoolExecutor(self.num_shards, thread_name_prefix="ps-load") as pool:
            futures = [pool.submit(one, s) for s in range(self.num_shards)]
        return [f.result() for f in futures]

    def serve_from(self, checkpoint: str | None) -> list[dict[str, Any]]:
        """Pin every serving replica to ``checkpoint`` (the name ``checkpoint()`` returned, a
        version number such as ``"3"``, or a path under each replica's ``--checkpoint-root``;
        each replica serves its shard's part of it), or with None switch each back to its
        own source (following its training shard again). Returns each replica's follow
        status as a dict, in the order of ``addresses``. Raises ``PreconditionError`` for a
        training shard, ``InvalidRequestError`` for a checkpoint a replica cannot serve."""
        body = pb.ServeFromRequest(checkpoint=checkpoint or "")
        return self._every_replica("ServeFrom", body, pb.ServeFromResponse)

    def publish(self, name: str = "", *, hold: bool | None = None, wait_s: float = 0.0) -> list[dict[str, Any]]:
        """Publish every training shard's rows as they are now under ``name``, for serving
        shards started with ``--published-only`` (``ps.replication.publish``): send no push
        until it returns. With ``hold`` True or False (and no name), hold or release
        publishing instead. Returns each shard's answer, in shard order, as a dict:
        ``version``, ``held`` (publishing is held: nothing was published), ``followers``,
        ``exact`` (followers that took it whole), ``published``, ``held_by``. Not retried:
        a publication sent again would be a second one. Raises ``PreconditionError`` for a
        serving shard, ``InvalidRequestError`` for a bad name."""
        budget = self._link.budget(None, dataclasses.replace(self.config, max_attempts=1))
        kind = pb.PublishRequest.KEEP if hold is None else pb.PublishRequest.HOLD if hold else pb.PublishRequest.RELEASE
        body = pb.PublishRequest(name=name, hold=kind, wait_s=wait_s).SerializeToString()
        replies = self._link.call("Publish", [(s, body) for s in range(self.num_shards)], budget=budget)
        out = []
        for s, r in enumerate(replies):
            with self._link.reply("Publish", s, r.endpoint):
                out.append(message_dict(pb.PublishResponse.FromString(r.data)))
        return out

    def erase(
        self, table: str, keys: npt.ArrayLike, *, compact: bool = False, checkpoints: bool = False
    ) -> list[dict[str, Any]]:
        """Delete the rows of ``keys`` in ``table`` for good, on every training shard
        (``Shard.erase``): RAM, data dir, and, through the change stream, the serving shards
        that follow them. Each shard is sent the keys it owns and the others, which it may
        still hold from before a reshard. A key erased is new again. With ``checkpoints``,
        also from every checkpoint under each shard's checkpoint root; with ``compact``,
        each shard then compacts its data dir so the rows' bytes leave the disk. Returns
        each shard's answer, in shard order: ``erased_ram``, ``erased_disk``, ``version``,
        ``compacted``, ``compact_s``, ``checkpoints`` (``path``, ``rows``). Safe to send
        again (a second erase finds nothing), so retried like a push; routed again if the
        cluster map moves meanwhile. Needs an admin token."""
        k = np.unique(_erase_keys(keys))
        budget = self._link.budget()

        def attempt(view: ClusterView) -> list[dict[str, Any]] | Rerouted:
            requests = [
                (s, _erase_request(table, k, view, s, compact=compact, checkpoints=checkpoints))
                for s in range(view.num_shards)
            ]
            answers = self._link.send("Erase", requests, budget, view=view)
            moved = next((a for a in answers if isinstance(a, Rerouted)), None)
            if moved is not None:
                return moved
            out = []
            for s, a in enumerate(answers):
                assert isinstance(a, Answer)
                with self._link.reply("Erase", s, a.endpoint, view):
                    out.append(message_dict(pb.EraseResponse.FromString(a.data)))
            return out

        return self._link.routed("Erase", budget, attempt)

    def find_erased(self, table: str, keys: npt.ArrayLike, *, checkpoints: bool = True) -> list[dict[str, Any]]:
        """Ask every replica of every shard (training and serving) how many of ``keys`` it
        still holds in ``table``, changing nothing: each answer as ``erase`` returns it
        (``erased_ram``, ``erased_disk``: rows found there; ``checkpoints``: rows found in
        each checkpoint part, with ``checkpoints``) with the replica's ``address``, in the
        order of ``addresses``. What ``ps-admin erase --verify`` checks."""
        return self._erase_each_replica(table, keys, checkpoints=checkpoints, verify=True)

    def erase_served(self, table: str, keys: npt.ArrayLike) -> list[dict[str, Any]]:
        """Have every replica of a serving cluster delete the rows it still holds of ``keys``
        in ``table`` and compact its data dir (the bytes of rows its change stream deleted
        stay in its files until then); a pinned checkpoint is loaded again. Each answer as
        ``erase`` returns it, with the replica's ``address``. What ``ps-admin erase`` does
        once the serving shards applied the training shards' erase."""
        return self._erase_each_replica(table, keys, compact=True, served=True)

    def _erase_each_replica(self, table: str, keys: npt.ArrayLike, **flags: bool) -> list[dict[str, Any]]:
        """An ``Erase`` with ``flags`` to every replica of every shard; asked again under the
        new cluster map if one refuses keys under a newer map."""
        k = np.unique(_erase_keys(keys))
        budget = self._link.budget()

        def attempt(view: ClusterView) -> list[dict[str, Any]] | Rerouted:
            endpoints = view.replica_set.endpoints()
            shards = [view.replica_set.shard_of(e) for e in endpoints]
            requests = [(s, _erase_request(table, k, view, s, **flags)) for s in shards]
            answers = self._link.send("Erase", requests, budget, pinned=endpoints, view=view)
            moved = next((a for a in answers if isinstance(a, Rerouted)), None)
            if moved is not None:
                return moved
            out = []
            for s, a in zip(shards, answers):
                assert isinstance(a, Answer)
                with self._link.reply("Erase", s, a.endpoint, view):
                    out.append(
                        {**message_dict(pb.EraseResponse.FromString(a.data)), "address": view.address(a.endpoint)}
                    )
            return out

        return self._link.routed("Erase", budget, attempt)

    def roll_back(self) -> list[dict[str, Any]]:
        """Have every serving replica (``--published-only``) serve the publication before the
        one it serves; returns each replica's follow status, in the order of ``addresses``.
        Raises ``PreconditionError`` for a training shard, ``InvalidRequestError`` for a
        replica with no publication to go back to."""
        return self._every_replica("RollBack", pb.RollBackRequest(), pb.RollBackResponse)

    def _every_replica(self, method: str, request: Message, answer: Any) -> list[dict[str, Any]]:
        """``request`` to every replica of every shard; each answer's follow ``status`` as a
        dict with the replica's ``address``, in the order of ``addresses``."""
        view = self._link.view
        endpoints = view.replica_set.endpoints()
        body = request.SerializeToString()
        requests = [(view.replica_set.shard_of(e), body) for e in endpoints]
        replies = self._link.call(method, requests, pinned=endpoints, view=view)
        out = []
        for (s, _), r in zip(requests, replies):
            with self._link.reply(method, s, r.endpoint, view):
                status = message_dict(answer.FromString(r.data).status)
            out.append({**status, "address": view.address(r.endpoint)})
        return out

    # -- one shard by its address (a live reshard) ----------------------------------
    def get_map(self, address: str, *, timeout_s: float | None = None) -> pb.GetMapResponse:
        """The cluster map the shard at ``address`` routes by, and where a reshard stands there."""
        return self._by_address.get_map(address, timeout_s=timeout_s)

    def reshard(self, address: str, request: pb.ReshardRequest, *, timeout_s: float | None = None) -> pb.ReshardStatus:
        """One phase of a live reshard on the shard at ``address``; its status after it."""
        return self._by_address.reshard(address, request, timeout_s=timeout_s)


class ShardByAddress:
    """Calls to one shard by its address, outside any cluster map (a live reshard's steps:
    ``get_map``, ``reshard``), with ``config``'s TLS and token, each limited to
    ``config.deadline_s`` unless given, never retried. A failure raises the ``PSError`` of
    its status, naming the address (with a hint when one side speaks TLS and the other
    does not). Thread-safe; one channel per address, closed by ``close``."""

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self._channels: dict[str, grpc.Channel] = {}
        self._security: CallerSecurity | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> ShardByAddress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def get_map(self, address: str, *, timeout_s: float | None = None) -> pb.GetMapResponse:
        return self._unary(address, "GetMap", pb.GetMapRequest(), pb.GetMapResponse, timeout_s)  # type: ignore[no-any-return]

    def reshard(self, address: str, request: pb.ReshardRequest, *, timeout_s: float | None = None) -> pb.ReshardStatus:
        return self._unary(address, "Reshard", request, pb.ReshardStatus, timeout_s)  # type: ignore[no-any-return]

    def _unary(self, address: str, method: str, request: Any, reply: Any, timeout_s: float | None) -> Any:
        """One call to ``address`` (no retry), with this client's TLS and token; a failure
        raises the ``PSError`` of its status, naming the address."""
        with self._lock:
            if self._security is None:
                self._security = self.config.caller_security()
            security = self._security
            channel = self._channels.get(address)
            if channel is None:
                # A shard that is starting is tried again within a second, not after gRPC's backoff of minutes.
                reconnect = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
                channel = self._channels[address] = open_channel(address, security.credentials, reconnect)
        call = channel.unary_unary(f"/{PS_SERVICE}/{method}", request_serializer=None, response_deserializer=None)
        try:
            data = call(
                request.SerializeToString(),
                timeout=timeout_s if timeout_s is not None else self.config.deadline_s,
                metadata=security.metadata,
            )
        except grpc.RpcError as exc:
            code, details = exc.code(), str(exc.details())
            hint = tls_hint(code, details, address, security.credentials is not None, security.client_certificate)
            message = f"{address}: {code.name}: {details}" + (f": {hint}" if hint else "")
            raise error_for(code)(message, code=code, hint=hint) from None
        try:
            return reply.FromString(data)
        except DecodeError as exc:
            raise InternalServerError(
                f"{address}: {method} reply does not decode ({exc}): is it a ps-server?"
            ) from None


def _erase_keys(keys: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """``keys`` as a 1-D int64 array; ``InvalidRequestError`` naming the field otherwise."""
    try:
        return wire.as_keys(keys, "erase: keys")
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(str(exc)) from None


def _erase_request(
    table: str,
    keys: npt.NDArray[np.int64],
    view: ClusterView,
    shard: int,
    *,
    compact: bool = False,
    checkpoints: bool = False,
    verify: bool = False,
    served: bool = False,
) -> bytes:
    """Shard ``shard``'s part of an erase of ``keys`` (sorted, distinct): the keys it owns under
    ``view``, and the others, which its old checkpoints, rescue dumps and rows given away in a
    reshard may still hold."""
    mine = shard_of(keys, view.num_shards) == shard
    return pb.EraseRequest(
        table=table,
        keys=wire.encode_keys(keys[mine]),
        others=wire.encode_keys(keys[~mine]),
        num_shards=view.num_shards,
        shard=shard,
        epoch=view.epoch,
        compact=compact,
        checkpoints=checkpoints,
        verify=verify,
        served=served,
    ).SerializeToString()
