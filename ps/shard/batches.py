"""What a ``Shard`` is asked: the decoded requests it takes, and the source of a serving
shard's rows as the shard sees it.

The servicer decodes a request's bytes (``ps.service.servicer``) into a ``LookupBatch`` or a
``PushBatch`` and hands it to one ``Shard`` method; tests build them directly
(``tests.fakes.push_request``).

Example:
    >>> import numpy as np
    >>> batch = PushBatch([("t", np.array([1]), np.ones((1, 2), np.float32))], "w", 7, seqs=[0])
    >>> batch.seq_of(0)
    7
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from ps.elastic import Route

if TYPE_CHECKING:
    from ps.table import Table

__all__ = ["MODES", "LookupBatch", "LookupEntries", "Mode", "PushBatch", "PushEntries", "Route", "RowSource"]

_NO_ROUTE = Route()


Keys = npt.NDArray[np.int64]
LookupEntries = Sequence[tuple[str, Keys]]
PushEntries = Sequence[tuple[str, Keys, npt.NDArray[np.float32]]]


@dataclass(frozen=True)
class LookupBatch:
    """A Lookup: ``(table, keys)`` per entry, or a function that decodes them, which the
    shard calls once the request's route is checked (``decoded``): a shard that is
    stopping or misaddressed says so before it reads a byte of the keys."""

    given: LookupEntries | Callable[[], LookupEntries]
    route: Route = _NO_ROUTE

    def decoded(self) -> LookupEntries:
        """The entries (decoded now, when ``given`` is a function: call it once)."""
        return self.given() if callable(self.given) else self.given


@dataclass(frozen=True)
class PushBatch:
    """A Push: ``(table, keys, grads)`` per entry, float32 ``[len(keys), dim]`` gradients
    (not yet checked against the table), each applied once per ``(client_id, table, seq)``;
    or a function that decodes them given ``dim_of(i, table)`` (the shard's, which checks
    the entry's table), called once the shard takes writes (``entries_with``). ``seqs``:
    each entry's own seq (0 or none: ``seq``)."""

    given: PushEntries | Callable[[Callable[[int, str], int]], PushEntries]
    client_id: str = ""
    seq: int = 0
    route: Route = _NO_ROUTE
    seqs: Sequence[int] = ()
    planned_epoch: int | None = None  # a push routed again after a reshard: where it was first sent
    planned_shard: int | None = None

    def entries_with(self, dim_of: Callable[[int, str], int]) -> PushEntries:
        """The entries, decoded with the dim of each entry's table."""
        return self.given(dim_of) if callable(self.given) else self.given

    @property
    def planned(self) -> tuple[int, int | None]:
        """``(epoch, shard)`` the push was first planned for: where it is routed now,
        unless it was routed again after a reshard."""
        if self.planned_epoch is not None:
            return self.planned_epoch, self.planned_shard
        return self.route.epoch, self.route.shard

    def seq_of(self, i: int) -> int:
        """The seq of entry ``i``."""
        return (self.seqs[i] if i < len(self.seqs) else 0) or self.seq


class RowSource(Protocol):
    """Where a serving shard's rows come from (``ps.replication.follow.Source``), as the shard's
    ``Stats``, health and ``ServeFrom`` use it."""

    applied_version: int

    @property
    def lineage(self) -> str:
        """The lineage of the rows served now (``Stats.lineage``); "" while unknown."""
        ...

    def status(self) -> pb.FollowStatus: ...

    def serve_from(self, checkpoint: str) -> pb.FollowStatus:
        """Serve ``checkpoint`` ("" : the source's own rows again); the status after."""
        ...

    @property
    def publication(self) -> str:
        """The publication served (``--published-only``; "" before the first, or without)."""
        ...

    def roll_back(self) -> pb.FollowStatus:
        """Serve the publication before the current one again; the status after."""
        ...

    @property
    def pinned(self) -> Path | None:
        """The checkpoint part served instead of the source's own rows (None: none)."""
        ...

    def pin(self, checkpoint: str) -> Path:
        """Serve ``checkpoint`` read-only (opened anew); the part's path."""
        ...

    @property
    def base_tables(self) -> dict[str, Table] | None:
        """The source's own tables, kept aside while a checkpoint is pinned (else None)."""
        ...


Mode = Literal["train", "serve"]
MODES: tuple[Mode, ...] = ("train", "serve")
