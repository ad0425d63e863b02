"""gRPC handlers: decode the request, call the ``Shard``, encode the response.

Every handler runs inside ``status_boundary``: a ``ShardError`` becomes its status
code with its message, a malformed message becomes INVALID_ARGUMENT, and anything
else becomes INTERNAL with the traceback in the shard's log. Requests are decoded
inside the handler (the registered deserializers pass bytes through) so that even
undecodable bytes get a status a person can act on.

``Lookup`` gathers rows straight into the encoded response, and ``Push`` reads
gradients straight out of the request bytes (see ``protos.wire``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from protos import ps_pb2 as pb
from protos import wire
from ps.config import ConfigError, TableSpec
from ps.errors import InvalidRequest, RequestTooLarge, ShardError
from ps.initializers import InitializerKind, InitializerParams
from ps.optimizers import OptimizerKind, OptimizerParams
from ps.shard import Shard
from ps.table import Table

__all__ = ["SERVICE_NAME", "Servicer", "spec_from_proto", "spec_to_proto", "status_boundary"]

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
_INIT_FIELDS = ("low", "high", "mean", "std", "value")
_OPT_FIELDS = (
    "lr", "weight_decay", "eps", "initial_accumulator_value", "beta1", "beta2", "l1", "l2", "lr_power", "beta",
)  # fmt: skip


@contextlib.contextmanager
def status_boundary(context: grpc.ServicerContext, method: str) -> Iterator[None]:
    """Turn exceptions from a handler body into gRPC statuses (see the module docstring)."""
    try:
        yield
    except ShardError as exc:
        context.abort(exc.code, str(exc))
    except (wire.WireFormatError, DecodeError) as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: malformed request: {exc}")
    except Exception as exc:
        log.exception("unhandled error in %s", method)
        context.abort(
            grpc.StatusCode.INTERNAL, f"{method}: internal error {type(exc).__name__}: {exc} (see the shard log)"
        )


def spec_from_proto(msg: pb.TableSpec) -> TableSpec:
    """A validated ``TableSpec``; absent optional fields take their defaults.

    Raises ``InvalidRequest`` naming the bad field.
    """
    try:
        init_kw: dict[str, Any] = {f: getattr(msg.initializer, f) for f in _INIT_FIELDS if msg.initializer.HasField(f)}
        init_kind = msg.initializer.kind or InitializerKind.UNIFORM
        opt_kw: dict[str, Any] = {f: getattr(msg.optimizer, f) for f in _OPT_FIELDS if msg.optimizer.HasField(f)}
        opt_kind = msg.optimizer.kind or OptimizerKind.SGD
        if msg.dtype not in (pb.DTYPE_UNSPECIFIED, pb.FLOAT32):
            raise InvalidRequest(f"table {msg.name!r}: dtype {wire.dtype_name(msg.dtype)}: only FLOAT32 storage exists")
        return TableSpec(
            name=msg.name,
            dim=msg.dim,
            initializer=InitializerParams(InitializerKind(init_kind), **init_kw),
            optimizer=OptimizerParams(OptimizerKind(opt_kind), **opt_kw),
            seed=msg.seed,
        )
    except (ConfigError, ValueError) as exc:
        raise InvalidRequest(f"spec of table {msg.name!r}: {exc}") from None


def spec_to_proto(spec: TableSpec) -> pb.TableSpec:
    """The wire form of ``spec`` with every field set explicitly."""
    init = spec.initializer
    opt = spec.optimizer
    return pb.TableSpec(
        name=spec.name,
        dim=spec.dim,
        dtype=pb.FLOAT32,
        seed=spec.seed,
        initializer=pb.InitializerSpec(kind=init.kind.name, **{f: getattr(init, f) for f in _INIT_FIELDS}),
        optimizer=pb.OptimizerSpec(kind=opt.kind.name, **{f: getattr(opt, f) for f in _OPT_FIELDS}),
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

        def unary(fn: Callable[[bytes, grpc.ServicerContext], Any], encode: bool) -> grpc.RpcMethodHandler:  # type: ignore[type-arg]
            return grpc.unary_unary_rpc_method_handler(
                fn,
                request_deserializer=None,  # raw bytes; decoded inside the status boundary
                response_serializer=(lambda m: m.SerializeToString()) if encode else None,
            )

        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "CreateTable": unary(self.CreateTable, True),
                "ListTables": unary(self.ListTables, True),
                "Lookup": unary(self.Lookup, False),
                "Push": unary(self.Push, True),
                "Stats": unary(self.Stats, True),
            },
        )

    def CreateTable(self, request: bytes, context: grpc.ServicerContext) -> pb.CreateTableResponse:
        with status_boundary(context, "CreateTable"):
            msg = pb.CreateTableRequest.FromString(request)
            spec = spec_from_proto(msg.spec)
            created = self._shard.create_table(spec)
            return pb.CreateTableResponse(created=created, spec=spec_to_proto(spec))
        raise AssertionError("unreachable: status_boundary aborts")

    def ListTables(self, request: bytes, context: grpc.ServicerContext) -> pb.ListTablesResponse:
        with status_boundary(context, "ListTables"):
            return pb.ListTablesResponse(
                tables=[spec_to_proto(t.spec) for t in self._shard.tables()],
                shard=self._shard.index,
                num_shards=self._shard.num_shards,
            )
        raise AssertionError("unreachable: status_boundary aborts")

    def Lookup(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with status_boundary(context, "Lookup"):
            msg = pb.LookupRequest.FromString(request)
            self._shard.check_request(msg.num_shards, msg.shard if msg.HasField("shard") else None)
            plan: list[tuple[Table, np.ndarray, int]] = []
            total = 0
            for i, entry in enumerate(msg.entries):
                self._shard.check_table_field(entry.table, f"entries[{i}].table")
                table = self._shard.table(entry.table)
                keys = wire.decode_keys(entry.keys, f"entries[{i}].keys (table {entry.table!r})")
                dtype = entry.dtype or wire.FLOAT32
                total += keys.shape[0] * table.dim * wire.dtype_itemsize(dtype, f"entries[{i}].dtype")
                plan.append((table, keys, dtype))
            if total > self._max_bytes - 4096:
                raise RequestTooLarge(
                    f"Lookup response would be {total} bytes, over this shard's max_message_bytes="
                    f"{self._max_bytes}: send fewer keys per request"
                )
            writer = wire.LookupResponseWriter([(t.spec.name, k.shape[0], t.dim, dt) for t, k, dt in plan])
            create = self._shard.mode == "train"
            for i, (table, keys, dtype) in enumerate(plan):
                out = writer.rows(i)
                if dtype == wire.FLOAT32:
                    table.lookup(keys, out, create=create)  # type: ignore[arg-type]
                else:
                    out[:] = wire.rows_to_dtype(table.lookup(keys, create=create), dtype)
            return writer.finish()
        raise AssertionError("unreachable: status_boundary aborts")

    def Push(self, request: bytes, context: grpc.ServicerContext) -> pb.PushResponse:
        with status_boundary(context, "Push"):
            msg = wire.decode_push_request(request)
            self._shard.check_request(msg.num_shards, msg.shard)
            self._shard.check_writable()
            batch = []
            for i, entry in enumerate(msg.entries):
                self._shard.check_table_field(entry.table, f"entries[{i}].table")
                table = self._shard.table(entry.table)
                field = f"entries[{i}] (table {entry.table!r})"
                keys = wire.decode_keys(entry.keys, f"{field}.keys")
                grads = wire.decode_rows(entry.grads, keys.shape[0], table.dim, entry.dtype, f"{field}.grads")
                table.validate_grads(keys, grads)
                batch.append((table, keys, grads))
            with self._shard.ledger.claim(msg.client_id, msg.seq) as fresh:
                if not fresh:
                    return pb.PushResponse(applied=False)
                # Every entry was validated above, before anything was applied.
                rows = sum(table.push(keys, grads, check=False) for table, keys, grads in batch)
            return pb.PushResponse(applied=True, rows_updated=rows)
        raise AssertionError("unreachable: status_boundary aborts")

    def Stats(self, request: bytes, context: grpc.ServicerContext) -> pb.StatsResponse:
        with status_boundary(context, "Stats"):
            shard = self._shard
            tables = [
                pb.TableStats(
                    name=t.spec.name,
                    dim=t.dim,
                    rows=len(t),
                    memory_bytes=t.memory_bytes(),
                    lookups=t.counters.lookups,
                    pushes=t.counters.pushes,
                    rows_created=t.counters.rows_created,
                )
                for t in shard.tables()
            ]
            return pb.StatsResponse(
                shard=shard.index,
                num_shards=shard.num_shards,
                mode=shard.mode,
                uptime_s=time.monotonic() - shard.started,
                tables=tables,
                duplicate_pushes=shard.ledger.duplicates,
            )
        raise AssertionError("unreachable: status_boundary aborts")
