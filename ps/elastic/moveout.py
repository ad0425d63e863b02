"""An old owner's side of a reshard: the stream of its rows that move to one new owner.

``move_batches`` yields the ``MoveBatch`` messages of one ``MoveRows`` call (see
protos/ps.proto). First a copy of every row that moves to the destination, whole
(values, optimizer state, last use and use count): the keys in RAM, then those only on
disk, each row read as it is at that moment (``Table.peek_rows``) and the version of
the shard's change log noted before the first is read. Then, as pushes change them,
the current rows of every moving key changed since (from the change log, like a
follower's stream; a key that no longer has a row goes as deleted). Once the shard is
frozen (``Reshard.frozen_version``) and everything up to the freeze was sent, a last
message brings each table's push ledger and admission counters, marked ``done``.

A destination that reconnects starts again from a copy; so does one that fell behind
what the change log holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos import wire
from ps.elastic.cluster import ClusterMap, MoveState
from ps.elastic.reshard import Reshard
from ps.errors import InvalidRequest, Moving
from ps.replication import ChangeLog
from ps.table import Table, spec_to_proto

__all__ = ["move_batches"]

_OVERHEAD_BYTES = 1 << 16
_HEARTBEAT_S = 0.5
# Rows per message at most this many bytes: the old owner reads the next message while the
# new owner writes the last one (a message of all the rows would serialize the two).
_MESSAGE_BYTES = 4 << 20


def move_batches(
    reshard: Reshard,
    tables: Callable[[], Sequence[Table]],
    changes: ChangeLog,
    to: ClusterMap,
    destination: int,
    active: Callable[[], bool],
    max_message_bytes: int,
    max_rows_per_s: float = 0.0,
) -> Iterator[pb.MoveBatch]:
    """The stream of the rows of this shard that move to shard ``destination`` of ``to``,
    at most ``max_rows_per_s`` a second (0: no limit). Raises ``Moving`` before this shard
    has prepared the reshard to ``to`` (retry), ``InvalidRequest`` for a map it can never
    prepare (its epoch is not the next one, or another reshard runs here) and for a
    destination that gets no keys from it."""
    mv = reshard.move
    if mv is not None and mv.dst != to and mv.phase in ("copying", "frozen"):
        raise InvalidRequest(
            f"shard {reshard.index} takes part in the reshard to {mv.dst.describe()}, not in one to {to.describe()}"
        )
    if mv is None or mv.dst != to:
        at = reshard.map.epoch
        if to.epoch != at + 1:  # a reshard moves the epoch one on from where this shard is
            raise InvalidRequest(
                f"a reshard to {to.describe()} cannot be prepared on shard {reshard.index}, which is at epoch {at} "
                f"(the next map is epoch {at + 1})"
            )
        raise Moving(f"shard {reshard.index} has not prepared the reshard to {to.describe()}: retry shortly")
    if not mv.is_source or reshard.index not in MoveState(destination, mv.src, mv.dst).sources:
        raise InvalidRequest(f"shard {destination} gets no keys from shard {reshard.index} in this reshard")
    if mv.phase not in ("copying", "frozen"):
        raise InvalidRequest(f"the reshard to epoch {to.epoch} is {mv.phase} on shard {reshard.index}: nothing to send")
    limit = max(1 << 16, min(max_message_bytes, _MESSAGE_BYTES) - _OVERHEAD_BYTES)

    def moving(keys: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        # Keys this shard owned before the reshard only: a change of another shard's key (a
        # leftover) must not reach the destination as that key's row, or its deletion.
        owned: npt.NDArray[np.bool_] = (to.owners(keys) == destination) & mv.src.owns(keys, reshard.index)
        return owned

    pace = _Pace(max_rows_per_s)
    while active():
        dirty = _Dirty(changes, moving)
        sent = dirty.version  # the copy reads every row after this version
        if not (yield from _drained(pace.through(_copy(reshard, tables(), changes, moving, limit, sent)), dirty)):
            continue  # the log moved past what was drained: copy again
        while active():
            current = reshard.move
            frozen_at = reshard.frozen_version if reshard.frozen and current is not None and current.dst == to else None
            if frozen_at is not None and sent >= frozen_at:
                yield _last(tables(), changes, sent)
                return
            if not dirty.pending and dirty.version <= sent:  # nothing drained since the last round
                changes.wait(dirty.version, _HEARTBEAT_S)
            if not dirty.drain():
                break  # copy again
            version, keys = dirty.take()
            if version == sent:
                yield pb.MoveBatch(history=changes.history, version=sent, source_version=changes.version)
                continue
            by_name = {t.spec.name: t for t in tables()}
            rows = (
                batch
                for name in sorted(keys)
                if name in by_name
                for batch in _rows(reshard, changes.history, sent, by_name[name], keys[name], limit, deletions=True)
            )
            if not (yield from _drained(rows, dirty)):
                break
            sent = version
            yield pb.MoveBatch(history=changes.history, version=sent, source_version=changes.version)


class _Dirty:
    """The moving keys changed since ``version``, per table, taken from the change log
    after every message sent (``drain``): however long a copy or a catch-up takes, the
    log only has to hold what changed while one message was made and sent."""

    def __init__(self, changes: ChangeLog, moving: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.bool_]]) -> None:
        self.changes, self.moving = changes, moving
        self.version = changes.version
        self._keys: dict[str, list[npt.NDArray[np.int64]]] = {}

    @property
    def pending(self) -> bool:
        return bool(self._keys)

    def drain(self) -> bool:
        """Take in the changes after ``version``; False when the log no longer holds them."""
        changed = self.changes.since(self.version)
        if changed is None:
            return False
        self.version, _, keys = changed
        for name, k in keys.items():
            picked = k[self.moving(k)]
            if picked.size:
                parts = self._keys.setdefault(name, [])
                parts.append(picked)
                if len(parts) > 32:  # keep the pile near the distinct keys it holds
                    parts[:] = [_distinct(parts)]
        return True

    def take(self) -> tuple[int, dict[str, npt.NDArray[np.int64]]]:
        """``(version, distinct sorted keys per table)`` drained so far, and start afresh."""
        keys = {name: _distinct(parts) for name, parts in self._keys.items()}
        self._keys = {}
        return self.version, keys


def _distinct(parts: list[npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
    return np.unique(np.concatenate(parts).view(np.uint64)).view(np.int64)


def _drained(batches: Iterator[pb.MoveBatch], dirty: _Dirty) -> Generator[pb.MoveBatch, None, bool]:
    """``batches`` passed on, the change log drained into ``dirty`` after each; returns
    False (and stops) when the log moved past what ``dirty`` holds."""
    for batch in batches:
        yield batch
        if not dirty.drain():
            return False
    return True


class _Pace:
    """Holds a stream of row messages to ``rows_per_s`` (0: lets it run)."""

    def __init__(self, rows_per_s: float) -> None:
        self.rows_per_s = rows_per_s
        self.t0, self.rows = time.monotonic(), 0

    def through(self, batches: Generator[pb.MoveBatch, None, int]) -> Generator[pb.MoveBatch, None, int]:
        """``batches`` passed on, each after the pause that keeps the pace; returns what they return."""
        while True:
            try:
                batch = next(batches)
            except StopIteration as done:
                return int(done.value)
            if self.rows_per_s > 0:
                self.rows += sum(len(t.keys) // 8 for t in batch.tables)
                ahead = self.rows / self.rows_per_s - (time.monotonic() - self.t0)
                if ahead > 0:
                    time.sleep(ahead)
            yield batch


def _copy(
    reshard: Reshard,
    tables: Sequence[Table],
    changes: ChangeLog,
    moving: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.bool_]],
    limit: int,
    version: int,
) -> Generator[pb.MoveBatch, None, int]:
    """Every moving row as it is when read, each read after ``version`` (the log's version
    before the first is read: later changes follow as deltas); returns ``version``."""
    history = changes.history
    yield pb.MoveBatch(history=history, snapshot_begin=True, specs=[spec_to_proto(t.spec) for t in tables])
    for table in tables:
        for stored in table.stored_keys():  # each moving key's row is read as it is now
            keys = stored[moving(stored)]
            if keys.size:
                yield from _rows(reshard, history, version, table, np.sort(keys.view(np.uint64)).view(np.int64), limit)
    yield pb.MoveBatch(history=history, version=version, snapshot_end=True, source_version=changes.version)
    return version


def _step(table: Table, limit: int) -> int:
    return max(1, limit // (8 + table.format.record_bytes))


def _rows(
    reshard: Reshard,
    history: str,
    version: int,
    table: Table,
    keys: npt.NDArray[np.int64],
    limit: int,
    *,
    deletions: bool = False,
) -> Iterator[pb.MoveBatch]:
    """The rows of the sorted, distinct ``keys`` as they are now, in messages under
    ``limit``; with ``deletions``, keys without a row go as deleted."""
    step = _step(table, limit)
    for start in range(0, keys.shape[0], step):
        part = keys[start : start + step]
        found, rows = table.peek_rows(part)
        moved = pb.MovedRows(
            table=table.spec.name,
            keys=wire.encode_keys(rows.keys),
            rows=rows.packed(table.format).tobytes(),
            deleted_keys=wire.encode_keys(part[~found]) if deletions else b"",
        )
        reshard.rows_out += len(rows)
        reshard.bytes_out += len(moved.rows) + len(moved.keys)
        yield pb.MoveBatch(history=history, version=version, tables=[moved])


def _last(tables: Sequence[Table], changes: ChangeLog, version: int) -> pb.MoveBatch:
    """The push ledgers and admission counters of every table, after the last change."""
    if any(t.ledgers.active for t in tables):  # a reshard is prepared only once they merged
        raise InvalidRequest("push ledgers of the last reshard are still kept apart here: abort and retry")
    ledgers = [
        pb.MovedLedger(table=t.spec.name, client_id=client, entry=t.ledger.encode(client))
        for t in tables
        for client in t.ledger.clients()
    ]
    admission = [
        pb.MovedAdmission(table=t.spec.name, counters=counters)
        for t in tables
        if (counters := t.admission_counters()) is not None
    ]
    return pb.MoveBatch(
        history=changes.history,
        version=version,
        source_version=changes.version,
        specs=[spec_to_proto(t.spec) for t in tables],
        ledgers=ledgers,
        admission=admission,
        done=True,
    )
