"""A shard's part in live resharding: the map it routes by, the checks every request
passes, and the phases of a reshard (``ps.elastic.cluster`` describes them).

``Reshard`` holds the shard's ``ClusterMap`` and ``MoveState`` (both kept in its data
dir, so a restarted shard comes back in the phase it was in) and answers, for every
request: is it routed by a map this shard can serve (``check_route``), does this shard
own its keys and may it write them now (``check_keys``), and in which push ledger is a
push to them recorded (``origins``). Writes run under ``writing()``, so that a freeze
waits for the pushes in flight and every later push to a moving key is refused.

The copy itself runs elsewhere: an old owner streams its moving rows (``ps.elastic.moveout``,
the ``MoveRows`` RPC), a new owner pulls them from every old owner (``ps.elastic.intake``).
After the commit an old owner drops the rows it gave away, in the background.

Thread-safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos.keys import shard_of
from ps.elastic.cluster import ClusterMap, MoveState, Phase, Route
from ps.elastic.intake import Intake, MoveStream, SourceProgress
from ps.elastic.ownership import check_owned
from ps.errors import BehindMap, InvalidRequest, KeysMoving, Moving, ShardMismatch, WrongMode
from ps.replication import ChangeLog
from ps.rwlock import ReadWriteLock
from ps.store import Storage
from ps.table import KeyOrigins, Table, TableSpec

__all__ = ["Reshard", "ReshardParts", "ReshardSettings"]

log = logging.getLogger(__name__)

_MAP_KEY = b"cluster-map"
_MOVE_KEY = b"reshard"

Entries = Sequence[tuple[str, npt.NDArray[np.int64]]]


@dataclass(frozen=True)
class ReshardSettings:
    """How a shard takes part in reshards: ``stream`` opens another shard's ``MoveRows``
    (None: it cannot pull rows); ``settle_s``: how long after a commit pushes planned
    before it may still come (clients retry for their deadline), during which a new
    owner keeps the push ledgers of the keys that came apart. ``identify(address)``: the
    index of the shard that answers at an address (None: none answers), which a new owner
    checks its old owners' addresses with before it prepares (None: not checked)."""

    stream: MoveStream | None = None
    settle_s: float = 120.0
    identify: Callable[[str], int | None] | None = None


@dataclass(frozen=True)
class ReshardParts:
    """What a reshard needs of its shard: its tables (and a way to create one), its
    change log, a way to make everything it holds durable (``flush``: dirty rows and
    ledgers to the data dir), and ``stream``, which opens another shard's ``MoveRows``
    (None: this shard cannot pull rows, e.g. a serving shard)."""

    tables: Callable[[], list[Table]]
    install_table: Callable[[TableSpec], bool]
    changes: ChangeLog
    flush: Callable[[], int]
    settings: ReshardSettings = ReshardSettings()


class Reshard:
    """Shard ``index``'s cluster map and reshard (see the module docstring). Starts at
    the map of ``num_shards`` shards, epoch 0, or at what ``storage`` recorded."""

    def __init__(self, index: int, num_shards: int, storage: Storage | None, parts: ReshardParts) -> None:
        self.index = index
        self._storage = storage
        self._parts = parts
        self.map = ClusterMap(0, num_shards)
        self.move: MoveState | None = None
        if storage is not None:
            saved_map, saved_move = storage.get_meta(_MAP_KEY), storage.get_meta(_MOVE_KEY)
            if saved_map:
                self.map = ClusterMap.from_json(json.loads(saved_map))
            if saved_move:
                self.move = MoveState.from_json(saved_move)
            if saved_map and self.map.num_shards != num_shards:
                log.warning(
                    "started as shard %d of %d, but its data dir moved to the cluster map of %s in a reshard: "
                    "routing by that map",
                    index,
                    num_shards,
                    self.map.describe(),
                )
        self._gate = ReadWriteLock()  # writes read it; a freeze writes it
        self._lock = threading.Lock()  # phase changes, one at a time
        self.frozen_version: int | None = 0 if self.frozen else None
        self.rows_out = self.bytes_out = self.rows_dropped = 0
        self.on_phase: list[Callable[[MoveState], None]] = []  # hears every phase change
        self._intake: Intake | None = None
        self._progress: dict[int, SourceProgress] = {}  # the last intake's, kept for status
        self._cleanup: threading.Thread | None = None
        self._settler: threading.Thread | None = None
        self._closing = threading.Event()

    # -- the state every request reads ------------------------------------------------

    @property
    def frozen(self) -> bool:
        """Whether this shard refuses pushes to its moving keys (an old owner, frozen)."""
        mv = self.move
        return mv is not None and mv.phase == "frozen" and mv.is_source

    @property
    def copying(self) -> bool:
        """Whether a reshard is under way here (copying or frozen): TTL sweeps wait."""
        mv = self.move
        return mv is not None and mv.phase in ("copying", "frozen")

    def writing(self) -> contextlib.AbstractContextManager[None]:
        """Hold while checking and applying a write (a push, a lookup that creates rows)."""
        return self._gate.reading()

    def quiet(self) -> contextlib.AbstractContextManager[None]:
        """Hold for a moment in which no write is in progress (new writes wait for it)."""
        return self._gate.writing()

    def check_route(self, route: Route) -> None:
        """Raise unless a request routed along ``route`` may run here: by this shard's map,
        or by an older one (its keys are checked one by one), or by the map of a reshard
        this shard takes part in."""
        m = self.map
        if route.epoch > m.epoch:
            mv = self.move
            if mv is not None and mv.phase in ("copying", "frozen") and route.epoch == mv.dst.epoch:
                if mv.sources:
                    raise KeysMoving(
                        f"shard {self.index} takes its keys of the cluster map of epoch {route.epoch} once the "
                        "reshard to it commits (rows are still arriving): retry shortly"
                    )
                return  # an old owner: its keys are checked against the map it routes by
            raise BehindMap(
                f"request routed by the cluster map of epoch {route.epoch}, but shard {self.index} is at epoch "
                f"{m.epoch} ({m.num_shards} shards): is this the cluster the client was given?",
                m.epoch,
            )
        if route.epoch < m.epoch and not (route.epoch == 0 and route.num_shards == m.num_shards):
            return  # a client behind: keys it still routes here are served, the others refused
        if route.shard is not None and route.shard != self.index:
            raise ShardMismatch(
                f"request for shard {route.shard} reached shard {self.index}: the client's address list "
                "is not in shard order"
            )
        if route.num_shards and route.num_shards != m.num_shards:
            raise ShardMismatch(
                f"request was routed for num_shards={route.num_shards}, but shard {self.index} belongs to a "
                f"cluster of {m.num_shards}: the client's address list does not match the cluster"
            )

    def check_keys(self, what: str, entries: Entries, *, write: bool) -> bool:
        """Raise ``WrongShard`` for a key this shard does not own under its map, and
        ``Moving`` for a ``write`` to a key it is handing over (frozen); returns True when
        a lookup must not create rows (some of its keys are being handed over)."""
        m = self.map
        check_owned(what, entries, index=self.index, num_shards=m.num_shards, epoch=m.epoch)
        mv = self.move
        if mv is None or not self.frozen or mv.dst.num_shards == m.num_shards:
            return False
        moving = next((int(k[mv.moving(k)][0]) for _, k in entries if k.shape[0] and mv.moving(k).any()), None)
        if moving is None:
            return False
        if write:
            owner = int(shard_of(np.array([moving], np.int64), mv.dst.num_shards)[0])
            raise KeysMoving(
                f"{what} refused for now: key {moving} moves from shard {self.index} to shard {owner} in the "
                f"reshard to epoch {mv.dst.epoch}, which is switching over: retry shortly"
            )
        return True

    def given_away(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Of ``keys``, those this shard owned and gave away in a reshard that committed, whose
        rows it may still hold (it drops them once committed): deleting them now is that drop,
        early. None in any other phase: rows of keys a shard does not own may be arriving in a
        copy then, or be another shard's to keep."""
        mv = self.move
        if mv is None or mv.phase != "committed" or not mv.is_source:
            return keys[:0]
        return keys[mv.src.owns(keys, self.index) & ~mv.dst.owns(keys, self.index)]

    def origins(self, planned_epoch: int, planned_shard: int | None, keys: npt.NDArray[np.int64]) -> KeyOrigins | None:
        """In which push ledgers a push entry is recorded here: where its keys were before
        the last reshard that brought this shard keys, for a push first planned by the map
        of ``planned_epoch`` for shard ``planned_shard`` (None: this one). None: this
        shard's own ledger. A part of another shard's push, routed again after a reshard,
        that holds no key of this shard is recorded nowhere (``skip``)."""
        planned = self.index if planned_shard is None else planned_shard
        mv = self.move
        if mv is None or mv.phase not in ("committed", "done") or not mv.sources:
            return None if planned == self.index else self._skip(planned, keys)
        epoch = planned_epoch
        if epoch == 0 and mv.src.epoch > 0:
            epoch = self.map.epoch  # a client given today's addresses, which never saw a map
        if epoch >= mv.dst.epoch:
            if planned != self.index:
                return self._skip(planned, keys)
            return KeyOrigins(self.index, owners=shard_of(keys, mv.src.num_shards), origins=tuple(mv.sources))
        if epoch < mv.src.epoch:
            raise ShardMismatch(
                f"a push planned under the cluster map of epoch {epoch} reached shard {self.index}, which keeps "
                f"push ledgers back to epoch {mv.src.epoch} only: it cannot be told apart from pushes applied "
                "before; the client was cut off through two reshards"
            )
        if planned != self.index and planned not in mv.sources:
            return self._skip(planned, keys)
        if keys.shape[0] and not (shard_of(keys, mv.src.num_shards) == planned).all():
            raise InvalidRequest(
                f"planned_shard={planned}: keys of this push entry did not belong to shard {planned} under "
                f"the cluster map of epoch {epoch}"
            )
        return KeyOrigins(self.index, fixed=planned)

    def _skip(self, planned: int, keys: npt.NDArray[np.int64]) -> KeyOrigins:
        if keys.shape[0]:
            raise InvalidRequest(
                f"planned_shard={planned}: no key of a push planned for shard {planned} came to shard "
                f"{self.index} in a reshard, but this entry holds {keys.shape[0]}"
            )
        return KeyOrigins(self.index, skip=True)

    @staticmethod
    def alive(active: Callable[[], bool], closing: Callable[[], bool]) -> Callable[[], bool]:
        """True while a stream's caller is there and the shard is not stopping."""
        return lambda: active() and not closing()

    def sizes(self) -> set[int]:
        """The cluster sizes this shard belongs or belonged to (a follower started for any
        of them may follow it)."""
        mv = self.move
        seen = self._storage.sizes_seen() if self._storage is not None else set()
        return seen | {self.map.num_shards} | ({mv.src.num_shards, mv.dst.num_shards} if mv is not None else set())

    def pending_ledgers(self) -> int:
        """What keeps push ledgers of the last reshard apart (a new one waits for 0): clients
        whose pushes from before it are not settled, and the reshard being too recent."""
        return sum(t.ledgers.pending(time.time(), self._parts.settings.settle_s) for t in self._parts.tables())

    # -- phases -----------------------------------------------------------------------

    def start(self) -> None:
        """Carry on with a reshard the data dir recorded: a new owner pulls again, an old
        owner that committed drops what it gave away."""
        with self._lock:
            self._resume()

    def close(self) -> None:
        """Stop pulling and dropping (a restart carries on)."""
        self._closing.set()
        with self._lock:
            intake, self._intake = self._intake, None
        if intake is not None:
            intake.stop()
        for thread in (self._cleanup, self._settler):
            if thread is not None:
                thread.join(timeout=10)

    def _resume(self) -> None:
        mv = self.move
        if mv is None or self._closing.is_set():
            return
        if mv.phase in ("copying", "frozen") and mv.sources and self._intake is None:
            if self._parts.settings.stream is None:
                raise InvalidRequest(f"shard {self.index} cannot pull rows (a serving shard takes part in no reshard)")
            self._intake = Intake(
                mv,
                stream=self._parts.settings.stream,
                tables=self._parts.tables,
                install_table=self._parts.install_table,
                changes=self._parts.changes,
                flush=self._parts.flush,
                on_complete=self._complete,
            )
            self._intake.start()
        if mv.phase in ("committed", "done") and mv.sources and not mv.settled and self._settler is None:
            native = self.index < mv.src.num_shards
            for table in self._parts.tables():
                table.ledgers.activate(native_keys=native, since=mv.committed_unix_s)
            self._settler = threading.Thread(target=self._settle, name=f"ps-reshard-settle-{self.index}", daemon=True)
            self._settler.start()
        if mv.phase == "committed" and self._cleanup is None:
            self._cleanup = threading.Thread(
                target=self._drop_given_away, name=f"ps-reshard-drop-{self.index}", daemon=True
            )
            self._cleanup.start()

    def request(self, request: pb.ReshardRequest, *, serving: bool = False) -> pb.ReshardStatus:
        """One ``Reshard`` RPC (see protos/ps.proto); returns the status after it. A
        ``serving`` shard only switches maps (COMMIT, ``_adopt``)."""
        phase = request.phase
        src = ClusterMap.from_proto(getattr(request, "from"), "from") if request.HasField("from") else None
        dst = ClusterMap.from_proto(request.to, "to") if request.HasField("to") else None
        if phase != pb.ReshardRequest.STATUS:
            if dst is None:
                raise InvalidRequest("ReshardRequest.to: the map to move to is missing")
            if phase == pb.ReshardRequest.PREPARE and not serving and src is not None:
                self._check_sources(src, dst)  # over the network: before the lock every phase takes
            with self._lock:
                if serving:
                    if phase != pb.ReshardRequest.COMMIT:
                        raise WrongMode(
                            f"Reshard refused: shard {self.index} is a serving shard; it follows its training shard "
                            "through a reshard and only switches maps (COMMIT)"
                        )
                    self._adopt(dst)
                elif phase == pb.ReshardRequest.PREPARE:
                    if src is None:
                        raise InvalidRequest("ReshardRequest.from: the map to move from is missing")
                    self._prepare(src, dst, max(0.0, request.max_rows_per_s))
                elif phase == pb.ReshardRequest.FREEZE:
                    self._freeze(dst)
                elif phase == pb.ReshardRequest.COMMIT:
                    self._commit(dst)
                elif phase == pb.ReshardRequest.ABORT:
                    self._abort(dst)
                else:
                    raise InvalidRequest(f"ReshardRequest.phase={phase}: unknown")
        return self.status()

    def _prepare(self, src: ClusterMap, dst: ClusterMap, max_rows_per_s: float = 0.0) -> None:
        mv = self.move
        if mv is not None and mv.src == src and mv.dst == dst:
            self._resume()  # asked again (an admin that restarted): carry on
            return
        if mv is not None and mv.phase in ("copying", "frozen"):
            raise InvalidRequest(
                f"shard {self.index} takes part in the reshard from {mv.src.describe()} to {mv.dst.describe()} "
                f"({mv.phase}): finish it or abort it first"
            )
        if mv is not None and mv.phase == "committed":
            raise Moving(
                f"shard {self.index} is still dropping the rows it gave away in the reshard to epoch "
                f"{mv.dst.epoch}: retry shortly"
            )
        _check_maps(self.index, self.map, src, dst)
        now = time.time()
        pending = self.pending_ledgers()
        # Merged here and now if they may be (the settle thread may not have got to it): an
        # old owner sends its keys' ledger, which must be the whole record of their pushes.
        if pending or not all([t.settle_ledgers(now, self._parts.settings.settle_s) for t in self._parts.tables()]):
            raise Moving(
                f"shard {self.index} still holds {pending} push-ledger entries from the reshard to epoch "
                f"{self.map.epoch} (clients with pushes from before it not settled yet): retry once they are"
            )
        if self.index >= src.num_shards and any(len(t) or t.spilled for t in self._parts.tables()):
            raise InvalidRequest(
                f"shard {self.index} is new in the map of epoch {dst.epoch} but already holds rows: "
                "start it with an empty data dir"
            )
        self.set_phase(MoveState(self.index, src, dst, "copying", max_rows_per_s=max_rows_per_s))
        log.info("reshard: prepared from %s to %s", src.describe(), dst.describe())
        self._resume()

    def _check_sources(self, src: ClusterMap, dst: ClusterMap) -> None:
        """Raise ``InvalidRequest`` when an address of an old owner this shard would pull rows
        from reaches another shard from here (one that does not answer is tried again
        later). The old owners are asked together (``identify``: a couple of seconds each at most)."""
        identify = self._parts.settings.identify
        if identify is None or len(src.addresses) != src.num_shards or len(dst.addresses) != dst.num_shards:
            return  # maps that do not fit are refused under the lock, with the reason
        sources = [s for s in MoveState(self.index, src, dst, "copying").sources if s < len(src.addresses)]
        if not sources:
            return
        with ThreadPoolExecutor(len(sources), thread_name_prefix="ps-identify") as pool:
            answers = list(pool.map(lambda s: identify(src.addresses[s]), sources))
        for source, answered in zip(sources, answers):
            address = src.addresses[source]
            if answered is not None and answered != source:
                raise InvalidRequest(
                    f"{address}, the address of shard {source}, reaches shard {answered} from shard {self.index}'s "
                    "host: give addresses every shard can dial (127.0.0.1 reaches only the host it is dialled from; "
                    "use each host's IP or DNS name)"
                )

    def _adopt(self, dst: ClusterMap) -> None:
        """A serving shard routes by ``dst`` from now on, and drops the rows of keys it no
        longer owns (its training shard moved them; its followers' copies came meanwhile)."""
        mv = self.move
        if self.map == dst:
            return
        if dst.epoch <= self.map.epoch:
            raise InvalidRequest(f"shard {self.index} is at {self.map.describe()}, past {dst.describe()}")
        src = ClusterMap(self.map.epoch, self.map.num_shards, self.map.addresses)
        switched = MoveState(self.index, src, dst, "committed", committed_unix_s=time.time(), settled=True)
        if mv is not None and mv.phase == "committed":
            raise Moving(f"serving shard {self.index} is still dropping the rows of its last switch: retry shortly")
        self.set_phase(switched if switched.is_source else dataclasses.replace(switched, phase="done"), new_map=dst)
        log.info("serving by %s from now on", dst.describe())
        self._resume()

    def _matching(self, dst: ClusterMap) -> MoveState:
        mv = self.move
        if mv is None or mv.dst != dst:
            raise InvalidRequest(
                f"shard {self.index} has no reshard to {dst.describe()} "
                f"(its own: {mv.dst.describe() if mv is not None else 'none'}): prepare it first"
            )
        return mv

    def _freeze(self, dst: ClusterMap) -> None:
        mv = self._matching(dst)
        if mv.phase == "copying" and mv.is_source:
            self.set_phase(dataclasses.replace(mv, phase="frozen"))
            log.info("reshard: frozen (pushes to moving keys wait) at version %s", self.frozen_version)
        elif mv.phase in ("committed", "done"):
            raise InvalidRequest(f"the reshard to epoch {dst.epoch} is {mv.phase} on shard {self.index}")

    def _commit(self, dst: ClusterMap) -> None:
        mv = self._matching(dst)
        if mv.phase in ("committed", "done"):
            return
        missing = sorted(set(mv.sources) - mv.complete)
        if missing:
            raise Moving(
                f"shard {self.index} cannot take its new keys yet: rows from shard(s) {missing} have not all "
                "arrived (see ps-admin scale's progress)"
            )
        if mv.is_source and mv.phase != "frozen":
            raise InvalidRequest(f"shard {self.index} gives keys away: freeze it before the commit")
        phase: Phase = "committed" if mv.is_source else "done"
        committed = dataclasses.replace(mv, phase=phase, committed_unix_s=time.time())
        self.set_phase(committed, new_map=mv.dst)
        log.info("reshard: committed, routing by %s", mv.dst.describe())
        intake, self._intake = self._intake, None
        if intake is not None:
            intake.stop()
            self._progress = intake.progress
        self._resume()

    def _abort(self, dst: ClusterMap) -> None:
        mv = self._matching(dst)
        if mv.phase in ("committed", "done"):
            raise InvalidRequest(
                f"the reshard to epoch {dst.epoch} is committed on shard {self.index}: it cannot be undone; "
                "run `ps-admin scale` again to finish it"
            )
        intake, self._intake = self._intake, None
        if intake is not None:
            intake.stop()
        n = mv.src.num_shards
        for table in self._parts.tables():
            table.ledgers.drop_moved()
            gone = table.remove_where(lambda keys: np.isin(shard_of(keys, n), mv.sources))
            if gone.size:
                self._parts.changes.record([(table.spec.name, gone)])
        self.set_phase(None)
        log.info("reshard: aborted, staying at %s", self.map.describe())

    def _complete(self, source: int) -> None:
        """An old owner's rows are all here and durable: record it before saying so."""
        with self._lock:
            mv = self.move
            if mv is None or source in mv.complete:
                return
            self.set_phase(dataclasses.replace(mv, complete=mv.complete | {source}))

    def _settle(self) -> None:
        """A new owner merges the push ledgers it keeps apart for the keys that came, once
        they may be (``TableLedgers.collapse``), then records the reshard as settled."""
        try:
            while not self._closing.wait(0.5):
                now, settle_s = time.time(), self._parts.settings.settle_s
                if all([t.settle_ledgers(now, settle_s) for t in self._parts.tables()]):
                    with self._lock:
                        mv = self.move
                        if mv is not None and mv.phase in ("committed", "done"):
                            self.set_phase(dataclasses.replace(mv, settled=True))
                    log.info("reshard: the push ledgers of the keys that came merged back")
                    return
        except Exception:
            log.exception("reshard: merging push ledgers failed (a restart tries again)")
        finally:
            self._settler = None

    def _drop_given_away(self) -> None:
        """After the commit, an old owner deletes the rows it gave away (its followers are
        told through the change log), then records the reshard as done."""
        mv = self.move
        if mv is None:
            return
        try:
            for table in self._parts.tables():
                if self._closing.is_set():
                    return
                gone = table.remove_where(lambda keys: ~mv.dst.owns(keys, self.index))
                for start in range(0, gone.shape[0], 1 << 16):
                    self._parts.changes.record([(table.spec.name, gone[start : start + (1 << 16)])])
                self.rows_dropped += int(gone.size)
            with self._lock:
                if self.move is mv:
                    self.set_phase(dataclasses.replace(self.move, phase="done"))
            log.info("reshard: dropped the %d rows given away; done", self.rows_dropped)
        except Exception:
            log.exception("reshard: dropping the rows given away failed (a restart tries again)")
        finally:
            self._cleanup = None

    def set_phase(self, move: MoveState | None, new_map: ClusterMap | None = None) -> None:
        """Record ``move`` (and ``new_map``) in the data dir, then make them current; the
        frozen phase and a new map are entered holding every write out."""
        if self._storage is not None:
            items = {_MOVE_KEY: move.to_json().encode() if move is not None else b""}
            if new_map is not None:
                items[_MAP_KEY] = json.dumps(new_map.to_json()).encode()
            self._storage.put_metas(items, num_shards=new_map.num_shards if new_map is not None else None)
        # Entering the freeze or switching maps waits for the writes in flight: each checked
        # its keys against the map and phase it read, and must finish under them.
        freezing = move is not None and move.phase == "frozen" and move.is_source and not self.frozen
        with self._gate.writing() if freezing or new_map is not None else contextlib.nullcontext():
            if new_map is not None:
                self.map = new_map
            self.move = move
            if freezing:
                self.frozen_version = self._parts.changes.version
            elif not self.frozen:
                self.frozen_version = None  # a freeze of an earlier reshard says nothing of this one
        if freezing:
            self._parts.changes.wake()  # the MoveRows streams waiting for changes send their last batch now
        if move is not None:
            for listener in list(self.on_phase):
                listener(move)

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Hold while changing phase: one change at a time."""
        with self._lock:
            yield

    def get_map(self, follow: pb.FollowStatus | None = None) -> pb.GetMapResponse:
        """``GetMap``'s answer: the map, where a reshard stands, a serving shard's ``follow``."""
        return pb.GetMapResponse(map=self.map.to_proto(), shard=self.index, reshard=self.status(), follow=follow)

    def status(self) -> pb.ReshardStatus:
        mv, intake = self.move, self._intake
        status = pb.ReshardStatus(
            rows_out=self.rows_out,
            bytes_out=self.bytes_out,
            rows_dropped=self.rows_dropped,
            pending_ledgers=self.pending_ledgers(),
        )
        if mv is not None:
            status.phase = mv.phase
            getattr(status, "from").CopyFrom(mv.src.to_proto())
            status.to.CopyFrom(mv.dst.to_proto())
            progress = intake.progress if intake is not None else self._progress
            for s in mv.sources:
                if s in progress:
                    status.sources.append(progress[s].to_proto())
                else:  # recorded before a restart
                    status.sources.append(
                        pb.MoveSource(shard=s, complete=s in mv.complete, snapshot_done=s in mv.complete)
                    )
        return status


def _check_maps(index: int, current: ClusterMap, src: ClusterMap, dst: ClusterMap) -> None:
    """Raise ``InvalidRequest`` unless shard ``index`` at map ``current`` can move from
    ``src`` to ``dst``."""
    if dst.epoch != src.epoch + 1:
        raise InvalidRequest(f"the map to move to has epoch {dst.epoch}; the next after {src.epoch} is {src.epoch + 1}")
    if len(src.addresses) != src.num_shards or len(dst.addresses) != dst.num_shards:
        raise InvalidRequest("both maps of a reshard need every shard's address")
    if src.num_shards == dst.num_shards:
        raise InvalidRequest(f"the maps of a reshard differ in size: both have {src.num_shards} shards")
    common = min(src.num_shards, dst.num_shards)
    if src.addresses[:common] != dst.addresses[:common]:
        raise InvalidRequest(
            "the shards both maps hold keep their place: the new map must start with the old one's addresses "
            f"({', '.join(src.addresses[:common])})"
        )
    if index < src.num_shards:
        if (current.epoch, current.num_shards) != (src.epoch, src.num_shards):
            raise InvalidRequest(
                f"shard {index} is at {current.describe()}, not at the map to move from ({src.describe()})"
            )
    elif index < dst.num_shards:
        # Left this cluster and empty since, or a spare never in any map (started past its end).
        retired = index >= current.num_shards and current.epoch in (src.epoch, 0)
        if not retired and (current.num_shards != dst.num_shards or (current.epoch and current.epoch != dst.epoch)):
            raise InvalidRequest(
                f"shard {index} is new in the map of epoch {dst.epoch}: start it with --shard {index} "
                f"--num-shards {dst.num_shards} and an empty data dir (it is at {current.describe()})"
            )
    else:
        raise InvalidRequest(f"shard {index} is in neither map ({src.num_shards} and {dst.num_shards} shards)")
