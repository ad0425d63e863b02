"""Send a set of shard requests in parallel; retry, fail over, hedge and degrade them.

Only UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED (a stopping shard) and refusals for load
are retried (pushes are safe to resend: each carries its ``(client_id, seq)`` and a shard
applies it at most once). A request is retried for as long as the call's total deadline allows, so a shard
that restarts within ``deadline_s`` costs the caller a pause, not an error. A retry goes
at once to another replica of the shard if one is in service and has not failed this
request yet; otherwise it waits a backoff (exponential from ``backoff_initial_s``, capped
at ``backoff_max_s``, full jitter). An optional ``max_attempts`` ends a request sooner;
an attempt a shard refused for load (RESOURCE_EXHAUSTED marked ``ps-overloaded``: refused
before any work) does not count, so calls that must not be sent twice (``max_attempts=1``:
a checkpoint, a publication) still wait out a busy shard; nor does one refused because its
keys are being handed over in a live reshard (UNAVAILABLE marked ``ps-moving``), so an
erase from ``ps-admin`` waits out the hand-over and then goes to the keys' new owner.

A replica that the ``ReplicaSet`` has ejected is probed with a copy of a request sent
beside the real one, once its ejection has run out; the copy's answer is not used.

With ``hedge`` (reads) and ``ClientConfig.hedge_after_s`` set, a request not answered
after that delay is also sent to a second replica; the first answer wins and the other
attempt is cancelled. With ``degrade``, a request that has not succeeded by the deadline
(or has used up its attempts) comes back as None instead of raising; a status that is not
retried raises either way.

Each failing request keeps its own last error, so an error always quotes the shard
(and address) it names. Attempts and their outcomes are recorded in the
``ReplicaSet``, which ejects failing replicas.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc

from client.config import ClientConfig
from client.errors import DeadlineExceededError, PSError, convert, is_moving, is_overloaded, is_retryable, map_epoch
from client.replicas import FAILED, NEUTRAL, OK, Outcome, Pick, ReplicaSet
from client.transport import Call, Transport, when_done
from protos.rpc.backoff import pause_s

__all__ = ["Answer", "Rerouted", "backoff_s", "call_all"]

log = logging.getLogger(__name__)


class Answer(NamedTuple):
    """A request's response bytes and the endpoint (replica) that sent them."""

    data: bytes
    endpoint: int


class Rerouted(NamedTuple):
    """A request refused for keys its shard no longer owns: the cluster moved to a map of
    ``epoch`` (newer than the one the request was routed by), which ``endpoint`` serves."""

    shard: int
    endpoint: int
    epoch: int


def backoff_s(attempt: int, config: ClientConfig) -> float:
    """The pause after failed attempt ``attempt`` (0-based): full jitter below a capped exponential
    (``protos.rpc.backoff``)."""
    return pause_s(attempt, config.backoff_initial_s, config.backoff_max_s, jitter=1.0)


_GATHER_S = 0.5  # after a non-retryable failure, how long the other attempts in flight may finish
_IN_TURN_S = 0.05  # how long the callback-free wait may delay noticing another request's failure


def call_all(
    transport: Transport,
    replicas: ReplicaSet,
    method: str,
    requests: Sequence[tuple[int, bytes]],
    config: ClientConfig,
    deadline: float,
    *,
    pinned: Sequence[int] | None = None,
    hedge: bool = False,
    degrade: bool = False,
    epoch: int | None = None,
) -> list[Answer | Rerouted | None]:
    """Answers to ``requests`` (``(shard, request bytes)``), in the same order.

    Each attempt goes to a replica ``replicas`` picks, or to ``pinned[i]`` (an endpoint)
    if given. Blocks until every request succeeded; raises the ``PSError`` of a request
    that failed for good: a non-retryable status, the deadline (``time.monotonic()``
    value) passed, or ``config.max_attempts`` used up. With ``degrade``, the last two
    give None for that request instead. Never None without ``degrade``. With ``epoch``
    (the cluster map the requests were routed by), a request refused for keys its shard
    owns no more under a newer map comes back as ``Rerouted``: the caller routes it again.
    """
    return _Exchange(transport, replicas, method, requests, config, deadline, pinned, hedge, degrade, epoch).run()


@dataclass
class _Attempt:
    pick: Pick
    call: Call


@dataclass
class _Request:
    shard: int
    data: bytes
    pinned: int | None
    inflight: dict[int, _Attempt] = field(default_factory=dict)  # attempt id -> attempt
    tried: set[int] = field(default_factory=set)  # endpoints that failed it since the last backoff
    attempts: int = 0  # attempts sent (a hedge counts with the attempt it hedges)
    backoffs: int = 0
    retry_at: float | None = None
    hedge_at: float | None = None
    error: grpc.RpcError | None = None
    error_endpoint: int = -1
    answer: Answer | Rerouted | None = None
    done: bool = False


class _Exchange:
    """One ``call_all``: every state change happens on the caller's thread; gRPC's threads
    only queue ``(request, attempt)`` when an attempt finishes."""

    def __init__(
        self,
        transport: Transport,
        replicas: ReplicaSet,
        method: str,
        requests: Sequence[tuple[int, bytes]],
        config: ClientConfig,
        deadline: float,
        pinned: Sequence[int] | None,
        hedge: bool,
        degrade: bool,
        epoch: int | None = None,
    ) -> None:
        self.transport, self.replicas, self.method, self.config = transport, replicas, method, config
        self.deadline, self.degrade, self.epoch = deadline, degrade, epoch
        self.hedge_after_s = config.hedge_after_s if hedge and pinned is None else None
        self.requests = [
            _Request(s, data, None if pinned is None else pinned[i]) for i, (s, data) in enumerate(requests)
        ]
        self.finished: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        self.ids = itertools.count()
        self.started = time.monotonic()
        self.warned = False
        # (request, when, why) of the first failure for good: a non-retryable status (why
        # None) or max_attempts used up; the exchange raises it once the others settle.
        self.fatal: tuple[int, float, str | None] | None = None

    def run(self) -> list[Answer | Rerouted | None]:
        try:
            lean = self.hedge_after_s is None
            # The last first attempt is made on this thread, which would only wait for it
            # otherwise (not when degrading: a failure meanwhile should still be retried).
            here = self.transport.call_here if lean and not self.degrade else None
            last = len(self.requests) - 1
            for i in range(len(self.requests)):
                self._send(i, notify=not lean, here=here if i == last else None)
            if lean and self._wait_in_turn():
                return [r.answer for r in self.requests]
            while not all(r.done for r in self.requests):
                now = time.monotonic()
                if self.fatal is not None:
                    # Let the attempts in flight finish (for a moment), so the error names
                    # every shard that failed alike, then raise; nothing new is sent.
                    if now - self.fatal[1] >= _GATHER_S or not any(r.inflight for r in self.requests):
                        self._raise_fatal()
                elif now >= self.deadline:
                    self._expire()
                    break
                wake = self.deadline if self.fatal is None else self.fatal[1] + _GATHER_S
                for i, r in enumerate(self.requests):
                    if r.done or self.fatal is not None:
                        continue
                    if r.retry_at is not None and r.retry_at <= now:
                        r.retry_at = None
                        self._send(i)
                    if r.hedge_at is not None and r.hedge_at <= now:
                        r.hedge_at = None
                        self._send(i, hedge=True)
                    wake = min(wake, r.retry_at or wake, r.hedge_at or wake)
                try:
                    event = self.finished.get(timeout=max(0.0, wake - time.monotonic()))
                except queue.Empty:
                    continue
                self._finish(*event)
                while True:
                    try:
                        self._finish(*self.finished.get_nowait())
                    except queue.Empty:
                        break
            if self.fatal is not None:
                self._raise_fatal()
        finally:
            self._cancel_all(NEUTRAL)  # only left on an error: a raise while others were in flight
        if self.warned:
            log.info("%s: answered (%.1f s after the first failure)", self.method, time.monotonic() - self.started)
        return [r.answer for r in self.requests]

    def _wait_in_turn(self) -> bool:
        """The common case without callbacks: wait for each first attempt in turn. True when
        all answered; otherwise (a failure, or no answer within ``_IN_TURN_S``) every attempt
        still in flight reports to ``finished`` from here on and ``run``'s loop takes over.

        Each attempt's callback and queue hop cost the caller's thread about as much as the
        rest of a small exchange, and under concurrency every thread waits for the GIL."""
        until = min(self.deadline, time.monotonic() + _IN_TURN_S)
        for r in self.requests:
            if len(r.inflight) != 1:
                break
            aid, attempt = next(iter(r.inflight.items()))
            call = attempt.call
            try:
                data = (
                    call.result(max(0.0, until - time.monotonic()))
                    if hasattr(call, "add_done_callback")
                    else call.result()
                )
            except (grpc.RpcError, TimeoutError, grpc.FutureTimeoutError):
                break
            del r.inflight[aid]
            self._answered(r, attempt, data)
        else:
            return True
        for i, r in enumerate(self.requests):
            for aid, attempt in r.inflight.items():
                self._notify(i, aid, attempt.call)
        return False

    def _notify(self, i: int, aid: int, call: Call) -> None:
        when_done(call, lambda: self.finished.put((i, aid)))

    # -- attempts -------------------------------------------------------------------
    def _send(self, i: int, hedge: bool = False, notify: bool = True, here: Callable[..., Call] | None = None) -> None:
        r = self.requests[i]
        busy = {a.pick.endpoint for a in r.inflight.values()}
        if r.pinned is not None:
            pick: Pick | None = self.replicas.take(r.pinned)
        elif hedge:
            pick = self.replicas.pick_other(r.shard, busy)
        else:
            pick = self.replicas.pick(r.shard, r.tried | busy)
        if pick is None:
            return  # no replica to hedge to
        remaining = self.deadline - time.monotonic()
        timeout = max(0.001, min(remaining, self.config.attempt_timeout_s or remaining))
        try:
            call = (here or self.transport.call)(pick.endpoint, self.method, r.data, timeout)
        except BaseException:
            self.replicas.release(pick, NEUTRAL)
            raise
        aid = next(self.ids)
        r.inflight[aid] = _Attempt(pick, call)
        if not hedge:
            r.attempts += 1
            if self.hedge_after_s is not None:
                r.hedge_at = time.monotonic() + self.hedge_after_s
        if notify:
            self._notify(i, aid, call)
        if r.pinned is None and not hedge:
            probe = self.replicas.probe(r.shard, exclude={pick.endpoint})
            if probe is not None:
                self._probe(probe, r.data, timeout)

    def _probe(self, pick: Pick, data: bytes, timeout: float) -> None:
        """Send a copy of a request to a half-open replica; only its outcome is used, recorded
        when it finishes (perhaps after this exchange has returned)."""
        try:
            call = self.transport.call(pick.endpoint, self.method, data, timeout)
        except BaseException:
            self.replicas.release(pick, NEUTRAL)
            raise
        replicas = self.replicas

        def record() -> None:
            outcome: Outcome = FAILED
            try:
                call.result()
                outcome = OK
            except grpc.RpcError:
                pass
            finally:
                replicas.release(pick, outcome)

        when_done(call, record)

    def _finish(self, i: int, aid: int) -> None:
        r = self.requests[i]
        attempt = r.inflight.pop(aid, None)
        if attempt is None:
            return  # cancelled: already accounted for
        try:
            data = attempt.call.result()
        except grpc.RpcError as exc:
            self._failed(i, attempt, exc)
            return
        self._answered(r, attempt, data)

    def _answered(self, r: _Request, attempt: _Attempt, data: bytes) -> None:
        self.replicas.release(attempt.pick, OK)
        r.answer, r.done, r.hedge_at, r.retry_at = Answer(data, attempt.pick.endpoint), True, None, None
        self._cancel(r, FAILED)  # the slower of a hedged pair lost the race

    def _failed(self, i: int, attempt: _Attempt, exc: grpc.RpcError) -> None:
        r = self.requests[i]
        newer = map_epoch(exc) if self.epoch is not None else None
        # A replica behind the cluster map (started after a live reshard, or not reached yet by
        # a serving map switch, which goes one replica at a time) fails this call as a failing
        # replica does: the others of its shard answer it, or, alone, it is asked again.
        behind = newer is not None and self.epoch is not None and newer < self.epoch and r.pinned is None
        retryable = is_retryable(exc) or behind
        if is_overloaded(exc):  # refused before any work: safe to send again, and no attempt used up
            self.replicas.count_refusal(attempt.pick.endpoint)
            r.attempts -= 1
        elif is_moving(exc):  # its keys are being handed over, nothing applied: the same
            r.attempts -= 1
        self.replicas.release(attempt.pick, FAILED if retryable else NEUTRAL)
        r.error, r.error_endpoint = exc, attempt.pick.endpoint
        if newer is not None and self.epoch is not None and newer > self.epoch:
            r.answer, r.done, r.retry_at, r.hedge_at = Rerouted(r.shard, attempt.pick.endpoint, newer), True, None, None
            self._cancel(r, NEUTRAL)
            return
        if not retryable:
            r.done, r.retry_at, r.hedge_at = True, None, None
            if self.fatal is None:
                self.fatal = (i, time.monotonic(), None)
            return
        if self.fatal is not None:
            r.done = True  # no more attempts: the exchange is failing
            return
        r.tried.add(attempt.pick.endpoint)
        if r.inflight:
            return  # its hedge (or the attempt it hedged) may still answer
        r.hedge_at = None
        if self.config.max_attempts is not None and r.attempts >= self.config.max_attempts:
            if self.degrade:
                self._give_up([i], f"max_attempts={r.attempts}")
            else:
                r.done = True
                if self.fatal is None:
                    self.fatal = (i, time.monotonic(), f"max_attempts={r.attempts}")
            return
        if r.pinned is None and self.replicas.available(r.shard, exclude=r.tried):
            log.debug(
                "%s: shard %d failing over from %s", self.method, r.shard, self.transport.address(r.error_endpoint)
            )
            self._send(i)
            return
        r.tried.clear()
        if not self.warned:
            self.warned = True
            log.warning(
                "%s: retrying for up to %.1f s: %s",
                self.method,
                self.deadline - time.monotonic(),
                convert(exc, r.shard, self.transport.address(attempt.pick.endpoint)),
            )
        r.retry_at = min(self.deadline, time.monotonic() + backoff_s(r.backoffs, self.config))
        r.backoffs += 1

    def _raise_fatal(self) -> None:
        assert self.fatal is not None
        i, _, why = self.fatal
        r = self.requests[i]
        assert r.error is not None
        others = [j for j, o in enumerate(self.requests) if j != i and o.error is not None and o.answer is None]
        if why is not None:
            raise self._gave_up([i, *others], why) from r.error
        err = convert(
            r.error,
            r.shard,
            self.transport.address(r.error_endpoint),
            self.transport.tls,
            self.transport.client_certificate,
        )
        raise err.reworded(f"{err}{self._also(others)}{_hinted(err)}") from r.error

    def _expire(self) -> None:
        late = [i for i, r in enumerate(self.requests) if not r.done]
        for i in late:
            self._cancel(self.requests[i], FAILED)  # no answer in time
        self._give_up(late, f"deadline_s={self.config.deadline_s} passed")

    def _give_up(self, failed: list[int], why: str) -> None:
        if self.degrade:
            for i in failed:
                r = self.requests[i]
                self._cancel(r, NEUTRAL)
                r.done, r.answer, r.retry_at, r.hedge_at = True, None, None, None
            return
        raise self._gave_up(failed, why)

    def _cancel(self, r: _Request, outcome: Outcome) -> None:
        for attempt in r.inflight.values():
            attempt.call.cancel()
            self.replicas.release(attempt.pick, outcome)
        r.inflight.clear()

    def _cancel_all(self, outcome: Outcome) -> None:
        for r in self.requests:
            self._cancel(r, outcome)

    # -- errors ---------------------------------------------------------------------
    def _where(self, r: _Request) -> str:
        """``ADDRESS`` of the endpoint that failed ``r`` last, or every replica's if none did."""
        if r.error_endpoint >= 0:
            return self.transport.address(r.error_endpoint)
        endpoints = [r.pinned] if r.pinned is not None else self.replicas.endpoints(r.shard)
        return "|".join(self.transport.address(e) for e in endpoints)

    def _gave_up(self, failed: Sequence[int], why: str) -> PSError:
        """The error for a request that ran out of time or attempts, naming its shard."""
        r = self.requests[failed[0]]
        also = self._also(failed[1:])
        tries = max(r.attempts, 1)
        if r.error is None:
            return DeadlineExceededError(
                f"shard {r.shard} ({self._where(r)}): {self.method} got no answer before {why} ({tries} attempts){also}",
                code=grpc.StatusCode.DEADLINE_EXCEEDED,
                shard=r.shard,
            )
        err = convert(r.error, r.shard, self._where(r), self.transport.tls, self.transport.client_certificate)
        err.shard = r.shard
        return err.reworded(f"{err} (gave up after {tries} attempts, {why}){also}{_hinted(err)}")

    def _also(self, others: Sequence[int]) -> str:
        """``; shard 1 (ADDRESS) failed too: STATUS: first line`` for each other failing request."""
        parts = []
        for j in others:
            r = self.requests[j]
            exc = r.error
            what = (
                f"{exc.code().name}: {str(exc.details()).splitlines()[0] if exc.details() else ''}"
                if exc
                else "no answer"
            )
            parts.append(f"; shard {r.shard} ({self._where(r)}) failed too: {what}")
        return "".join(parts)


def _hinted(err: PSError) -> str:
    """``: HINT`` ending the message of an error that knows what to do, else ""."""
    return f": {err.hint}" if err.hint else ""
