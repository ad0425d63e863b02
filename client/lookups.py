"""How a lookup becomes shard requests, and how the answers fill the caller's arrays.

``encode_lookups`` routes each table's unique keys (``client.routing``) and cuts them
into requests under the message limit, usually one per shard carrying every table;
``fill_results`` copies each shard's rows back to every position that asked for them
(a shard that did not answer in time gives its keys zeros, with ``degrade``).

Example:
    >>> import numpy as np
    >>> from client.routing import plan_table
    >>> plan = plan_table("t", np.array([5, 6, 5]), dim=2, num_shards=2)
    >>> flat, encoded = encode_lookups([plan], 2, 0, wire.FLOAT32, 4, 1 << 20)
    >>> [s for s, _ in flat] == [s for s, _ in encoded]
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from client.batching import fill_rows
from client.retry import Answer
from client.routing import Part, TablePlan, pack
from protos import wire

__all__ = ["encode_lookups", "fill_results"]

F32 = npt.NDArray[np.float32]


def encode_lookups(
    plans: Sequence[TablePlan], num_shards: int, epoch: int, dtype: int, itemsize: int, max_message_bytes: int
) -> tuple[list[tuple[int, list[Part]]], list[tuple[int, bytes]]]:
    """``(requests as parts, requests as bytes)``, in the same order: each ``(shard, ...)``,
    routed by the cluster map of ``epoch`` (``num_shards`` shards), rows asked in ``dtype``."""
    batches = pack(plans, num_shards, lambda p: p.dim * itemsize + 8, max_message_bytes)
    flat = [req for shard_reqs in batches for req in shard_reqs]
    encoded = [
        (s, wire.encode_lookup_request([(x.plan.table, x.keys) for x in parts], dtype, num_shards, s, epoch=epoch))
        for s, parts in flat
    ]
    return flat, encoded


def fill_results(
    results: dict[str, F32],
    flat: Sequence[tuple[int, list[Part]]],
    replies: Sequence[Answer | None],
    num_shards: int,
    decoding: Callable[[int, int], contextlib.AbstractContextManager[None]],
    publications: set[str] | None = None,
) -> list[int]:
    """Copy each request's rows into ``results`` (by table); returns the shards whose
    request has no reply (they degraded: zeros). ``decoding(shard, endpoint)`` wraps the
    decoding of a reply (a reply that does not decode becomes the caller's error).
    ``publications`` gets the publication each reply's rows are of (``--published-only``
    serving shards; "" from the others)."""
    degraded = []
    for (s, parts), reply in zip(flat, replies):
        if reply is None:
            degraded.append(s)
            for part in parts:  # the table's default row
                zeros = np.zeros((len(part), part.plan.dim), dtype=np.float32)
                fill_rows(results[part.plan.table], zeros, part.plan.slots, part.start)
            continue
        with decoding(s, reply.endpoint):
            decoded, publication = wire.decode_lookup_reply(reply.data)
            if publications is not None:
                publications.add(publication)
            if len(decoded) != len(parts):
                raise wire.WireFormatError(f"{len(decoded)} results for {len(parts)} tables")
            answers: list[F32 | None] = []
            for r, part in zip(decoded, parts):
                field = f"results[{part.plan.table!r}]"
                if num_shards == 1 and not part.plan.has_duplicates and r.dtype == wire.BFLOAT16:
                    # Widened straight into place: no float32 copy of the answer in between.
                    target = results[part.plan.table][part.start : part.stop]
                    wire.bfloat16_rows_into(r.rows, target, field)
                    answers.append(None)
                else:
                    answers.append(wire.decode_rows(r.rows, len(part), part.plan.dim, r.dtype, field))
        for part, rows in zip(parts, answers):
            target = results[part.plan.table]
            if rows is None:
                continue
            if num_shards == 1 and not part.plan.has_duplicates:
                # One shard, no repeats: the routing order is the identity, a block copy will do.
                np.copyto(target[part.start : part.stop], rows)
            else:
                fill_rows(target, rows, part.plan.slots, part.start)
    return degraded
