"""Replicas of each shard: which one a read goes to, and circuit breaking of failing ones.

Endpoints (replica addresses) are numbered in one flat list, shard 0's replicas first;
the transport has one channel per endpoint. ``ReplicaSet.pick`` chooses the endpoint of a
shard for one attempt: the in-service replica with the fewest attempts in flight, ties
taken round-robin; if every replica is ejected, the one whose ejection ends first (a call
never fails only because the breaker is open).

``release`` records how an attempt ended. ``eject_after_failures`` consecutive failed
attempts eject a replica for ``eject_s``. Once that has run out, the replica is half-open:
``probe`` hands it out once, for a copy of a real request sent beside it (the caller
waits for the real one only, so a probe of a hung replica costs no caller time). A probe
that succeeds puts the replica back (as does any success); one that fails ejects it
again for twice as long as before, up to ``eject_max_s``. A shard with one replica (a
training cluster) is never ejected: there is nothing to spread to, so its calls behave
exactly as without replicas.

Example:
    >>> rs = ReplicaSet([["h:1", "h:2"]], eject_after_failures=1, eject_s=1.0, eject_max_s=30.0)
    >>> first = rs.pick(0, now=0.0); rs.release(first, FAILED, now=0.0)
    >>> rs.pick(0, now=0.1).endpoint != first.endpoint   # h:1 is ejected until t=1.0
    True
    >>> parse_addresses("h:1+h:2,h:3")
    [['h:1', 'h:2'], ['h:3']]
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from client.errors import InvalidRequestError
from protos.rpc.names import DNS_PREFIX

__all__ = [
    "FAILED",
    "NEUTRAL",
    "OK",
    "DNS_PREFIX",
    "Change",
    "Outcome",
    "Pick",
    "ReplicaSet",
    "State",
    "normalize_addresses",
    "parse_addresses",
    "placeholder",
]

log = logging.getLogger(__name__)

Outcome = Literal["ok", "failed", "neutral"]
OK: Outcome = "ok"
FAILED: Outcome = "failed"  # a retryable failure, a missed deadline, or a hedge race lost
NEUTRAL: Outcome = "neutral"  # says nothing about the replica (cancelled, request rejected)


REPLICA_SEPARATORS = re.compile(r"[+|]")
"""Between the replicas of one shard: ``+``, which no address holds and no shell reads, or ``|``."""


def _check_address(address: str, where: str) -> str:
    host, sep, port = placeholder(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise InvalidRequestError(f"{where}: {address!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    return address


def placeholder(entry: str) -> str:
    """The address a client calls for ``entry`` until its names are resolved: a
    ``dns:HOST:PORT`` entry's ``HOST:PORT`` (gRPC resolves that name itself), or ``entry``."""
    return entry[len(DNS_PREFIX) :] if entry.startswith(DNS_PREFIX) else entry


def parse_addresses(text: str) -> list[list[str]]:
    """``HOST:PORT+HOST:PORT,HOST:PORT`` as replica lists, shard 0 first.

    Shards are separated by ``,``, the replicas of one shard by ``+`` (safe unquoted in a
    shell) or ``|`` (the older form: a shell reads it as a pipe, so it must be quoted);
    spaces around any of them are ignored. A ``dns:HOST:PORT`` entry stands for every
    address HOST resolves to, each a replica (``client.membership``). Raises ``InvalidRequestError`` (a ``ValueError``) naming the bad
    part: an empty shard or replica, a missing or bad port, an address given twice.

    >>> parse_addresses("10.0.0.1:50051, 10.0.0.2:50051+10.0.0.3:50051")
    [['10.0.0.1:50051'], ['10.0.0.2:50051', '10.0.0.3:50051']]
    >>> parse_addresses("h:1|h:2")
    [['h:1', 'h:2']]
    """
    if not text.strip():
        raise InvalidRequestError(
            "addresses: empty; expected HOST:PORT per shard in shard order, separated by ',', "
            "with the replicas of one shard separated by '+' (e.g. h:1+h:2,h:3)"
        )
    shards = []
    for i, item in enumerate(text.split(",")):
        if not item.strip():
            raise InvalidRequestError(f"addresses {text!r}: shard {i} is empty (two ',' in a row, or a trailing ',')")
        replicas = [r.strip() for r in REPLICA_SEPARATORS.split(item)]
        if not all(replicas):
            raise InvalidRequestError(f"addresses {text!r}: shard {i} ({item.strip()!r}) has an empty replica")
        shards.append([_check_address(r, f"addresses {text!r}: shard {i}") for r in replicas])
    return normalize_addresses(shards)


def normalize_addresses(addresses: Sequence[str | Sequence[str]]) -> list[list[str]]:
    """``PSClient``'s ``addresses`` as one replica list per shard; ``InvalidRequestError`` if malformed.

    Each element is a ``"HOST:PORT"`` (one replica) or a sequence of them (the shard's
    replicas, in any order). An address may appear once only.
    """
    if isinstance(addresses, str) or not addresses:
        raise InvalidRequestError(
            "addresses: expected a non-empty list with one entry per shard in shard order: HOST:PORT, "
            "or a list of HOST:PORT for a shard's replicas"
        )
    out: list[list[str]] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(addresses):
        replicas = [entry] if isinstance(entry, str) else list(entry)
        if not replicas or not all(isinstance(r, str) and r for r in replicas):
            raise InvalidRequestError(f"addresses: shard {i} is {entry!r}; expected HOST:PORT or a list of them")
        for r in replicas:
            if r in seen:
                raise InvalidRequestError(f"addresses: {r} is given twice (shard {seen[r]} and shard {i})")
            seen[r] = i
        out.append(replicas)
    return out


State = Literal["serving", "pending", "draining", "gone"]
"""A replica's membership: ``serving`` takes calls (unless ejected); ``pending`` joined but
has not answered a health check SERVING yet; ``draining`` reports NOT_SERVING (it is
stopping, or not ready): called only when no serving replica is left; ``gone`` left the
shard's membership: never called again."""


@dataclass
class _Replica:
    endpoint: int
    shard: int
    address: str
    state: State = "serving"
    inflight: int = 0
    failures: int = 0  # consecutive failed attempts
    ejections: int = 0  # ejections since it last answered; doubles the next one
    ejected_until: float = 0.0  # time.monotonic(); 0.0: in service
    probing: bool = False  # half-open: its one probe is in flight
    refused: int = 0  # attempts it refused for load (RESOURCE_EXHAUSTED, ps-overloaded), ever


@dataclass(frozen=True)
class Pick:
    """The endpoint an attempt goes to; ``probe``: it is the half-open probe of an ejected replica."""

    endpoint: int
    probe: bool = False


@dataclass(frozen=True)
class Change:
    """What ``ReplicaSet.set_members`` changed: endpoints that joined (``new``: numbered
    now, so the transport needs a channel for them) and endpoints that left."""

    joined: tuple[int, ...] = ()
    left: tuple[int, ...] = ()
    new: tuple[int, ...] = ()


class ReplicaSet:
    """Membership, health and load of every replica of every shard; thread-safe (one short lock).

    ``replicas[s]`` are shard ``s``'s first addresses; endpoints are numbered across all
    shards in that order (``endpoints(s)``) and then in the order replicas join
    (``set_members``). An endpoint keeps its number for good, also after it left: a
    replica that comes back gets its old one. Every ``pick`` (or ``take``) must be
    matched by one ``release`` with the attempt's outcome.
    """

    def __init__(
        self, replicas: Sequence[Sequence[str]], *, eject_after_failures: int, eject_s: float, eject_max_s: float
    ) -> None:
        self._replicas: list[_Replica] = []
        self._by_address: dict[str, _Replica] = {}
        self._by_shard: list[list[_Replica]] = []  # members that have not left, endpoint order
        for s, addresses in enumerate(replicas):
            group = [self._new(s, a, "serving") for a in addresses]
            self._by_shard.append(group)
        self._eject_after = eject_after_failures
        self._eject_s = eject_s
        self._eject_max_s = eject_max_s
        self._turns = [itertools.count() for _ in self._by_shard]
        self._lock = threading.Lock()
        self.refused_before = 0  # refusals counted by the set this one replaced (an older cluster map)

    @property
    def num_shards(self) -> int:
        return len(self._by_shard)

    @property
    def addresses(self) -> list[str]:
        """Every member's address (not those that left), shard by shard."""
        with self._lock:
            return [r.address for group in self._by_shard for r in group]

    @property
    def all_addresses(self) -> list[str]:
        """Every endpoint's address, by endpoint number (also those that left)."""
        with self._lock:
            return [r.address for r in self._replicas]

    def members(self, shard: int | None = None) -> list[tuple[str, ...]]:
        """Each shard's member addresses (or ``shard``'s alone, as a one-item list)."""
        with self._lock:
            groups = self._by_shard if shard is None else [self._by_shard[shard]]
            return [tuple(r.address for r in group) for group in groups]

    def endpoints(self, shard: int | None = None) -> list[int]:
        """The members' endpoints: of ``shard``, or of every shard in shard order."""
        with self._lock:
            groups = self._by_shard if shard is None else [self._by_shard[shard]]
            return [r.endpoint for group in groups for r in group]

    def address(self, endpoint: int) -> str:
        return self._replicas[endpoint].address

    def shard_of(self, endpoint: int) -> int:
        return self._replicas[endpoint].shard

    def state(self, endpoint: int) -> State:
        return self._replicas[endpoint].state

    def inflight(self, endpoint: int) -> int:
        return self._replicas[endpoint].inflight

    def available(self, shard: int, exclude: Collection[int] = ()) -> bool:
        """Whether a replica of ``shard`` outside ``exclude`` takes calls (serving or draining, not ejected)."""
        with self._lock:
            return any(
                r.state in ("serving", "draining") and not r.ejected_until
                for r in self._by_shard[shard]
                if r.endpoint not in exclude
            )

    def set_members(self, shard: int, addresses: Sequence[str], *, admit: bool = False) -> Change:
        """Make ``addresses`` the members of ``shard``. A replica that left takes no new
        call from now on (calls in flight end as they do); one that joins is ``pending``
        until ``set_health`` says it is SERVING, or at once with ``admit`` (``serving``)."""
        joined: list[int] = []
        left: list[int] = []
        new: list[int] = []
        with self._lock:
            wanted = dict.fromkeys(addresses)
            group = self._by_shard[shard]
            for member in group:
                if member.address not in wanted:
                    member.state = "gone"
                    left.append(member.endpoint)
                    log.info("shard %d replica %s left", shard, member.address)
            kept = [m for m in group if m.state != "gone"]
            present = {m.address for m in kept}
            for address in wanted:
                if address in present:
                    continue
                state: State = "serving" if admit else "pending"
                r = self._by_address.get(address)
                if r is None:
                    r = self._new(shard, address, state)
                    new.append(r.endpoint)
                else:  # came back, or moved from another shard's membership (a reshard)
                    if r.shard != shard and r.state != "gone":
                        self._by_shard[r.shard].remove(r)
                        r.state = "gone"
                    r.shard, r.state = shard, state
                    r.failures, r.ejections, r.ejected_until = 0, 0, 0.0
                kept.append(r)
                joined.append(r.endpoint)
                log.info("shard %d replica %s joined (%s)", shard, address, state)
            kept.sort(key=lambda r: r.endpoint)
            self._by_shard[shard] = kept
        return Change(tuple(joined), tuple(left), tuple(new))

    def set_health(self, endpoint: int, serving: bool) -> bool:
        """What a health check of ``endpoint`` answered: SERVING puts a pending or draining
        replica in service, NOT_SERVING has a serving one drain. True if it changed."""
        with self._lock:
            r = self._replicas[endpoint]
            was = r.state
            if serving and was in ("pending", "draining"):
                r.state = "serving"
            elif not serving and was == "serving":
                r.state = "draining"
            else:
                return False  # a pending one that is not ready stays out until it is
        log.info("shard %d replica %s: %s -> %s", r.shard, r.address, was, r.state)
        return True

    def pick(self, shard: int, exclude: Collection[int] = (), now: float | None = None) -> Pick:
        """The endpoint of ``shard`` for the next attempt, preferring replicas outside
        ``exclude``, serving ones over draining ones, and ones that take calls over the
        rest: a call never fails only because no replica looks fit."""
        now = time.monotonic() if now is None else now
        with self._lock:
            group = self._by_shard[shard]
            if not group:
                raise InvalidRequestError(f"shard {shard} has no replica", shard=shard)
            outside = [r for r in group if r.endpoint not in exclude]
            choice = (
                self._choose(outside, shard, "serving")
                or self._choose(group, shard, "serving")
                or self._choose(outside, shard, "draining")
                or self._choose(group, shard, "draining")
            )
            if choice is None:
                # None takes calls: try the one that comes back first (a pending one last).
                choice = Pick(min(group, key=lambda r: (r.state == "pending", r.ejected_until)).endpoint)
            return self._count(choice)

    def pick_other(self, shard: int, exclude: Collection[int]) -> Pick | None:
        """A replica of ``shard`` outside ``exclude`` that takes calls (for a hedge), or None."""
        with self._lock:
            outside = [r for r in self._by_shard[shard] if r.endpoint not in exclude]
            choice = self._choose(outside, shard, "serving") or self._choose(outside, shard, "draining")
            return None if choice is None else self._count(choice)

    def probe(self, shard: int, exclude: Collection[int] = (), now: float | None = None) -> Pick | None:
        """A replica of ``shard`` (outside ``exclude``) whose ejection has run out and whose
        probe is not in flight, now marked as probing; or None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for r in self._by_shard[shard]:
                if r.ejected_until and r.ejected_until <= now and not r.probing and r.endpoint not in exclude:
                    return self._count(Pick(r.endpoint, probe=True))
        return None

    def take(self, endpoint: int) -> Pick:
        """Count an attempt pinned to ``endpoint`` (e.g. ``Stats`` of every replica)."""
        with self._lock:
            self._replicas[endpoint].inflight += 1
        return Pick(endpoint)

    def release(self, pick: Pick, outcome: Outcome, now: float | None = None) -> None:
        """Record how the attempt of ``pick`` ended; may eject the replica or put it back."""
        now = time.monotonic() if now is None else now
        with self._lock:
            r = self._replicas[pick.endpoint]
            r.inflight -= 1
            if pick.probe:
                r.probing = False
            if outcome == NEUTRAL or r.state == "gone":
                return
            if sum(m.state in ("serving", "draining") for m in self._by_shard[r.shard]) <= 1:
                return  # nothing to spread to: never ejected
            if outcome == OK:
                if r.ejected_until:
                    log.info("shard %d replica %s answered again: back in service", r.shard, r.address)
                r.failures, r.ejections, r.ejected_until = 0, 0, 0.0
                return
            r.failures += 1
            if pick.probe or (not r.ejected_until and r.failures >= self._eject_after):
                r.ejections += 1
                ejected_s = min(self._eject_max_s, self._eject_s * 2.0 ** min(r.ejections - 1, 60))
                r.ejected_until = now + ejected_s
                why = "its probe failed" if pick.probe else f"{r.failures} failed attempts in a row"
                log.warning("shard %d replica %s ejected for %.1f s: %s", r.shard, r.address, ejected_s, why)

    def count_refusal(self, endpoint: int) -> None:
        """Count an attempt ``endpoint`` refused for load (the shard pushed back)."""
        with self._lock:
            self._replicas[endpoint].refused += 1

    def refusals(self) -> int:
        """Attempts refused for load since the client started: by every endpoint of this set
        (also those that left), and ``refused_before``."""
        with self._lock:
            return self.refused_before + sum(r.refused for r in self._replicas)

    def health(self, now: float | None = None) -> list[dict[str, Any]]:
        """Per member, in the order of ``addresses``: ``address``, ``shard``, ``state``
        (``in_service``, ``ejected``, ``probing``: its probe is in flight, ``pending``: not
        healthy yet, ``draining``: reports NOT_SERVING), ``ejected_for_s`` (time left),
        ``inflight``, ``failures`` in a row, ``refused``: attempts it refused for load."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [
                {
                    "address": r.address,
                    "shard": r.shard,
                    "state": r.state
                    if r.state != "serving"
                    else "in_service"
                    if not r.ejected_until
                    else "probing"
                    if r.probing
                    else "ejected",
                    "ejected_for_s": max(0.0, r.ejected_until - now) if r.ejected_until else 0.0,
                    "inflight": r.inflight,
                    "failures": r.failures,
                    "refused": r.refused,
                }
                for group in self._by_shard
                for r in group
            ]

    # -- under the lock (or while building) ----------------------------------------
    def _new(self, shard: int, address: str, state: State) -> _Replica:
        r = _Replica(len(self._replicas), shard, address, state)
        self._replicas.append(r)
        self._by_address[address] = r
        return r

    def _count(self, choice: Pick) -> Pick:
        replica = self._replicas[choice.endpoint]
        replica.inflight += 1
        replica.probing = replica.probing or choice.probe
        return choice

    def _choose(self, candidates: list[_Replica], shard: int, state: State) -> Pick | None:
        healthy = [r for r in candidates if r.state == state and not r.ejected_until]
        if not healthy:
            return None
        if len(healthy) == 1:
            return Pick(healthy[0].endpoint)
        # Fewest in flight; ties go round-robin, by a count that turns with every pick.
        fewest = min(r.inflight for r in healthy)
        ties = [r for r in healthy if r.inflight == fewest]
        return Pick(ties[next(self._turns[shard]) % len(ties)].endpoint)
