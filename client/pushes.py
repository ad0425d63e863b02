"""How a push becomes shard requests, and how a part of it is routed again when the
cluster changes under it.

``split_push`` cuts one push (each table's unique keys and summed gradients) into
``PushPart``s: one request per shard and *round*, each table's entry numbered with its
seq (``(client_id, table, seq)`` is applied at most once). Every shard gets a part in
every round, with an entry per table even where it holds none of the keys, so each
shard hears every seq. A push over the message limit for some shard takes several
rounds, each a push of its own.

If a shard refuses a part because the cluster moved to a newer map (a live reshard),
``reroute`` splits that part's keys over the new map's shards; each new part says where
the keys were first planned (``planned``), so the shards apply it once per key against
the records that moved with them (``ps.table.ledger.TableLedgers``).

Example:
    >>> import numpy as np
    >>> from client.routing import plan_table
    >>> plan = plan_table("t", np.array([1, 4, 6]), dim=2, num_shards=2)
    >>> parts = split_push([(plan, np.ones((3, 2), np.float32))], 2, 0, 1 << 20, 4, lambda t: 7)
    >>> [(p.shard, p.planned, [len(e[1]) for e in p.entries]) for p in parts]
    [(0, (0, 0), [1]), (1, (0, 1), [2])]
    >>> [(p.shard, p.planned, len(p.entries[0][1])) for p in reroute(parts[1], 3)]  # 4 stays, 6 moves
    [(1, (0, 1), 1), (2, (0, 1), 1)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from client.errors import InvalidRequestError
from client.routing import Part, TablePlan, pack
from protos import wire
from protos.keys import shard_of

__all__ = ["PushPart", "encode_part", "reroute", "split_push"]

I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]
_NO_KEYS = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class PushPart:
    """One request of a push: for ``shard``, ``(table, keys, grads, seq)`` entries, first
    planned for ``planned = (epoch, shard)``."""

    shard: int
    planned: tuple[int, int]
    entries: list[tuple[str, I64, F32, int]]


def split_push(
    prepared: Sequence[tuple[TablePlan, F32]],
    num_shards: int,
    epoch: int,
    max_message_bytes: int,
    itemsize: int,
    next_seq: Callable[[str], int],
    seq: int | None = None,
) -> list[PushPart]:
    """The parts of one push of ``prepared`` (each table's plan and its gradients, one row
    per unique key) over ``num_shards`` shards of the map of ``epoch``. ``seq``: every
    table's number (one round only: ``InvalidRequestError`` if it does not fit); None:
    ``next_seq(table)`` numbers each table in each round."""
    grads_of = {p.table: g for p, g in prepared}
    per_shard: dict[int, list[list[Part]]] = {}
    for shard_reqs in pack([p for p, _ in prepared], num_shards, lambda p: p.dim * itemsize + 8, max_message_bytes):
        for s, parts in shard_reqs:
            per_shard.setdefault(s, []).append(parts)
    rounds = max((len(r) for r in per_shard.values()), default=1)
    if rounds > 1 and seq is not None:
        raise InvalidRequestError(
            f"push with seq={seq} needs {rounds} requests for one shard (over max_message_bytes="
            f"{max_message_bytes}): push fewer keys per call, or raise max_message_bytes"
        )
    out = []
    for k in range(rounds):
        parts_of: list[dict[str, Part]] = []
        for s in range(num_shards):
            requests = per_shard.get(s, [])
            parts_of.append({part.plan.table: part for part in requests[k]} if k < len(requests) else {})
        tables = [p for p, _ in prepared if k == 0 or any(p.table in parts for parts in parts_of)]
        seqs = {p.table: seq if seq is not None else next_seq(p.table) for p in tables}
        for s in range(num_shards):
            entries = []
            for plan in tables:
                part = parts_of[s].get(plan.table)
                g = grads_of[plan.table]
                if part is None:
                    keys, rows = _NO_KEYS, np.empty((0, plan.dim), np.float32)
                elif num_shards == 1 and part.start == 0 and len(part) == g.shape[0]:
                    keys, rows = part.keys, g
                else:
                    keys, rows = part.keys, g[part.positions]
                entries.append((plan.table, keys, rows, seqs[plan.table]))
            out.append(PushPart(s, (epoch, s), entries))
    return out


def reroute(part: PushPart, num_shards: int) -> list[PushPart]:
    """``part``'s keys routed over a map of ``num_shards`` shards: a part per shard that
    gets some of them, each still ``planned`` where ``part`` was."""
    by_shard: dict[int, list[tuple[str, I64, F32, int]]] = {}
    for table, keys, grads, seq in part.entries:
        if not keys.shape[0]:
            continue
        owners = shard_of(keys, num_shards)
        for s in np.unique(owners).tolist():
            picked = owners == s
            by_shard.setdefault(int(s), []).append((table, keys[picked], grads[picked], seq))
    return [PushPart(s, part.planned, entries) for s, entries in sorted(by_shard.items())]


def encode_part(part: PushPart, num_shards: int, epoch: int, client_id: str, dtype: int) -> bytes:
    """``part`` as ``PushRequest`` bytes, routed by the map of ``epoch`` (``num_shards``)."""
    entries: list[wire.PushEntryParts] = [(t, k, g, dtype, seq) for t, k, g, seq in part.entries]
    planned = None if part.planned == (epoch, part.shard) else part.planned
    return wire.encode_push_request(entries, num_shards, client_id, 0, part.shard, epoch=epoch, planned=planned)
