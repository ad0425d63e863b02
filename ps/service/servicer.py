"""gRPC handlers: decode the request, call one ``Shard`` method, encode the response.

Every handler runs inside ``status_boundary``: a ``ShardError`` becomes its status
code with its message, a malformed message becomes INVALID_ARGUMENT, and anything
else becomes INTERNAL with the traceback in the shard's log. Requests are decoded
inside the handler (the registered deserializers pass bytes through) so that even
undecodable bytes get a status a person can act on.

``Lookup`` answers with the bytes ``Shard.lookup`` gathered the rows into (``read_only_handlers``
gives its twin for callers with a read token: it creates no rows), and
``Push`` hands the shard views of the gradients in the request bytes (see
``protos.wire``): rows are never copied on their way between the wire and a table.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from protos import ps_pb2 as pb
from protos import wire
from protos.rpc import server
from protos.rpc.server import Status
from protos.services import PS_SERVICE
from ps.elastic import ClusterMap, Route
from ps.errors import RequestTooLarge, ShardError
from ps.service.report import shard_stats
from ps.shard import LookupBatch, PushBatch, Shard
from ps.store import precision
from ps.table import TableSpec, spec_from_proto, spec_to_proto
from ps.yielding import produced_apart

__all__ = [
    "Servicer",
    "lookup_response",
    "push_batch",
    "spec_from_proto",
    "spec_to_proto",
    "status_boundary",
    "status_of",
]

log = logging.getLogger(__name__)


# What a Lookup response may need beyond its rows (table names, field headers).
_RESPONSE_OVERHEAD_BYTES = 4096


def status_of(exc: Exception, method: str) -> Status | None:
    """The status of what a handler raised: a ``ShardError``'s own code (with its trailing
    metadata), INVALID_ARGUMENT for bytes that do not decode; None for anything else
    (a bug: INTERNAL, logged)."""
    if isinstance(exc, ShardError):
        return Status(exc.code, str(exc), exc.trailing_metadata)
    if isinstance(exc, (wire.WireFormatError, DecodeError)):
        return Status(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: malformed request: {exc}")
    return None


def status_boundary(context: grpc.ServicerContext, method: str) -> contextlib.AbstractContextManager[None]:
    """Turn exceptions from a handler body into gRPC statuses (``status_of``)."""
    return server.status_boundary(context, method, status_of, "shard")


def _unary(fn: Callable[[bytes, grpc.ServicerContext], Any], encode: bool) -> grpc.RpcMethodHandler:  # type: ignore[type-arg]
    """A unary handler of ``fn``, which takes the request's raw bytes (decoded inside its
    status boundary) and returns a message (``encode``) or the response bytes."""
    return grpc.unary_unary_rpc_method_handler(
        fn,
        request_deserializer=None,
        response_serializer=(lambda m: m.SerializeToString()) if encode else None,
    )


class Servicer:
    """The ``ps.v1.ParameterServer`` service over one ``Shard``.

    Thread-safe (the shard and its tables lock). ``max_message_bytes`` bounds the
    size of a Lookup response; larger ones are refused with RESOURCE_EXHAUSTED.
    """

    def __init__(self, shard: Shard, max_message_bytes: int) -> None:
        self._shard = shard
        self._max_bytes = max_message_bytes

    def handler(self) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
        """The generic handler to register with a ``grpc.Server``."""
        return grpc.method_handlers_generic_handler(
            PS_SERVICE,
            {
                "CreateTable": _unary(self.CreateTable, True),
                "ListTables": _unary(self.ListTables, True),
                "Lookup": _unary(self.Lookup, False),
                "Push": _unary(self.Push, True),
                "Stats": _unary(self.Stats, True),
                "Checkpoint": _unary(self.Checkpoint, True),
                "LoadCheckpoint": _unary(self.LoadCheckpoint, True),
                "Follow": grpc.unary_stream_rpc_method_handler(
                    self.Follow, request_deserializer=None, response_serializer=lambda m: m.SerializeToString()
                ),
                "ServeFrom": _unary(self.ServeFrom, True),
                "Publish": _unary(self.Publish, True),
                "RollBack": _unary(self.RollBack, True),
                "Erase": _unary(self.Erase, True),
                "GetMap": _unary(self.GetMap, True),
                "Reshard": _unary(self.Reshard, True),
                "MoveRows": grpc.unary_stream_rpc_method_handler(
                    self.MoveRows, request_deserializer=None, response_serializer=lambda m: m.SerializeToString()
                ),
            },
        )

    def read_only_handlers(self) -> dict[str, grpc.RpcMethodHandler]:  # type: ignore[type-arg]
        """What a caller whose token does not allow writes runs instead, by full method
        name (``protos.rpc.guard.Guard``'s ``read_only``): a Lookup that creates no rows."""
        return {f"/{PS_SERVICE}/Lookup": _unary(self.LookupReadOnly, False)}

    def CreateTable(self, request: bytes, context: grpc.ServicerContext) -> pb.CreateTableResponse:
        with status_boundary(context, "CreateTable"):
            spec = spec_from_proto(pb.CreateTableRequest.FromString(request).spec)
            return pb.CreateTableResponse(created=self._shard.create_table(spec), spec=spec_to_proto(spec))
        raise AssertionError("unreachable: status_boundary aborts")

    def ListTables(self, request: bytes, context: grpc.ServicerContext) -> pb.ListTablesResponse:
        with status_boundary(context, "ListTables"):
            pb.ListTablesRequest.FromString(request)  # no fields, but bytes that do not decode are refused
            specs = self._shard.specs()
            return pb.ListTablesResponse(
                tables=[spec_to_proto(s) for s in specs], shard=self._shard.index, num_shards=self._shard.num_shards
            )
        raise AssertionError("unreachable: status_boundary aborts")

    def Lookup(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with status_boundary(context, "Lookup"):
            return lookup_response(self._shard, pb.LookupRequest.FromString(request), self._max_bytes)
        raise AssertionError("unreachable: status_boundary aborts")

    def LookupReadOnly(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with status_boundary(context, "Lookup"):
            return lookup_response(self._shard, pb.LookupRequest.FromString(request), self._max_bytes, read_only=True)
        raise AssertionError("unreachable: status_boundary aborts")

    def Push(self, request: bytes, context: grpc.ServicerContext) -> pb.PushResponse:
        with status_boundary(context, "Push"):
            applied, rows = self._shard.push(push_batch(wire.decode_push_request(request)))
            return pb.PushResponse(applied=applied, rows_updated=rows)
        raise AssertionError("unreachable: status_boundary aborts")

    def Stats(self, request: bytes, context: grpc.ServicerContext) -> pb.StatsResponse:
        with status_boundary(context, "Stats"):
            pb.StatsRequest.FromString(request)  # no fields, but bytes that do not decode are refused
            return shard_stats(self._shard)
        raise AssertionError("unreachable: status_boundary aborts")

    def Checkpoint(self, request: bytes, context: grpc.ServicerContext) -> pb.CheckpointResponse:
        with status_boundary(context, "Checkpoint"):
            path, manifest = self._shard.checkpoint(pb.CheckpointRequest.FromString(request).path or None)
            return pb.CheckpointResponse(path=str(path), manifest_json=json.dumps(manifest, sort_keys=True))
        raise AssertionError("unreachable: status_boundary aborts")

    def LoadCheckpoint(self, request: bytes, context: grpc.ServicerContext) -> pb.LoadCheckpointResponse:
        with status_boundary(context, "LoadCheckpoint"):
            load = pb.LoadCheckpointRequest.FromString(request)
            rows, parts = self._shard.load_checkpoint(load.checkpoint, load.num_shards, list(load.tables))
            return pb.LoadCheckpointResponse(rows=rows, parts=[str(p) for p in parts])
        raise AssertionError("unreachable: status_boundary aborts")

    def Follow(self, request: bytes, context: grpc.ServicerContext) -> Iterator[pb.FollowBatch]:
        with status_boundary(context, "Follow"):
            follow = pb.FollowRequest.FromString(request)
            yield from self._shard.follow(
                Route(follow.num_shards, follow.shard),
                follow.history,
                follow.version,
                context.is_active,
                self._max_bytes,
            )

    def ServeFrom(self, request: bytes, context: grpc.ServicerContext) -> pb.ServeFromResponse:
        with status_boundary(context, "ServeFrom"):
            return pb.ServeFromResponse(
                status=self._shard.serve_from(pb.ServeFromRequest.FromString(request).checkpoint)
            )
        raise AssertionError("unreachable: status_boundary aborts")

    def Publish(self, request: bytes, context: grpc.ServicerContext) -> pb.PublishResponse:
        with status_boundary(context, "Publish"):
            return self._shard.publish(pb.PublishRequest.FromString(request))
        raise AssertionError("unreachable: status_boundary aborts")

    def Erase(self, request: bytes, context: grpc.ServicerContext) -> pb.EraseResponse:
        with status_boundary(context, "Erase"):
            return self._shard.erase(pb.EraseRequest.FromString(request))
        raise AssertionError("unreachable: status_boundary aborts")

    def RollBack(self, request: bytes, context: grpc.ServicerContext) -> pb.RollBackResponse:
        with status_boundary(context, "RollBack"):
            pb.RollBackRequest.FromString(request)  # no fields, but bytes that do not decode are refused
            return pb.RollBackResponse(status=self._shard.roll_back())
        raise AssertionError("unreachable: status_boundary aborts")

    def GetMap(self, request: bytes, context: grpc.ServicerContext) -> pb.GetMapResponse:
        with status_boundary(context, "GetMap"):
            pb.GetMapRequest.FromString(request)  # no fields, but bytes that do not decode are refused
            return self._shard.get_map()
        raise AssertionError("unreachable: status_boundary aborts")

    def Reshard(self, request: bytes, context: grpc.ServicerContext) -> pb.ReshardStatus:
        with status_boundary(context, "Reshard"):
            return self._shard.reshard_request(pb.ReshardRequest.FromString(request))
        raise AssertionError("unreachable: status_boundary aborts")

    def MoveRows(self, request: bytes, context: grpc.ServicerContext) -> Iterator[pb.MoveBatch]:
        with status_boundary(context, "MoveRows"):
            move = pb.MoveRowsRequest.FromString(request)
            batches = self._shard.move_rows(
                ClusterMap.from_proto(move.to, "to"),
                move.destination,
                context.is_active,
                self._max_bytes,
                max(0.0, move.max_rows_per_s),
            )
            # Made a couple ahead in a thread of lower priority than requests (this handler
            # thread serves every call): the copy takes the cores requests leave idle.
            yield from produced_apart(batches, f"ps-moveout-to-{move.destination}")


# -- the codec of the two requests that carry rows -------------------------------------------


def lookup_response(
    shard: Shard, request: pb.LookupRequest, max_response_bytes: int, *, read_only: bool = False
) -> bytes:
    """The encoded ``LookupResponse`` of ``shard`` to ``request``: the shard checks the
    route, then the keys are decoded (naming the entry and field of bad ones), the
    response is sized once the shard knows each entry's table (``RequestTooLarge`` over
    ``max_response_bytes``), and the shard gathers float32 rows, or a 16-bit table's rows
    in its own type, straight into it; other 16-bit dtypes are gathered as float32 and
    converted after."""
    route = Route(request.num_shards, request.shard if request.HasField("shard") else None, request.epoch)
    dtypes: list[int] = []
    decoded: list[tuple[str, npt.NDArray[np.int64]]] = []

    def entries() -> list[tuple[str, npt.NDArray[np.int64]]]:
        for i, entry in enumerate(request.entries):
            keys = wire.decode_keys(entry.keys, f"entries[{i}].keys (table {entry.table!r})")
            dtype = entry.dtype or wire.FLOAT32
            wire.dtype_itemsize(dtype, f"entries[{i}].dtype")
            decoded.append((entry.table, keys))
            dtypes.append(dtype)
        return decoded

    batch = LookupBatch(entries, route)
    writer: wire.LookupResponseWriter | None = None
    staged: list[tuple[int, Any]] = []

    def response_rows(specs: Sequence[TableSpec]) -> list[npt.NDArray[np.float32]]:
        nonlocal writer
        publication = shard.publication  # read under the lock the rows are: the one they are of
        layout = [(name, k.shape[0], spec.dim, dt) for (name, k), spec, dt in zip(decoded, specs, dtypes, strict=True)]
        total = sum(n * dim * wire.dtype_itemsize(dt) for _, n, dim, dt in layout)
        if total > max_response_bytes - _RESPONSE_OVERHEAD_BYTES:
            raise RequestTooLarge(
                f"Lookup response would be {total} bytes, over this shard's max_message_bytes="
                f"{max_response_bytes}: send fewer keys per request"
            )
        writer = wire.LookupResponseWriter(layout, publication)
        out = []
        for i, ((_, n, dim, dt), spec) in enumerate(zip(layout, specs, strict=True)):
            if dt in (wire.FLOAT32, precision.to_wire(spec.storage_dtype)):  # the table's bits as they are, or float32
                out.append(cast("npt.NDArray[np.float32]", writer.rows(i)))
            else:  # gathered as float32 into this thread's scratch, converted below
                staged.append((i, n * dim))
        scratch = _scratch(sum(size for _, size in staged))
        at = 0
        for k, (i, size) in enumerate(staged):
            _, n, dim, _ = layout[i]
            out.insert(i, scratch[at : at + size].reshape(n, dim))
            staged[k] = (i, out[i])
            at += size
        return out

    shard.lookup(batch, response_rows, read_only=read_only)
    if writer is None:  # no entries: the shard asked for no buffer
        writer = wire.LookupResponseWriter([], shard.publication)
    for i, rows in staged:
        precision.to_wire_rows(rows, writer.rows(i))
    return writer.finish()


_thread = threading.local()


_SCRATCH_KEPT = 4 << 20  # elements (16 MiB) a thread keeps between lookups at most


def _scratch(size: int) -> npt.NDArray[np.float32]:
    """Float32 scratch of ``size`` elements; up to ``_SCRATCH_KEPT`` it is this thread's,
    kept between calls: a new 16 MiB array per lookup would cost its page faults every time."""
    if size > _SCRATCH_KEPT:
        return np.empty(size, np.float32)
    buf: npt.NDArray[np.float32] | None = getattr(_thread, "scratch", None)
    if buf is None or buf.shape[0] < size:
        buf = np.empty(size, np.float32)
        _thread.scratch = buf
    return buf[:size]


def push_batch(request: wire.PushRequestView) -> PushBatch:
    """``request`` as the shard takes it: its entries are decoded once the shard takes
    writes, gradients as float32 ``[len(keys), dim]`` of each entry's table (the shard's
    ``dim_of`` checks the table first); ``WireFormatError`` names the entry and field."""

    def entries(dim_of: Callable[[int, str], int]) -> list[tuple[str, npt.NDArray[np.int64], npt.NDArray[np.float32]]]:
        decoded = []
        for i, entry in enumerate(request.entries):
            dim = dim_of(i, entry.table)
            field = f"entries[{i}] (table {entry.table!r})"
            keys = wire.decode_keys(entry.keys, f"{field}.keys")
            grads = wire.decode_rows(entry.grads, keys.shape[0], dim, entry.dtype, f"{field}.grads")
            decoded.append((entry.table, keys, grads))
        return decoded

    return PushBatch(
        entries,
        request.client_id,
        request.seq,
        Route(request.num_shards, request.shard, request.epoch),
        [e.seq for e in request.entries],
        request.planned_epoch,
        request.planned_shard,
    )
