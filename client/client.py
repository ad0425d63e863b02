"""``PSClient``: create tables, look rows up and push gradients on a sharded cluster.

Example (needs running shards, see the README):
    with PSClient(["127.0.0.1:50051", "127.0.0.1:50052"]) as ps:
        ps.create_table("user", dim=16, optimizer="adagrad", lr=0.05)
        rows = ps.lookup("user", np.array([1, 2, 1]))        # [3, 16] float32
        ps.push("user", np.array([1, 2]), np.ones((2, 16), np.float32))

    # Serving replicas: two copies of shard 0, one of shard 1; reads only.
    with PSClient([["10.0.0.1:50051", "10.0.0.2:50051"], "10.0.0.3:50051"]) as ps:
        result = ps.lookup_many({"user": keys}, degrade=True, deadline_s=0.05)
        result["user"], result.degraded                      # rows; shards answered with zeros
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from client.admin import AdminClient
from client.batching import sum_duplicates
from client.cluster import ClusterView
from client.config import ClientConfig, TableConfig
from client.errors import InvalidRequestError, TableNotFoundError
from client.link import Budget, ClusterLink
from client.lookups import encode_lookups, fill_results
from client.membership import members_of
from client.pushes import PushPart, encode_part, reroute, split_push
from client.retry import Answer, Rerouted
from client.routing import TablePlan, plan_table
from client.tables import table_config, table_spec
from client.transport import Transport
from protos import ps_pb2 as pb
from protos import wire

__all__ = ["LookupResult", "PSClient", "PushResult"]

_DTYPES = {"float32": wire.FLOAT32, "float16": wire.FLOAT16, "bfloat16": wire.BFLOAT16}
_WRITES = frozenset({"CreateTable", "Push", "Checkpoint", "LoadCheckpoint", "Publish"})
_READS = frozenset({"Lookup", "ListTables"})  # may be hedged
F32 = npt.NDArray[np.float32]
Keys = npt.ArrayLike | TablePlan  # keys, or a plan of them made by PSClient.plan
_MAX_MAP_CHANGES = 8  # of the cluster map during one call, before it gives up

log = logging.getLogger(__name__)


class LookupResult(dict[str, F32]):
    """``lookup_many``'s rows by table, and ``degraded``: the indices of the shards
    (sorted) whose keys got default rows (zeros) because the shard had not answered by
    the deadline (``degrade=True``; empty when every shard answered). ``publications``:
    the publications the rows are of, sorted (serving shards started with
    ``--published-only`` name theirs; "" stands for any other shard, or one before its
    first publication)."""

    def __init__(self, rows: Mapping[str, F32], degraded: Sequence[int] = (), publications: Sequence[str] = ()) -> None:
        super().__init__(rows)
        self.degraded: tuple[int, ...] = tuple(sorted(set(degraded)))
        self.publications: tuple[str, ...] = tuple(sorted(set(publications)))


@dataclass(frozen=True)
class PushResult:
    """What a push did: distinct rows updated, and shard requests found already applied."""

    rows_updated: int
    duplicates: int = 0


def _as_keys(keys: npt.ArrayLike, table: str) -> npt.NDArray[np.int64]:
    try:
        return wire.as_keys(keys, f"table {table!r}: keys")
    except wire.InvalidKeys as exc:
        raise InvalidRequestError(str(exc)) from None


def _client_id(client_id: str | None) -> str:
    """``client_id`` checked (1-128 printable ASCII characters), or a new random one."""
    if client_id is None:
        return uuid.uuid4().hex
    if not (
        isinstance(client_id, str) and 0 < len(client_id) <= 128 and client_id.isprintable() and client_id.isascii()
    ):
        raise ValueError(f"client_id={client_id!r}: must be 1 to 128 printable ASCII characters")
    return client_id


class PSClient:
    """A client of one cluster; ``addresses[i]`` is shard ``i``: ``"HOST:PORT"``, or a list
    of them for a shard served by several replicas (``parse_addresses`` reads
    ``h:1+h:2,h:3`` from a command line).

    ``PSClient`` is the data path: tables created, rows looked up, gradients pushed.
    Operating the cluster (its tables, stats, checkpoints, serving pins) is ``admin``'s,
    an ``AdminClient`` over the same connections.

    Replicas are read-only serving copies: reads (``lookup``) go to one in-service
    replica per shard, the one with the fewest calls in flight; a retry goes to another
    replica; failing replicas are ejected and probed back, and slow reads may be hedged
    (see ``ClientConfig``). Writes (``push``, ``create_table``, ``admin.checkpoint``) to
    a shard with several replicas raise ``InvalidRequestError``. With one address per
    shard (a training cluster) none of this changes anything.

    The constructor does no I/O; channels open on ``start()``, ``with``, or first use.
    Thread-safe: many threads may call one client. Every call blocks until all shards
    answered (``push_async`` returns a ``concurrent.futures.Future`` instead) and
    raises a ``client.errors.PSError`` subclass on failure. Returned arrays are new
    and belong to the caller; input arrays are not modified or kept.

    ``client_id`` names this client's pushes for exactly-once (see ``push_many``): by
    default a new random id; a process that takes over another's pushes (a trainer
    resumed from its checkpoint) passes the same one.

    Attributes: ``replicas[s]``, shard ``s``'s addresses; ``addresses``, all of them in
    that order (one per shard without replicas; the order of ``admin.stats()``).
    """

    def __init__(
        self,
        addresses: Sequence[str | Sequence[str]] | None = None,
        config: ClientConfig | None = None,
        *,
        addresses_file: str | os.PathLike[str] | None = None,
        transport: Transport | None = None,
        client_id: str | None = None,
    ) -> None:
        members = members_of(addresses, addresses_file)
        self.config = config = config or ClientConfig()
        self.client_id = _client_id(client_id)
        self._link = ClusterLink(members, config, transport=transport)
        self._admin = AdminClient(link=self._link)
        self._dtype: Any = _DTYPES[self.config.transport_dtype]  # a wire DType number
        self._tables: dict[str, TableConfig] = {}
        self._seqs: dict[str, Iterator[int]] = {}  # each table's push numbers (``push_many``)
        self._lock = threading.Lock()
        self._started = False
        self._pool: ThreadPoolExecutor | None = None

    # -- the cluster as routed now ----------------------------------------------------
    @property
    def replicas(self) -> list[tuple[str, ...]]:
        """Each shard's addresses, in shard order (of the current cluster map)."""
        return list(self._link.view.replicas)

    @property
    def addresses(self) -> list[str]:
        """Every replica's address, shard by shard (one per shard without replicas)."""
        return self._link.view.addresses

    @property
    def num_shards(self) -> int:
        return self._link.view.num_shards

    @property
    def epoch(self) -> int:
        """The epoch of the cluster map this client routes by: 0 until a live reshard
        (``ps-admin scale``) moves the cluster on, which the client learns from a shard."""
        return self._link.view.epoch

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> PSClient:
        """Open the channels (idempotent)."""
        with self._lock:
            if not self._started:
                if self.config.tune_malloc:
                    wire.tune_malloc()
                self._link.start()
                self._pool = ThreadPoolExecutor(self.config.push_threads, thread_name_prefix="ps-push")
                self._started = True
        return self

    def close(self) -> None:
        """Wait for pending async pushes, then close the channels."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            self._admin.close()
            self._link.close()
            self._started = False

    @property
    def admin(self) -> AdminClient:
        """The cluster's tables, stats, checkpoints and serving pins, over this client's own
        link (``client.admin.AdminClient``)."""
        return self._admin

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
        serving_default: str | None = None,
        storage_dtype: str = "float32",
        state_dtype: str = "float32",
        **params: float,
    ) -> TableConfig:
        """Create ``name`` on every shard (idempotent for an identical spec).

        ``optimizer``: sgd (default), adagrad, adam, ftrl or rowwise_adagrad; ``initializer``: uniform
        (default), normal, zeros or constant; ``params``: hyper-parameters by name
        (lr, weight_decay, eps, initial_accumulator_value, beta1, beta2, l1, l2,
        lr_power, beta; low, high, mean, std, value) and feature-lifecycle rules
        (admit_after, admit_probability, ttl_seconds, evict_below_frequency: see
        ``Lifecycle`` in protos/ps.proto); ``serving_default``: what serving shards read
        for a key without a row, zeros (default) or initial (the row training would have
        created); ``storage_dtype``: how the shards store the rows' values, float32
        (default), bfloat16 or float16, and ``state_dtype`` their optimizer state, float32
        (default) or bfloat16 (16-bit rows are updated in float32 and rounded
        stochastically: see ps/store/precision.py). Anything not given takes the shard's
        default. Raises ``TypeError`` for an unknown option, ``InvalidRequestError`` for
        a bad value, ``TableExistsError`` if the name exists with another spec (the
        message names each difference).
        """
        spec = table_spec(
            name,
            dim,
            optimizer=optimizer,
            initializer=initializer,
            seed=seed,
            serving_default=serving_default,
            storage_dtype=storage_dtype,
            state_dtype=state_dtype,
            **params,
        )
        request = pb.CreateTableRequest(spec=spec).SerializeToString()
        replies = self._link.call("CreateTable", [(s, request) for s in range(self.num_shards)])
        with self._link.reply("CreateTable", 0, replies[0].endpoint):
            table = table_config(pb.CreateTableResponse.FromString(replies[0].data).spec)
        self._tables[name] = table
        return table

    # -- lookup ---------------------------------------------------------------------
    @overload
    def lookup(
        self,
        table: str,
        keys: npt.ArrayLike,
        *,
        out: F32 | None = None,
        deadline_s: float | None = None,
        degrade: Literal[False] = False,
    ) -> F32: ...
    @overload
    def lookup(
        self,
        table: str,
        keys: npt.ArrayLike,
        *,
        out: F32 | None = None,
        deadline_s: float | None = None,
        degrade: Literal[True],
    ) -> tuple[F32, tuple[int, ...]]: ...
    @overload
    def lookup(
        self, table: str, keys: npt.ArrayLike, *, out: F32 | None = None, deadline_s: float | None = None, degrade: bool
    ) -> F32 | tuple[F32, tuple[int, ...]]: ...
    def lookup(
        self,
        table: str,
        keys: npt.ArrayLike,
        *,
        out: F32 | None = None,
        deadline_s: float | None = None,
        degrade: bool = False,
    ) -> F32 | tuple[F32, tuple[int, ...]]:
        """Rows of ``keys`` (any integer 1-D array, duplicates allowed) as ``[len(keys), dim]`` float32.

        In a training cluster, missing keys are created with their initial rows.
        ``out``, if given, is a C-contiguous float32 array of that shape to fill.
        ``deadline_s`` replaces ``ClientConfig.deadline_s`` for this call. With
        ``degrade=True`` it returns ``(rows, degraded)``: see ``lookup_many``.
        """
        rows, degraded = self._lookup({table: keys}, {table: out} if out is not None else None, deadline_s, degrade)
        return (rows[table], tuple(sorted(set(degraded)))) if degrade else rows[table]

    @overload
    def lookup_many(
        self,
        requests: Mapping[str, Keys],
        *,
        out: Mapping[str, F32] | None = None,
        deadline_s: float | None = None,
        degrade: Literal[False] = False,
    ) -> dict[str, F32]: ...
    @overload
    def lookup_many(
        self,
        requests: Mapping[str, Keys],
        *,
        out: Mapping[str, F32] | None = None,
        deadline_s: float | None = None,
        degrade: Literal[True],
    ) -> LookupResult: ...
    @overload
    def lookup_many(
        self,
        requests: Mapping[str, Keys],
        *,
        out: Mapping[str, F32] | None = None,
        deadline_s: float | None = None,
        degrade: bool,
    ) -> dict[str, F32]: ...
    def lookup_many(
        self,
        requests: Mapping[str, Keys],
        *,
        out: Mapping[str, F32] | None = None,
        deadline_s: float | None = None,
        degrade: bool = False,
    ) -> dict[str, F32]:
        """``lookup`` for several tables at once: one RPC per shard carries all of them.

        ``deadline_s`` replaces ``ClientConfig.deadline_s`` for this call (finding an
        unknown table's dim included). With ``degrade=True``, a shard that has not
        answered by then (or has used up ``max_attempts``) gives its keys default rows
        (zeros) instead of raising, and the result is a ``LookupResult``: the same dict,
        plus ``degraded``, the indices of those shards. Statuses that are not retried
        (``InvalidRequestError``, ``TableNotFoundError``...) raise either way.
        """
        publications: set[str] = set()
        rows, degraded = self._lookup(requests, out, deadline_s, degrade, publications)
        return LookupResult(rows, degraded, sorted(publications))

    def _lookup(
        self,
        requests: Mapping[str, Keys],
        out: Mapping[str, F32] | None,
        deadline_s: float | None,
        degrade: bool,
        publications: set[str] | None = None,
    ) -> tuple[dict[str, F32], list[int]]:
        """Rows by table, and the shards that degraded (with repeats); the publications
        the rows are of go into ``publications``."""
        if not self._started:
            self.start()
        budget = self._link.budget(deadline_s)
        dims = {t: self._dim(t, budget) for t in requests}
        results: dict[str, F32] = {}
        for t, k in requests.items():
            n = (k.keys if isinstance(k, TablePlan) else _as_keys(k, t)).shape[0]
            buf = (out or {}).get(t)
            if buf is None:
                buf = np.empty((n, dims[t]), dtype=np.float32)
            elif buf.shape != (n, dims[t]) or buf.dtype != np.float32 or not buf.flags.c_contiguous:
                raise InvalidRequestError(
                    f"table {t!r}: out is {buf.dtype}{list(buf.shape)}, expected C-contiguous float32[{n}, {dims[t]}]"
                )
            results[t] = buf
        itemsize = wire.dtype_itemsize(self._dtype)

        def attempt(view: ClusterView) -> tuple[dict[str, F32], list[int]] | Rerouted:
            plans = [self._plan_of(t, k, dims[t], view.num_shards) for t, k in requests.items()]
            flat, encoded = encode_lookups(
                plans, view.num_shards, view.epoch, self._dtype, itemsize, self.config.max_message_bytes
            )
            replies = self._link.send("Lookup", encoded, budget, degrade=degrade, view=view)
            moved = next((r for r in replies if isinstance(r, Rerouted)), None)
            if moved is not None:  # the cluster changed: route every key again
                return moved
            answers = [r if isinstance(r, Answer) else None for r in replies]
            decoding = functools.partial(self._link.reply, "Lookup", view=view)
            if publications is not None:
                publications.clear()  # of this attempt only
            return results, fill_results(results, flat, answers, view.num_shards, decoding, publications)

        return self._link.routed("Lookup", budget, attempt)

    # -- push -----------------------------------------------------------------------
    def push(self, table: str, keys: npt.ArrayLike, grads: npt.ArrayLike, *, seq: int | None = None) -> PushResult:
        """Apply ``grads[i]`` (``[len(keys), dim]``) to the row of ``keys[i]`` with the table's optimizer.

        Gradients of duplicate keys are summed first. Retried pushes are applied once.
        If it raises, the push may have been applied on some shards and not others.
        ``seq``: see ``push_many``.
        """
        return self.push_many({table: (keys, grads)}, seq=seq)

    def push_many(self, updates: Mapping[str, tuple[Keys, npt.ArrayLike]], *, seq: int | None = None) -> PushResult:
        """``push`` for several tables at once: one RPC per shard carries all of them.

        Exactly-once: each table's push is numbered for this client (``client_id``), and
        a shard applies each ``(client_id, table, seq)`` at most once, so a push retried
        after a lost answer, or sent again by another process with the same
        ``client_id``, is not applied twice. By default the client numbers each table's
        pushes 1, 2, 3, ...; ``seq`` (>= 1) gives this call's number to every table
        instead: a trainer resumed from a checkpoint sends its steps again with the seqs
        they had, and the shards skip what they applied before. The caller then numbers
        each table's pushes without gaps (every seq of a ``client_id`` is pushed once,
        from whichever process) and keeps each within one message per shard.

        Every shard gets a request for every push, with an entry per table (empty where
        it holds none of the keys): each shard's record of applied seqs stays a
        watermark, and a push never needs more than one request per shard and table.
        """
        if seq is not None and not (isinstance(seq, int) and not isinstance(seq, bool) and 1 <= seq < 1 << 64):
            raise InvalidRequestError(f"seq={seq!r}: must be an integer in [1, 2**64)")
        if not self._started:
            self.start()
        budget = self._link.budget()
        itemsize = wire.dtype_itemsize(self._dtype)
        replies: list[pb.PushResponse] = []
        parts: list[PushPart] | None = None
        moved: list[PushPart] = []

        def attempt(view: ClusterView) -> PushResult | Rerouted:
            nonlocal parts, moved
            if parts is None:  # planned by the first map; later, only the refused parts go again
                parts = self._push_parts(updates, view, seq, itemsize)
            else:  # each refused part goes to its keys' new owners, saying where it was first planned
                parts = [q for part in moved for q in reroute(part, view.num_shards)]
            if not parts:
                return PushResult(rows_updated=0)
            encoded = [
                (p.shard, encode_part(p, view.num_shards, view.epoch, self.client_id, self._dtype)) for p in parts
            ]
            moved, rerouted = [], None
            for part, (s, _), answer in zip(parts, encoded, self._link.send("Push", encoded, budget, view=view)):
                if isinstance(answer, Rerouted):
                    moved.append(part)
                    rerouted = rerouted or answer
                elif answer is not None:
                    with self._link.reply("Push", s, answer.endpoint, view):
                        replies.append(pb.PushResponse.FromString(answer.data))
            if rerouted is not None:
                return rerouted
            return PushResult(
                rows_updated=sum(r.rows_updated for r in replies), duplicates=sum(not r.applied for r in replies)
            )

        return self._link.routed("Push", budget, attempt)

    def _push_parts(
        self, updates: Mapping[str, tuple[Keys, npt.ArrayLike]], view: ClusterView, seq: int | None, itemsize: int
    ) -> list[PushPart]:
        """The per-shard parts of a push, planned by ``view``'s map (checks the gradients)."""
        prepared = []
        for table, (keys, grads) in updates.items():
            k = keys.keys if isinstance(keys, TablePlan) else _as_keys(keys, table)
            g = np.asarray(grads)
            if g.ndim != 2 or g.shape[0] != k.shape[0]:
                raise InvalidRequestError(f"table {table!r}: grads shape {g.shape}, expected ({k.shape[0]}, dim)")
            if g.dtype.kind != "f":
                raise InvalidRequestError(f"table {table!r}: grads dtype {g.dtype}, expected a float dtype")
            g = np.ascontiguousarray(g, dtype=np.float32)
            plan = self._plan_of(table, keys if isinstance(keys, TablePlan) else k, g.shape[1], view.num_shards)
            if plan.has_duplicates:
                g = sum_duplicates(g, plan.inverse, plan.unique.shape[0])
            if seq is not None or k.shape[0]:  # numbered by the client: a table without keys takes no number
                prepared.append((plan, g))
        if not prepared:
            return []
        max_bytes = self.config.max_message_bytes
        return split_push(prepared, view.num_shards, view.epoch, max_bytes, itemsize, self._next_seq, seq)

    def _next_seq(self, table: str) -> int:
        with self._lock:
            counter = self._seqs.get(table)
            if counter is None:
                counter = self._seqs[table] = itertools.count(1)
            return next(counter)

    def push_async(
        self, table: str, keys: npt.ArrayLike, grads: npt.ArrayLike, *, seq: int | None = None
    ) -> Future[PushResult]:
        """``push`` on a background thread; the inputs are copied first, so callers may reuse them."""
        return self.push_many_async({table: (keys, grads)}, seq=seq)

    def push_many_async(
        self, updates: Mapping[str, tuple[Keys, npt.ArrayLike]], *, seq: int | None = None
    ) -> Future[PushResult]:
        """``push_many`` on a background thread; the ``Future`` raises what ``push_many`` would."""
        self.start()
        copied = {
            t: (k if isinstance(k, TablePlan) else np.array(k, copy=True), np.array(g, copy=True))
            for t, (k, g) in updates.items()
        }
        assert self._pool is not None
        return self._pool.submit(self.push_many, copied, seq=seq)

    def plan(self, table: str, keys: npt.ArrayLike, *, deadline_s: float | None = None) -> TablePlan:
        """``keys`` of ``table`` deduplicated and routed to shards once, for several calls:
        ``lookup_many`` and ``push_many`` take the plan where they take keys (a training
        step looks up, then pushes, the same keys). ``plan.keys`` are ``keys``; the plan
        is immutable and routed for the cluster's size when it was made (a call given a
        plan for another size, after a live reshard, routes its keys again)."""
        return plan_table(
            table, _as_keys(keys, table), self._dim(table, self._link.budget(deadline_s)), self.num_shards
        )

    # -- internals ------------------------------------------------------------------
    def _plan_of(self, table: str, keys: Keys, dim: int, num_shards: int | None = None) -> TablePlan:
        n = self.num_shards if num_shards is None else num_shards
        if not isinstance(keys, TablePlan):
            return plan_table(table, _as_keys(keys, table), dim, n)
        if (keys.table, keys.dim) != (table, dim):
            raise InvalidRequestError(
                f"table {table!r}: a plan made for table {keys.table!r}, dim {keys.dim} does not fit dim {dim}"
            )
        if keys.bounds.shape[0] - 1 != n:  # made before the cluster changed size
            return plan_table(table, keys.keys, dim, n)
        return keys

    def refresh_map(self) -> int:
        """Ask shard 0 for the cluster map now (``GetMap``) and route by it if it is newer
        than the one this client has; returns the epoch routed by. Lookups and pushes do
        this by themselves (on first use, and when a shard says the map moved); call it
        before reading ``num_shards``, ``addresses`` or ``admin.stats()`` of a cluster that
        may have resharded since the addresses were given."""
        return self._link.refresh(self._link.budget())

    def _list_tables(self, budget: Budget) -> dict[str, TableConfig]:
        found = self._link.list_tables(budget)
        self._tables.update(found)
        return found

    def _dim(self, table: str, budget: tuple[ClientConfig, float]) -> int:
        if table not in self._tables:
            self._list_tables(budget)
        try:
            return self._tables[table].dim
        except KeyError:
            known = ", ".join(sorted(self._tables)) or "none"
            raise TableNotFoundError(f"table {table!r} does not exist (tables: {known})") from None
