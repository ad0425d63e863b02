"""Which keys a shard owns: ``protos.keys.shard_of(key, num_shards) == index``.

A shard refuses a Lookup or Push holding any key it does not own, whole and before
applying any of it, with ``WrongShard`` (FAILED_PRECONDITION, marked with the owner of the
key it names), so a misrouted key never gets a row on the wrong shard. A serving shard
owns what its training shard (same index) owns.

Example:
    >>> import numpy as np
    >>> check_owned("Lookup", [("t", np.array([1, 3], dtype=np.int64))], index=0, num_shards=4)
    >>> try:
    ...     check_owned("Lookup", [("t", np.array([1, 2], dtype=np.int64))], index=0, num_shards=4)
    ... except WrongShard as exc:
    ...     print(exc.owner)
    3
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from protos.keys import misrouted, shard_of
from ps.errors import WrongShard

__all__ = ["check_owned"]


def check_owned(
    what: str,
    entries: Sequence[tuple[str, npt.NDArray[np.int64]]],
    *,
    index: int,
    num_shards: int,
    epoch: int = 0,
) -> None:
    """Raise ``WrongShard`` unless shard ``index`` of ``num_shards`` (under the cluster map
    of ``epoch``) owns every key of ``entries`` ((table, keys) of a ``what`` request).
    One numba pass over each entry's keys, no array written; nothing at all with one
    shard. A shard past the end of the map (removed by a reshard) owns nothing."""
    if index >= num_shards:
        keys = next((k for _, k in entries if k.shape[0]), None)
        if keys is None:
            return
        owner = int(shard_of(keys[:1], num_shards)[0])
        where = (
            f"left the cluster in the reshard to epoch {epoch} ({num_shards} shards)"
            if epoch
            else f"is a spare outside the cluster of {num_shards} shards until `ps-admin scale` takes it in"
        )
        raise WrongShard(
            f"{what} refused: shard {index} {where}; key {int(keys[0])} belongs to shard {owner}: "
            "fetch the cluster map (GetMap)",
            owner,
            epoch,
        )
    if num_shards == 1:
        return
    total, offender = 0, None
    for table, keys in entries:
        count, first = misrouted(keys, num_shards, index)
        if count and offender is None:
            offender = (table, int(keys[first]))
        total += count
    if offender is None:
        return
    table, key = offender
    owner = int(shard_of(np.array([key], dtype=np.int64), num_shards)[0])
    raise WrongShard(
        f"{what} refused: key {key} (table {table!r}) belongs to shard {owner} of {num_shards}, not shard {index}; "
        f"{total} of {sum(k.shape[0] for _, k in entries)} keys in this request are not this shard's: "
        "route keys with protos.keys.shard_of and the cluster's address list"
        + (f" (the cluster map is at epoch {epoch}: GetMap returns it)" if epoch else ""),
        owner,
        epoch,
    )
