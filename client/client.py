"""``PSClient``: create tables, look rows up and push gradients on a sharded cluster.

Example (needs running shards, see the README):
    with PSClient(["127.0.0.1:50051", "127.0.0.1:50052"]) as ps:
        ps.create_table("user", dim=16, optimizer="adagrad", lr=0.05)
        rows = ps.lookup("user", np.array([1, 2, 1]))        # [3, 16] float32
        ps.push("user", np.array([1, 2]), np.ones((2, 16), np.float32))
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError, Message

from client.batching import scatter_rows, sum_duplicates
from client.config import ClientConfig, TableConfig
from client.errors import InternalServerError, InvalidRequestError, TableNotFoundError
from client.retry import call_all
from client.routing import pack, plan_table
from client.transport import GrpcTransport, Transport
from protos import ps_pb2 as pb
from protos import wire

__all__ = ["PSClient", "PushResult"]

_DTYPES = {"float32": wire.FLOAT32, "float16": wire.FLOAT16, "bfloat16": wire.BFLOAT16}
_OPTIMIZERS = {k.lower(): v for k, v in pb.OptimizerSpec.Kind.items() if v}
_INITIALIZERS = {k.lower(): v for k, v in pb.InitializerSpec.Kind.items() if v}
_OPT_FIELDS = [f for f in pb.OptimizerSpec.DESCRIPTOR.fields_by_name if f != "kind"]
_INIT_FIELDS = [f for f in pb.InitializerSpec.DESCRIPTOR.fields_by_name if f != "kind"]
_LIFECYCLE_FIELDS: dict[str, Any] = {
    "admit_after": int, "admit_probability": float, "ttl_seconds": float, "evict_below_frequency": int,
}  # fmt: skip


@dataclass(frozen=True)
class PushResult:
    """What a push did: distinct rows updated, and shard requests found already applied."""

    rows_updated: int
    duplicates: int = 0


def _as_dict(msg: Message) -> dict[str, Any]:
    """Every field of ``msg`` (zeros included, integers as ``int``), nested messages as dicts."""
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.message_type is not None:
            value = [_as_dict(v) for v in value] if f.is_repeated else _as_dict(value)
        out[f.name] = value
    return out


def _as_keys(keys: npt.ArrayLike, table: str) -> npt.NDArray[np.int64]:
    try:
        return wire.as_keys(keys, f"table {table!r}: keys")
    except wire.InvalidKeys as exc:
        raise InvalidRequestError(str(exc)) from None


class PSClient:
    """A client of one cluster; ``addresses[i]`` is shard ``i``.

    The constructor does no I/O; channels open on ``start()``, ``with``, or first use.
    Thread-safe: many threads may call one client. Every call blocks until all shards
    answered (``push_async`` returns a ``concurrent.futures.Future`` instead) and
    raises a ``client.errors.PSError`` subclass on failure. Returned arrays are new
    and belong to the caller; input arrays are not modified or kept.
    """

    def __init__(
        self, addresses: Sequence[str], config: ClientConfig | None = None, *, transport: Transport | None = None
    ) -> None:
        if isinstance(addresses, str) or not addresses:
            raise InvalidRequestError("addresses: expected a non-empty list of HOST:PORT, one per shard in shard order")
        self.addresses = list(addresses)
        self.num_shards = len(self.addresses)
        self.config = config or ClientConfig()
        self.client_id = uuid.uuid4().hex
        self._transport = transport or GrpcTransport(
            self.addresses, self.config.max_message_bytes, reconnect_max_s=self.config.backoff_max_s
        )
        self._dtype: Any = _DTYPES[self.config.transport_dtype]  # a wire DType number
        self._tables: dict[str, TableConfig] = {}
        self._seqs = [itertools.count(1) for _ in self.addresses]
        self._lock = threading.Lock()
        self._started = False
        self._pool: ThreadPoolExecutor | None = None

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> PSClient:
        """Open the channels (idempotent)."""
        with self._lock:
            if not self._started:
                if self.config.tune_malloc:
                    wire.tune_malloc()
                self._transport.start()
                self._pool = ThreadPoolExecutor(self.config.push_threads, thread_name_prefix="ps-push")
                self._started = True
        return self

    def close(self) -> None:
        """Wait for pending async pushes, then close the channels."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            if self._started:
                self._transport.close()
                self._started = False

    def __enter__(self) -> PSClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tables ---------------------------------------------------------------------
    def create_table(
        self,
        name: str,
        dim: int,
        *,
        optimizer: str | None = None,
        initializer: str | None = None,
        seed: int = 0,
        **params: float,
    ) -> TableConfig:
        """Create ``name`` on every shard (idempotent for an identical spec).

        ``optimizer``: sgd (default), adagrad, adam or ftrl; ``initializer``: uniform
        (default), normal, zeros or constant; ``params``: hyper-parameters by name
        (lr, weight_decay, eps, initial_accumulator_value, beta1, beta2, l1, l2,
        lr_power, beta; low, high, mean, std, value) and feature-lifecycle rules
        (admit_after, admit_probability, ttl_seconds, evict_below_frequency: see
        ``Lifecycle`` in protos/ps.proto). Anything not given takes the shard's default. Raises ``TypeError`` for an unknown option,
        ``InvalidRequestError`` for a bad value, ``TableExistsError`` if the name
        exists with another spec (the message names each difference).
        """
        spec = pb.TableSpec(name=name, dim=dim, seed=seed)
        if optimizer is not None:
            spec.optimizer.kind = self._choice("optimizer", optimizer, _OPTIMIZERS)  # type: ignore[assignment]
        if initializer is not None:
            spec.initializer.kind = self._choice("initializer", initializer, _INITIALIZERS)  # type: ignore[assignment]
        for key, value in params.items():
            if key in _OPT_FIELDS:
                setattr(spec.optimizer, key, float(value))
            elif key in _INIT_FIELDS:
                setattr(spec.initializer, key, float(value))
            elif key in _LIFECYCLE_FIELDS:
                setattr(spec.lifecycle, key, _LIFECYCLE_FIELDS[key](value))
            else:
                valid = ", ".join((*_OPT_FIELDS, *_INIT_FIELDS, *_LIFECYCLE_FIELDS))
                raise TypeError(f"create_table: unknown option {key!r}; valid: {valid}")
        request = pb.CreateTableRequest(spec=spec).SerializeToString()
        replies = self._call("CreateTable", [(s, request) for s in range(self.num_shards)])
        with self._reply("CreateTable", 0):
            table = self._table_config(pb.CreateTableResponse.FromString(replies[0]).spec)
        self._tables[name] = table
        return table

    def tables(self) -> dict[str, TableConfig]:
        """Every table of the cluster (as shard 0 reports them), by name."""
        data = self._call("ListTables", [(0, b"")])[0]
        with self._reply("ListTables", 0):
            reply = pb.ListTablesResponse.FromString(data)
        found = {t.name: self._table_config(t) for t in reply.tables}
        self._tables.update(found)
        return found

    def stats(self) -> list[dict[str, Any]]:
        """Each shard's ``Stats`` as a dict, in shard order."""
        replies = self._call("Stats", [(s, b"") for s in range(self.num_shards)])
        out = []
        for s, r in enumerate(replies):
            with self._reply("Stats", s):
                out.append(_as_dict(pb.StatsResponse.FromString(r)))
        return out

    def checkpoint(
        self, paths: Sequence[str] | None = None, *, deadline_s: float | None = None
    ) -> list[dict[str, Any]]:
        """Have every shard write a checkpoint of itself, all in parallel; blocks until all are done.

        ``paths[i]`` is the directory shard ``i`` creates (relative paths resolve under that
        shard's ``--checkpoint-root``; None: the root's next version number). Returns, in
        shard order, ``{"path": the directory written, "manifest": its manifest.json}``.
        Not retried (a checkpoint whose answer was lost has still been written); raises
        the first failing shard's ``PSError``, e.g. ``InvalidRequestError`` for a path
        outside the shard's checkpoint root.
        """
        if paths is not None and len(paths) != self.num_shards:
            raise InvalidRequestError(f"paths: {len(paths)} given for {self.num_shards} shards")
        requests = [
            (s, pb.CheckpointRequest(path="" if paths is None else str(paths[s])).SerializeToString())
            for s in range(self.num_shards)
        ]
        config = dataclasses.replace(self.config, max_attempts=1)
        replies = self._call("Checkpoint", requests, deadline_s=deadline_s, config=config)
        out = []
        for s, data in enumerate(replies):
            with self._reply("Checkpoint", s):
                reply = pb.CheckpointResponse.FromString(data)
                out.append({"path": reply.path, "manifest": json.loads(reply.manifest_json or "{}")})
        return out

    # -- lookup ---------------------------------------------------------------------
    def lookup(
        self, table: str, keys: npt.ArrayLike, *, out: npt.NDArray[np.float32] | None = None
    ) -> npt.NDArray[np.float32]:
        """Rows of ``keys`` (any integer 1-D array, duplicates allowed) as ``[len(keys), dim]`` float32.

        In a training cluster, missing keys are created with their initial rows.
        ``out``, if given, is a C-contiguous float32 array of that shape to fill.
        """
        return self.lookup_many({table: keys}, out={table: out} if out is not None else None)[table]

    def lookup_many(
        self,
        requests: Mapping[str, npt.ArrayLike],
        *,
        out: Mapping[str, npt.NDArray[np.float32]] | None = None,
    ) -> dict[str, npt.NDArray[np.float32]]:
        """``lookup`` for several tables at once: one RPC per shard carries all of them."""
        plans = [plan_table(t, _as_keys(k, t), self._dim(t), self.num_shards) for t, k in requests.items()]
        results: dict[str, npt.NDArray[np.float32]] = {}
        for p in plans:
            buf = (out or {}).get(p.table)
            if buf is None:
                buf = np.empty((p.keys.shape[0], p.dim), dtype=np.float32)
            elif buf.shape != (p.keys.shape[0], p.dim) or buf.dtype != np.float32 or not buf.flags.c_contiguous:
                raise InvalidRequestError(
                    f"table {p.table!r}: out is {buf.dtype}{list(buf.shape)}, expected C-contiguous "
                    f"float32[{p.keys.shape[0]}, {p.dim}]"
                )
            results[p.table] = buf
        itemsize = wire.dtype_itemsize(self._dtype)
        batches = pack(plans, self.num_shards, lambda p: p.dim * itemsize + 8, self.config.max_message_bytes)
        flat = [req for shard_reqs in batches for req in shard_reqs]
        encoded = [
            (
                s,
                pb.LookupRequest(
                    entries=[
                        pb.LookupEntry(table=x.plan.table, keys=wire.encode_keys(x.keys), dtype=self._dtype)
                        for x in parts
                    ],
                    num_shards=self.num_shards,
                    shard=s,
                ).SerializeToString(),
            )
            for s, parts in flat
        ]
        replies = self._call("Lookup", encoded)
        # Rows of tables with duplicate keys land in a unique-row buffer first, then fan out.
        unique_rows = {
            p.table: np.empty((p.unique.shape[0], p.dim), dtype=np.float32) for p in plans if p.has_duplicates
        }
        for (s, parts), reply in zip(flat, replies):
            with self._reply("Lookup", s):
                decoded = wire.decode_lookup_response(reply)
                if len(decoded) != len(parts):
                    raise wire.WireFormatError(f"{len(decoded)} results for {len(parts)} tables")
            for part, res in zip(parts, decoded):
                field = f"results[{part.plan.table!r}]"
                with self._reply("Lookup", s):
                    rows = wire.decode_rows(res.rows, len(part), part.plan.dim, res.dtype, field)
                target = unique_rows.get(part.plan.table, results[part.plan.table])
                if self.num_shards == 1:
                    # One shard: the routing order is the identity, so a block copy will do.
                    np.copyto(target[part.start : part.stop], rows)
                else:
                    scatter_rows(target, rows, part.positions, np.arange(len(part), dtype=np.int64))
        for p in plans:
            if p.has_duplicates:
                np.take(unique_rows[p.table], p.inverse, axis=0, out=results[p.table])
        return results

    # -- push -----------------------------------------------------------------------
    def push(self, table: str, keys: npt.ArrayLike, grads: npt.ArrayLike) -> PushResult:
        """Apply ``grads[i]`` (``[len(keys), dim]``) to the row of ``keys[i]`` with the table's optimizer.

        Gradients of duplicate keys are summed first. Retried pushes are applied once.
        If it raises, the push may have been applied on some shards and not others.
        """
        return self.push_many({table: (keys, grads)})

    def push_many(self, updates: Mapping[str, tuple[npt.ArrayLike, npt.ArrayLike]]) -> PushResult:
        """``push`` for several tables at once: one RPC per shard carries all of them."""
        prepared = []
        for table, (keys, grads) in updates.items():
            k = _as_keys(keys, table)
            g = np.asarray(grads)
            if g.ndim != 2 or g.shape[0] != k.shape[0]:
                raise InvalidRequestError(f"table {table!r}: grads shape {g.shape}, expected ({k.shape[0]}, dim)")
            if g.dtype.kind != "f":
                raise InvalidRequestError(f"table {table!r}: grads dtype {g.dtype}, expected a float dtype")
            g = np.ascontiguousarray(g, dtype=np.float32)
            plan = plan_table(table, k, g.shape[1], self.num_shards)
            if plan.has_duplicates:
                g = sum_duplicates(g, plan.inverse, plan.unique.shape[0])
            prepared.append((plan, g))
        grads_of: dict[str, npt.NDArray[np.float32]] = {p.table: g for p, g in prepared}
        itemsize = wire.dtype_itemsize(self._dtype)
        batches = pack([p for p, _ in prepared], self.num_shards, lambda p: p.dim * itemsize + 8,
                       self.config.max_message_bytes)  # fmt: skip
        encoded = []
        for shard_reqs in batches:
            for s, parts in shard_reqs:
                entries = []
                for part in parts:
                    g = grads_of[part.plan.table]
                    whole = self.num_shards == 1 and part.start == 0 and len(part) == g.shape[0]
                    entries.append((part.plan.table, part.keys, g if whole else g[part.positions], self._dtype))
                seq = next(self._seqs[s])
                encoded.append((s, wire.encode_push_request(entries, self.num_shards, self.client_id, seq, s)))
        replies = []
        for (s, _), data in zip(encoded, self._call("Push", encoded)):
            with self._reply("Push", s):
                replies.append(pb.PushResponse.FromString(data))
        return PushResult(
            rows_updated=sum(r.rows_updated for r in replies), duplicates=sum(not r.applied for r in replies)
        )

    def push_async(self, table: str, keys: npt.ArrayLike, grads: npt.ArrayLike) -> Future[PushResult]:
        """``push`` on a background thread; the inputs are copied first, so callers may reuse them."""
        return self.push_many_async({table: (keys, grads)})

    def push_many_async(self, updates: Mapping[str, tuple[npt.ArrayLike, npt.ArrayLike]]) -> Future[PushResult]:
        """``push_many`` on a background thread; the ``Future`` raises what ``push_many`` would."""
        self.start()
        copied = {t: (np.array(k, copy=True), np.array(g, copy=True)) for t, (k, g) in updates.items()}
        assert self._pool is not None
        return self._pool.submit(self.push_many, copied)

    # -- internals ------------------------------------------------------------------
    def _call(
        self,
        method: str,
        requests: list[tuple[int, bytes]],
        *,
        deadline_s: float | None = None,
        config: ClientConfig | None = None,
    ) -> list[bytes]:
        if not self._started:
            self.start()
        config = config or self.config
        if deadline_s is not None:  # this call's own deadline, for every attempt too
            config = dataclasses.replace(config, deadline_s=deadline_s, attempt_timeout_s=None)
        deadline = time.monotonic() + config.deadline_s
        return call_all(self._transport, method, requests, config, deadline)

    @contextlib.contextmanager
    def _reply(self, method: str, shard: int) -> Iterator[None]:
        """Turn an undecodable reply of ``shard`` into ``InternalServerError``."""
        try:
            yield
        except (wire.WireFormatError, DecodeError, json.JSONDecodeError) as exc:
            raise InternalServerError(
                f"shard {shard} ({self.addresses[shard]}): {method} reply does not decode ({exc}); "
                "is that address a ps-server of this version?",
                shard=shard,
            ) from exc

    def _dim(self, table: str) -> int:
        if table not in self._tables:
            self.tables()
        try:
            return self._tables[table].dim
        except KeyError:
            known = ", ".join(sorted(self._tables)) or "none"
            raise TableNotFoundError(f"table {table!r} does not exist (tables: {known})") from None

    @staticmethod
    def _choice(field: str, value: str, choices: Mapping[str, int]) -> int:
        try:
            return choices[value.lower()]
        except KeyError:
            raise InvalidRequestError(f"{field}={value!r}: expected one of {', '.join(choices)}") from None

    @staticmethod
    def _table_config(spec: pb.TableSpec) -> TableConfig:
        return TableConfig(
            name=spec.name,
            dim=spec.dim,
            seed=spec.seed,
            initializer=pb.InitializerSpec.Kind.Name(spec.initializer.kind).lower(),
            optimizer=pb.OptimizerSpec.Kind.Name(spec.optimizer.kind).lower(),
            initializer_params={f: getattr(spec.initializer, f) for f in _INIT_FIELDS},
            optimizer_params={f: getattr(spec.optimizer, f) for f in _OPT_FIELDS},
        )
