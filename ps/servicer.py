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
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from protos import ps_pb2 as pb
from protos import wire
from ps.config import spec_from_proto, spec_to_proto
from ps.errors import RequestTooLarge, ShardError
from ps.shard import Shard
from ps.table import Table

__all__ = ["SERVICE_NAME", "Servicer", "spec_from_proto", "spec_to_proto", "status_boundary"]

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name


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
                "Checkpoint": unary(self.Checkpoint, True),
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
            pb.ListTablesRequest.FromString(request)  # no fields, but bytes that do not decode are refused
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
            self._shard.after_request()
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
            # Every entry was validated above, before anything is applied.
            applied, rows = self._shard.push(batch, msg.client_id, msg.seq)
            return pb.PushResponse(applied=applied, rows_updated=rows)
        raise AssertionError("unreachable: status_boundary aborts")

    def Stats(self, request: bytes, context: grpc.ServicerContext) -> pb.StatsResponse:
        with status_boundary(context, "Stats"):
            pb.StatsRequest.FromString(request)  # no fields, but bytes that do not decode are refused
            shard = self._shard
            tables = []
            for t in shard.tables():
                c = t.counters
                resident = len(t)
                seen = c.ram_hits + c.ram_misses
                spill_rate, fault_rate = shard.rates(t.spec.name)
                tables.append(
                    pb.TableStats(
                        name=t.spec.name,
                        dim=t.dim,
                        rows=resident + t.spilled,
                        memory_bytes=t.memory_bytes(),
                        lookups=c.lookups,
                        pushes=c.pushes,
                        rows_created=c.rows_created,
                        resident_rows=resident,
                        spilled_rows=t.spilled,
                        bytes_per_resident_row=t.bytes_per_row,
                        ram_hits=c.ram_hits,
                        ram_misses=c.ram_misses,
                        ram_hit_rate=c.ram_hits / seen if seen else 1.0,
                        rows_spilled=c.rows_spilled,
                        rows_faulted_in=c.rows_faulted_in,
                        spill_rows_per_s=spill_rate,
                        fault_in_rows_per_s=fault_rate,
                        lookups_not_admitted=c.lookups_not_admitted,
                        pushes_dropped=c.pushes_dropped,
                        rows_expired=c.rows_expired,
                        rows_evicted_rare=c.rows_evicted_rare,
                        admission_bytes=t.admission_bytes(),
                        rows_written=c.rows_written,
                    )
                )
            return pb.StatsResponse(
                shard=shard.index,
                num_shards=shard.num_shards,
                mode=shard.mode,
                uptime_s=time.monotonic() - shard.started,
                tables=tables,
                duplicate_pushes=shard.duplicate_pushes(),
                memory_budget_bytes=shard.memory_budget_bytes,
                resident_bytes=shard.resident_bytes(),
                durability=str(shard.durability) if shard.storage is not None else "",
                writable=shard.writable,
                storage_error=shard.storage_error,
                last_durable_unix_s=shard.last_durable if shard.storage is not None else 0.0,
            )
        raise AssertionError("unreachable: status_boundary aborts")

    def Checkpoint(self, request: bytes, context: grpc.ServicerContext) -> pb.CheckpointResponse:
        with status_boundary(context, "Checkpoint"):
            msg = pb.CheckpointRequest.FromString(request)
            self._shard.check_request(0)  # refuses while shutting down
            path, manifest = self._shard.checkpoint(msg.path or None)
            return pb.CheckpointResponse(path=str(path), manifest_json=json.dumps(manifest, sort_keys=True))
        raise AssertionError("unreachable: status_boundary aborts")
