"""Which keys go to which shard, in how many requests, and how answers merge back.

``plan_table`` dedups one table's keys and groups the unique keys by shard
(``protos.keys.shard_of``). ``pack`` cuts each shard's share of every table into
requests that stay under the message limit; usually that is one request per shard
carrying all tables. ``Part`` names one table's slice inside one request.

Example:
    >>> p = plan_table("t", np.array([3, 3, 9]), dim=4, num_shards=2)
    >>> p.unique.tolist(), [len(requests) for requests in pack([p], 2, lambda plan: 16, 1 << 20)]
    ([3, 9], [1, 1])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from client.batching import plan_keys
from client.errors import InvalidRequestError

__all__ = ["Part", "TablePlan", "pack", "plan_table"]

# Room for everything in a request besides the rows: tags, lengths, names, ids.
_OVERHEAD_BYTES = 4096


@dataclass(frozen=True)
class TablePlan:
    """One table's keys in one call: unique keys, the way back, and the shard grouping."""

    table: str
    dim: int
    keys: npt.NDArray[np.int64]
    unique: npt.NDArray[np.int64]
    inverse: npt.NDArray[np.int64]
    order: npt.NDArray[np.int64]
    bounds: npt.NDArray[np.int64]
    slots: npt.NDArray[np.int64]  # per key, its unique key's place in ``order`` (``plan_keys``)

    @property
    def has_duplicates(self) -> bool:
        return bool(self.unique.shape[0] != self.keys.shape[0])

    def of_unique(self) -> TablePlan:
        """The plan of ``unique`` itself, routed as this one (no second dedup): a caller
        that keeps ``inverse`` looks up and pushes one row per distinct key with it."""
        if not self.has_duplicates:
            return self
        m = self.unique.shape[0]
        rank = np.empty(m, dtype=np.int64)
        rank[self.order] = np.arange(m, dtype=np.int64)
        return TablePlan(
            self.table, self.dim, self.unique, self.unique, np.arange(m, dtype=np.int64), self.order, self.bounds, rank
        )


@dataclass(frozen=True)
class Part:
    """Positions ``order[start:stop]`` of ``plan.unique``, sent to one shard in one request."""

    plan: TablePlan
    start: int
    stop: int

    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """Indices into ``plan.unique`` of this part's keys."""
        return self.plan.order[self.start : self.stop]

    @property
    def keys(self) -> npt.NDArray[np.int64]:
        return self.plan.unique[self.positions]

    def __len__(self) -> int:
        return self.stop - self.start


def plan_table(table: str, keys: npt.NDArray[np.int64], dim: int, num_shards: int) -> TablePlan:
    """Dedup ``keys`` and group the unique ones by shard."""
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: must be >= 1")
    return TablePlan(table, dim, keys, *plan_keys(keys, num_shards))


def pack(
    plans: Sequence[TablePlan], num_shards: int, row_bytes: Callable[[TablePlan], int], limit_bytes: int
) -> list[list[tuple[int, list[Part]]]]:
    """Per shard, the requests to send: each a list of ``Part``s under ``limit_bytes``.

    ``row_bytes(plan)`` is the wire size of one key's share of the larger of request
    and response. Shards with no keys get no request.
    """
    budget = max(1, limit_bytes - _OVERHEAD_BYTES)
    out: list[list[tuple[int, list[Part]]]] = []
    for s in range(num_shards):
        requests: list[tuple[int, list[Part]]] = []
        current: list[Part] = []
        used = 0
        for plan in plans:
            size = row_bytes(plan)
            start, stop = int(plan.bounds[s]), int(plan.bounds[s + 1])
            while start < stop:
                room = (budget - used) // size
                if room == 0:
                    if not current:
                        raise InvalidRequestError(
                            f"table {plan.table!r}: one row of {size} bytes does not fit in "
                            f"max_message_bytes={limit_bytes}: raise ClientConfig.max_message_bytes"
                        )
                    requests.append((s, current))
                    current, used = [], 0
                    continue
                take = min(room, stop - start)
                current.append(Part(plan, start, start + take))
                used += take * size
                start += take
        if current:
            requests.append((s, current))
        out.append(requests)
    return [r for r in out if r]
