"""The requests a ``Shard`` takes, decoded: where a client routed them and what they carry.

The servicer decodes ``Lookup`` and ``Push`` into these (``ps.servicer``) and hands them
to ``Shard.lookup`` and ``Shard.push``, which check ``route`` before anything else.

Example:
    >>> import numpy as np
    >>> LookupBatch([("item", np.array([3, 4]))], Route(num_shards=2, shard=0)).route.num_shards
    2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["LookupBatch", "PushBatch", "Route"]


@dataclass(frozen=True)
class Route:
    """Where a client sent a request: the cluster size it planned with (0: not checked)
    and the shard it meant (None: not checked)."""

    num_shards: int = 0
    shard: int | None = None


@dataclass(frozen=True)
class LookupBatch:
    """A decoded Lookup: ``(table, keys)`` per entry."""

    entries: Sequence[tuple[str, npt.NDArray[np.int64]]]
    route: Route = Route()


@dataclass(frozen=True)
class PushBatch:
    """A decoded Push: ``(table, keys, grads)`` per entry, float32 ``[len(keys), dim]``
    gradients (not yet checked against the table), each applied once per ``(client_id,
    table, seq)``. ``seqs``: each entry's own seq (0 or none: ``seq``)."""

    entries: Sequence[tuple[str, npt.NDArray[np.int64], npt.NDArray[np.float32]]]
    client_id: str = ""
    seq: int = 0
    route: Route = Route()
    seqs: Sequence[int] = ()

    def seq_of(self, i: int) -> int:
        """The seq of entry ``i``."""
        return (self.seqs[i] if i < len(self.seqs) else 0) or self.seq
