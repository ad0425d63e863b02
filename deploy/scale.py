"""Live resharding of a running cluster: ``ps-admin scale``'s steps, over any way of
reaching the shards.

``scale(shards, src_addresses, dst_addresses)`` moves a cluster from the shards at
``src_addresses`` to those at ``dst_addresses`` (one grown by new shards at its end, or
the same list cut short), while training goes on. Each shard keeps its own record of
where the reshard stands (``ps.elastic.cluster``), so ``scale`` reads the shards first and
carries on from there: run again after any failure (this process killed, a shard
restarted), it finishes the reshard, or ``abort`` undoes one no shard committed yet.
A new owner whose disk refuses the rows it takes in fails the reshard at once: ``scale``
undoes it (no shard committed: the cluster stays where it was, and nothing is frozen)
and says which shard to give space.

The steps, each waiting for every shard it concerns:

1. check: every shard is where the reshard starts (or already in it), new shards are
   empty and numbered for the new map, and no shard still resolves pushes from the
   reshard before (``pending_ledgers``);
2. PREPARE every shard: new owners start copying from old owners while pushes go on;
3. wait until every copy has its rows and follows the changes closely;
4. FREEZE the old owners: pushes to moving keys wait (clients retry) while the last
   changes and the push ledgers go over and new owners make them durable;
5. COMMIT new owners, then old owners: from here clients learn the new map and route by
   it; old owners drop what they gave away (``done``).

``shards`` is anything with ``get_map(address)`` and ``reshard(address, request)``
(``ShardCalls``): ``ps-admin`` passes gRPC calls, tests in-process shards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from client.membership import addresses_of
from deploy.reshard import AdminError
from protos import ps_pb2 as pb
from protos.rpc.backoff import Backoff
from ps.elastic import ClusterMap, MoveState

__all__ = ["RetryLater", "ScaleError", "ScaleReport", "ShardCalls", "scale"]

_CAUGHT_UP_VERSIONS = 50  # a copy this close to its old owner's changes is ready for the freeze
_FROZEN_POLL_S = 0.01  # while frozen, how often the new owners are asked whether their rows are all in
_REACH_S = 10.0  # how long --abort asks again a shard that does not answer before it counts as lost


class ScaleError(AdminError):
    """The reshard cannot go on; the message says why and what to do."""


class _DiskFailed(Exception):
    """A new owner's disk refused the rows it takes in (``MoveSource.disk_failed``)."""

    def __init__(self, address: str, error: str) -> None:
        super().__init__(error)
        self.address, self.error = address, error


class RetryLater(Exception):
    """A shard asked to be asked again shortly (UNAVAILABLE: it is busy with the step
    before, or restarting); ``ShardCalls`` raise it, ``scale`` waits and retries."""


class ShardCalls(Protocol):
    """How ``scale`` reaches a shard by address (GetMap and Reshard RPCs). A call the
    shard asks to retry raises ``RetryLater``; anything else fails the step."""

    def get_map(self, address: str) -> pb.GetMapResponse: ...

    def reshard(self, address: str, request: pb.ReshardRequest) -> pb.ReshardStatus: ...


@dataclass
class ScaleReport:
    """What a ``scale`` did: the maps, per new owner the rows it received from each old
    owner (the first copy: each moving row once), the changes to those rows sent after it
    while training went on (``rows_changed``), every row sent (``rows_sent``: copies begun
    again included), the seconds of each step, and how long pushes to moving keys waited."""

    src: ClusterMap
    dst: ClusterMap
    received: dict[int, dict[int, int]] = field(default_factory=dict)
    rows_changed: int = 0
    rows_sent: int = 0
    bytes_received: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    aborted: bool = False
    already_done: bool = False

    @property
    def rows_moved(self) -> int:
        return sum(sum(by_source.values()) for by_source in self.received.values())


def scale(
    shards: ShardCalls,
    src_addresses: Sequence[str],
    dst_addresses: Sequence[str],
    *,
    say: Callable[[str], None] = lambda line: None,
    abort: bool = False,
    poll_s: float = 0.05,
    timeout_s: float = 3600.0,
    serving: tuple[Sequence[Sequence[str]], Sequence[Sequence[str]]] | None = None,
    max_rows_per_s: float = 0.0,
) -> ScaleReport:
    """Move the cluster at ``src_addresses`` to ``dst_addresses`` (see the module
    docstring), saying what happens through ``say``; returns the report. Raises
    ``ScaleError`` (nothing is left half-way that a new run cannot finish).

    ``serving``: the serving shards that follow the training shards, before and after
    (each shard's replicas): once the training shards committed and every serving shard
    of the new map caught up with its training shard, they switch to the new serving map
    (new ones first); their clients (``ps-infer``) follow it as trainers do.
    ``max_rows_per_s``: the pace of each copy (one old owner to one new owner), to leave
    training its share of a busy machine; 0: as fast as it goes."""
    src_addresses, dst_addresses = list(src_addresses), list(dst_addresses)
    _check_lists(src_addresses, dst_addresses)
    if abort:
        return _abort(shards, src_addresses, dst_addresses, say)
    deadline = time.monotonic() + timeout_s
    maps = {a: _get_map(shards, a) for a in dict.fromkeys(src_addresses + dst_addresses)}
    src, dst = _maps(maps, src_addresses, dst_addresses)
    report = ScaleReport(src, dst)
    at_dst = [a for a in dst_addresses if maps[a].map.epoch == dst.epoch and maps[a].map.num_shards == dst.num_shards]
    if len(at_dst) == len(dst_addresses) and all(_phase(maps[a], dst) in ("", "done") for a in src_addresses):
        report.already_done = True
        say(f"the cluster is already at {dst.describe()}")
        if serving is not None:  # serving replicas started since (an autoscaler's) take the serving map now
            _switch_serving(shards, serving[0], serving[1], deadline, poll_s, say)
        return report
    started = time.monotonic()
    if not any(_phase(maps[a], dst) for a in maps):
        _check_start(maps, src, dst)
        maps = _wait_settled(shards, maps, deadline, poll_s, say)
    say(f"resharding from {src.num_shards} to {dst.num_shards} shards (epoch {src.epoch} -> {dst.epoch})")
    prepare = pb.ReshardRequest(
        phase=pb.ReshardRequest.PREPARE, to=dst.to_proto(), max_rows_per_s=max_rows_per_s, **{"from": src.to_proto()}
    )
    committed = any(_phase(maps[a], dst) in ("committed", "done") for a in maps)
    if not committed:
        try:
            _each(shards, maps, prepare, deadline, say, "prepare")
        except ScaleError as exc:
            if exc.code != grpc.StatusCode.INVALID_ARGUMENT:
                raise  # busy or out of time: running the command again carries on
            # Refused for good (e.g. a new owner that reaches another shard at an old owner's address).
            kept = _undo(shards, src, dst)
            undone = f"undoing it failed on {', '.join(kept)}" if kept else "the reshard was undone"
            raise ScaleError(f"{exc}; {undone}: the cluster stays at {src.describe()}") from None
        report.seconds["prepare"] = time.monotonic() - started
        t = time.monotonic()
        try:
            _wait(
                shards, dst_addresses, dst, deadline, poll_s, say, report, lambda s: s.snapshot_done and _caught_up(s)
            )
            report.seconds["copy"] = time.monotonic() - t
            t = time.monotonic()
            sources = [a for a in src_addresses if MoveState(src_addresses.index(a), src, dst).is_source]
            freeze = _request(pb.ReshardRequest.FREEZE, dst)
            _each(shards, {a: maps[a] for a in sources}, freeze, deadline, say, "freeze")
            # Pushes to moving keys wait from here to the commit: look often.
            _wait(shards, dst_addresses, dst, deadline, min(poll_s, _FROZEN_POLL_S), say, report, lambda s: s.complete)
        except _DiskFailed as exc:
            raise ScaleError(_undo_after_disk_failure(shards, src, dst, exc)) from None
        report.seconds["freeze"] = time.monotonic() - t
    t = time.monotonic()
    commit = _request(pb.ReshardRequest.COMMIT, dst)
    takers = [a for a in dst_addresses if MoveState(dst_addresses.index(a), src, dst).sources]
    _each(shards, {a: maps[a] for a in takers}, commit, deadline, say, "commit")
    _each(shards, {a: maps[a] for a in maps if a not in takers}, commit, deadline, say, "commit")
    report.seconds["commit"] = time.monotonic() - t
    _record_received(shards, dst_addresses, dst, report)
    if serving is not None:
        t = time.monotonic()
        _switch_serving(shards, serving[0], serving[1], deadline, poll_s, say)
        report.seconds["serving"] = time.monotonic() - t
    say(
        f"committed: the cluster routes by {dst.describe()}; {report.rows_moved} rows moved "
        f"({report.rows_changed} changes to them sent during the move, "
        f"{report.bytes_received / 1e6:.1f} MB in all); old owners drop the rows they gave away in the background"
    )
    report.seconds["total"] = time.monotonic() - started
    return report


def _check_lists(src: list[str], dst: list[str]) -> None:
    if not src or not dst:
        raise ScaleError("--addresses and --to each need at least one shard address")
    for name, addresses in (("--addresses", src), ("--to", dst)):
        if len(set(addresses)) != len(addresses):
            raise ScaleError(f"{name} names a shard twice: {', '.join(addresses)}")
    if len(src) == len(dst):
        raise ScaleError(f"--to has as many shards as --addresses ({len(src)}): nothing to reshard")
    common = min(len(src), len(dst))
    if src[:common] != dst[:common]:
        raise ScaleError(
            "the shards of both lists keep their places: --to must start with the addresses of --addresses "
            "(to grow) or be the first of them (to shrink); jump hashing moves keys only to or from the last shards"
        )


def _get_map(shards: ShardCalls, address: str) -> pb.GetMapResponse:
    try:
        return shards.get_map(address)
    except Exception as exc:
        raise ScaleError(f"{address}: cannot ask for its cluster map: {exc}") from None


def _phase(answer: pb.GetMapResponse, dst: ClusterMap) -> str:
    """Where the reshard to ``dst`` stands on a shard ("" if that shard has none: a
    phase it recorded of an earlier reshard does not count)."""
    ongoing = answer.reshard
    if not ongoing.phase or ClusterMap.from_proto(ongoing.to) != dst:
        return ""
    return ongoing.phase


def _maps(
    maps: dict[str, pb.GetMapResponse], src_addresses: list[str], dst_addresses: list[str]
) -> tuple[ClusterMap, ClusterMap]:
    """The maps to move from and to, as the shards of ``src_addresses`` record them."""
    for address in maps:
        ongoing = maps[address].reshard
        if ongoing.phase:
            f, t = ClusterMap.from_proto(getattr(ongoing, "from")), ClusterMap.from_proto(ongoing.to)
            if list(f.addresses) == src_addresses and list(t.addresses) == dst_addresses:
                return f, t  # a reshard under way (or done) between exactly these lists
    epochs = {maps[a].map.epoch for a in src_addresses}
    if len(epochs) != 1:
        raise ScaleError(
            "the shards of --addresses are at different cluster map epochs "
            f"({', '.join(f'{a}: {maps[a].map.epoch}' for a in src_addresses)}): is a reshard half done? "
            "run ps-admin scale with the lists of that one"
        )
    epoch = epochs.pop()
    return ClusterMap(epoch, len(src_addresses), tuple(src_addresses)), ClusterMap(
        epoch + 1, len(dst_addresses), tuple(dst_addresses)
    )


def _check_start(maps: dict[str, pb.GetMapResponse], src: ClusterMap, dst: ClusterMap) -> None:
    for i, address in enumerate(src.addresses):
        m = maps[address]
        if m.shard != i or m.map.num_shards != src.num_shards:
            raise ScaleError(
                f"{address} is shard {m.shard} of {m.map.num_shards}, but --addresses puts it at {i} of "
                f"{src.num_shards}: list the shards in order"
            )
    for i, address in enumerate(dst.addresses[src.num_shards :], start=src.num_shards):
        m = maps[address]
        retired = m.shard >= m.map.num_shards and m.map.epoch in (src.epoch, 0)  # left this cluster, or a spare
        if m.shard != i or (m.map.num_shards != dst.num_shards and not retired):
            raise ScaleError(
                f"{address} is shard {m.shard} of {m.map.num_shards}; a new shard at place {i} of --to must be "
                f"started as `ps-server --shard {i} --num-shards {dst.num_shards}` (or as a spare, with any "
                f"--num-shards up to {i}) with an empty data dir"
            )


def _wait_settled(
    shards: ShardCalls, maps: dict[str, pb.GetMapResponse], deadline: float, poll_s: float, say: Callable[[str], None]
) -> dict[str, pb.GetMapResponse]:
    """Wait until no shard keeps push ledgers of the last reshard apart; returns the maps."""
    said = False
    while True:
        pending = {a: m.reshard.pending_ledgers for a, m in maps.items() if m.reshard.pending_ledgers}
        if not pending:
            return maps
        if time.monotonic() > deadline:
            raise ScaleError(
                "some shards still keep push ledgers of the last reshard apart "
                f"({', '.join(f'{a}: {n}' for a, n in pending.items())}): a client left pushes from before it "
                "half applied and has not sent them again; run ps-admin scale again once it has"
            )
        if not said:
            say(
                "waiting for the last reshard to settle (clients may still retry pushes from before it; "
                "see ps-server --reshard-settle-s)"
            )
            said = True
        time.sleep(poll_s)
        maps = {a: _get_map(shards, a) for a in maps}


def _request(phase: int, dst: ClusterMap) -> pb.ReshardRequest:
    return pb.ReshardRequest(phase=phase, to=dst.to_proto())  # type: ignore[arg-type]


def _each(
    shards: ShardCalls,
    targets: dict[str, pb.GetMapResponse],
    request: pb.ReshardRequest,
    deadline: float,
    say: Callable[[str], None],
    what: str,
) -> None:
    """Send ``request`` to every shard of ``targets``, retrying those that say to retry."""
    for address in targets:
        while True:
            try:
                shards.reshard(address, request)
                break
            except RetryLater as exc:
                if time.monotonic() > deadline:
                    raise ScaleError(f"{what} on {address}: still refused at the deadline: {exc}") from None
                time.sleep(0.2)
            except Exception as exc:  # the refusal's status goes with it (a bad map is INVALID_ARGUMENT)
                raise ScaleError(f"{what} on {address} failed: {exc}", code=getattr(exc, "code", None)) from None


@dataclass
class _Copy:
    snapshot_done: bool
    complete: bool
    lag_versions: int
    rows: int
    error: str


def _caught_up(copy: _Copy) -> bool:
    return copy.lag_versions <= _CAUGHT_UP_VERSIONS


def _wait(
    shards: ShardCalls,
    dst_addresses: list[str],
    dst: ClusterMap,
    deadline: float,
    poll_s: float,
    say: Callable[[str], None],
    report: ScaleReport,
    ready: Callable[[_Copy], bool],
) -> None:
    """Wait until every copy to every new owner is ``ready``, saying how they go."""
    said = 0.0
    while True:
        copies: dict[tuple[int, int], _Copy] = {}
        for d, address in enumerate(dst_addresses):
            try:
                status = shards.reshard(address, _request(pb.ReshardRequest.STATUS, dst))
            except RetryLater as exc:  # restarting: its copies are not ready
                copies[(d, -1)] = _Copy(False, False, 0, 0, str(exc))
                continue
            if status.phase in ("done", "committed"):
                continue
            for s in status.sources:
                if s.disk_failed:
                    raise _DiskFailed(address, s.error)
                copies[(d, s.shard)] = _Copy(s.snapshot_done, s.complete, s.lag_versions, s.rows, s.error)
        if all(ready(c) for c in copies.values()):
            return
        if time.monotonic() > deadline:
            late = [f"{d}<-{s}" for (d, s), c in copies.items() if not ready(c)]
            raise ScaleError(f"timed out waiting for the copies {', '.join(late)}; run ps-admin scale again to go on")
        if time.monotonic() - said > 2.0:
            rows = sum(c.rows for c in copies.values())
            errors = [f"{d}<-{s}: {c.error}" for (d, s), c in copies.items() if c.error]
            say(f"  {rows} rows copied; {sum(ready(c) for c in copies.values())}/{len(copies)} copies ready")
            for line in errors:
                say(f"  {line}")
            said = time.monotonic()
        time.sleep(poll_s)


def _record_received(shards: ShardCalls, dst_addresses: list[str], dst: ClusterMap, report: ScaleReport) -> None:
    for d, address in enumerate(dst_addresses):
        try:
            status = shards.reshard(address, _request(pb.ReshardRequest.STATUS, dst))
        except Exception:  # only the report misses it
            continue
        for s in status.sources:
            report.received.setdefault(d, {})[s.shard] = int(s.first_copy_rows)
            report.rows_changed += int(s.changed_rows)
            report.rows_sent += int(s.rows)
            report.bytes_received += int(s.bytes)


def _abort(
    shards: ShardCalls, src_addresses: list[str], dst_addresses: list[str], say: Callable[[str], None]
) -> ScaleReport:
    """Undo the reshard from ``src_addresses`` that the shards record, as long as none
    committed it. The shards' own record says which reshard that is (an operator may type
    a replacement's address in ``--to``), and shards that cannot be reached are left out:
    a lost new shard holds nothing of value. Returns once no reachable shard takes part
    any more; raises ``ScaleError`` while an old owner (which may be frozen) cannot be
    reached or still takes part."""
    maps, lost = _reachable(shards, dict.fromkeys(src_addresses + dst_addresses))
    recorded = {
        (ClusterMap.from_proto(getattr(m.reshard, "from")), ClusterMap.from_proto(m.reshard.to))
        for m in maps.values()
        if m.reshard.phase and list(getattr(m.reshard, "from").addresses) == src_addresses
    }
    if not recorded:
        if lost:
            raise ScaleError(f"{_unreachable(lost)}; the others take part in no reshard from --addresses")
        raise ScaleError("nothing to abort: no shard takes part in a reshard from the shards of --addresses")
    if len(recorded) > 1:
        raise ScaleError(f"the shards record different reshards: {', '.join(t.describe() for _, t in recorded)}")
    ((src, dst),) = recorded
    if list(dst.addresses) != dst_addresses:
        say(f"the shards record the reshard to {dst.describe()}, not to the --to given: aborting theirs")
    more, also_lost = _reachable(shards, [a for a in dst.addresses if a not in maps and a not in lost])
    maps, lost = maps | more, lost | also_lost
    committed = [a for a, m in maps.items() if _phase(m, dst) in ("committed", "done") or m.map == dst.to_proto()]
    if committed:
        raise ScaleError(
            f"{', '.join(committed)} committed the reshard to {dst.describe()}: it cannot be undone; "
            "run ps-admin scale without --abort to finish it"
        )
    abort = _request(pb.ReshardRequest.ABORT, dst)
    for address in maps:  # the old owners first: their moving keys take pushes again
        if _phase(maps[address], dst):
            try:
                shards.reshard(address, abort)
            except RetryLater as exc:
                raise ScaleError(f"abort on {address}: the shard is busy or restarting ({exc}); run it again") from None
            except Exception as exc:
                raise ScaleError(f"abort on {address} failed: {exc}") from None
    after, lost_now = _reachable(shards, list(maps))
    still = [a for a, m in after.items() if _phase(m, dst)]
    old_lost = [a for a in {**lost, **lost_now} if a in src.addresses]
    if still or old_lost:
        parts = [f"{', '.join(still)} still take part in it"] if still else []
        parts += [_unreachable({a: (lost | lost_now)[a] for a in old_lost})] if old_lost else []
        raise ScaleError(
            f"the reshard to {dst.describe()} is not undone everywhere: {'; '.join(parts)}; "
            "run ps-admin scale --abort again once they answer"
        )
    for address, why in lost.items():
        say(
            f"{address} could not be reached ({why}): it keeps its record of the reshard; if it comes back, "
            "stop it and give its place a new shard with an empty data dir"
        )
    say(f"aborted: the cluster stays at {src.describe()}; stop the new shards, they hold nothing")
    return ScaleReport(src, dst, aborted=True)


def _reachable(
    shards: ShardCalls, addresses: Iterable[str], wait_s: float = _REACH_S
) -> tuple[dict[str, pb.GetMapResponse], dict[str, str]]:
    """The cluster maps of the shards that answer, and why each other one did not: one that
    asks to be asked again (busy, restarting, not listening yet) is asked again for up to
    ``wait_s`` before it counts as lost."""
    maps, lost = {}, {}
    for address in addresses:
        backoff, deadline = Backoff(0.1, 1.0), time.monotonic() + wait_s
        while True:
            try:
                maps[address] = shards.get_map(address)
                break
            except RetryLater as exc:
                if time.monotonic() >= deadline:
                    lost[address] = str(exc)
                    break
                time.sleep(backoff.next_s())
            except Exception as exc:
                lost[address] = str(exc)
                break
    return maps, lost


def _unreachable(lost: dict[str, str]) -> str:
    return "; ".join(f"{a} could not be reached ({why})" for a, why in lost.items())


def _undo(shards: ShardCalls, src: ClusterMap, dst: ClusterMap) -> list[str]:
    """Abort the reshard on every shard that takes part (the old owners of moving keys
    first: those keys take pushes again); the addresses where that failed."""
    abort = _request(pb.ReshardRequest.ABORT, dst)
    givers = [a for i, a in enumerate(src.addresses) if MoveState(i, src, dst).is_source]
    kept: list[str] = []
    for address in dict.fromkeys([*givers, *src.addresses, *dst.addresses]):
        try:
            if _phase(shards.get_map(address), dst):  # a shard never prepared has nothing to undo
                shards.reshard(address, abort)
        except Exception:  # the failed disk itself may refuse to forget what it took in
            kept.append(address)
    return kept


def _undo_after_disk_failure(shards: ShardCalls, src: ClusterMap, dst: ClusterMap, failed: _DiskFailed) -> str:
    """Abort the reshard on every shard that takes part (the old owners of moving keys
    first: those keys take pushes again); returns the one line that says what happened
    and what to do."""
    kept = _undo(shards, src, dst)
    stays = f"the cluster stays at {src.describe()}"
    if not kept:
        undone = f"the reshard was undone and {stays}"
    elif kept == [failed.address]:
        undone = (
            f"every other shard dropped the reshard and {stays} ({failed.address} keeps its record "
            "of it until the next ps-admin scale, or --abort, settles it)"
        )
    else:
        undone = (
            f"undoing it failed on {', '.join(kept)}: once they answer, run ps-admin scale --abort with the same lists"
        )
    return (
        f"{failed.address} cannot write the rows it takes in, its disk refused them ({failed.error}); "
        f"nothing acknowledged was lost: {undone}. Give it space and restart it on the same address, "
        "then run ps-admin scale again"
    )


def _switch_serving(
    shards: ShardCalls,
    src: Sequence[Sequence[str]],
    dst: Sequence[Sequence[str]],
    deadline: float,
    poll_s: float,
    say: Callable[[str], None],
) -> None:
    """Switch the serving shards to the map of ``dst`` once every replica of it caught up.
    The map names each shard's replicas as given (a ``dns:`` entry stays a name, which
    clients resolve); the switch goes to every address they resolve to now."""
    replicas = [a for shard in dst for e in shard for a in _addresses_of(e)]
    retired = [a for shard in src for e in shard for a in _addresses_of(e) if a not in replicas]
    maps = {a: _get_map(shards, a) for a in replicas + retired}
    names = tuple("+".join(shard) for shard in dst)
    done = [m for m in maps.values() if tuple(m.map.addresses) == names]
    epoch = done[0].map.epoch if done else max(m.map.epoch for m in maps.values()) + 1
    target = ClusterMap(epoch, len(dst), names)
    said = 0.0
    while True:  # every serving replica of the new map holds its training shard's rows
        maps = {a: _get_map(shards, a) for a in replicas}
        behind = [a for a, m in maps.items() if not _caught_up_follower(m) and m.map != target.to_proto()]
        if not behind:
            break
        if time.monotonic() > deadline:
            raise ScaleError(f"serving shards {', '.join(behind)} never caught up with their training shards")
        if time.monotonic() - said > 2.0:
            say(f"  waiting for serving shards {', '.join(behind)} to catch up with their training shards")
            said = time.monotonic()
        time.sleep(poll_s)
    commit = _request(pb.ReshardRequest.COMMIT, target)
    for address in sorted(replicas, key=lambda a: maps[a].shard, reverse=True) + retired:  # new ones first
        _each(shards, {address: maps.get(address) or pb.GetMapResponse()}, commit, deadline, say, "switch serving")
    say(f"serving shards switched to {target.describe()}")


def adopt_serving_map(shards: ShardCalls, address: str, peer: str, timeout_s: float = 30.0) -> bool:
    """Give the serving replica at ``address`` the serving map ``peer`` (a replica of the same
    serving cluster) routes by, when it is newer than its own: a replica started after a live
    reshard follows its training shard but was not there when the serving map switched.
    True if it took a map. Raises ``ScaleError``."""
    theirs, mine = _get_map(shards, peer), _get_map(shards, address)
    if theirs.map.epoch <= mine.map.epoch:
        return False
    target = ClusterMap.from_proto(theirs.map)
    commit = _request(pb.ReshardRequest.COMMIT, target)
    _each(shards, {address: mine}, commit, time.monotonic() + timeout_s, lambda line: None, "adopt the serving map")
    return True


def _addresses_of(entry: str) -> list[str]:
    """The serving replicas ``entry`` names: itself, or what a ``dns:HOST:PORT`` resolves to."""
    try:
        found = addresses_of(entry)
    except OSError as exc:
        raise ScaleError(f"serving replicas {entry}: the name does not resolve ({exc})") from None
    if not found:
        raise ScaleError(f"serving replicas {entry}: the name resolves to no address (no replica is ready)")
    return found


def _caught_up_follower(answer: pb.GetMapResponse) -> bool:
    f = answer.follow
    return bool(f.connected and (f.snapshots or f.applied_version) and f.lag_versions == 0 and f.lag_s == 0.0)
