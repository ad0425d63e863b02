"""Send a set of shard requests in parallel and retry the ones that may be retried.

Only UNAVAILABLE, DEADLINE_EXCEEDED and CANCELLED (a stopping shard) are retried (pushes are safe to resend: each
carries its ``(client_id, seq)`` and a shard applies it at most once). A request is
retried for as long as the call's total deadline allows, so a shard that restarts
within ``deadline_s`` costs the caller a pause, not an error. Backoff is exponential
from ``backoff_initial_s``, capped at ``backoff_max_s``, with full jitter; an optional
``max_attempts`` ends a call sooner.

Each failing request keeps its own last error, so an error always quotes the shard
(and address) it names.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence

import grpc

from client.config import ClientConfig
from client.errors import RETRYABLE, DeadlineExceededError, PSError, convert
from client.transport import Transport

__all__ = ["backoff_s", "call_all"]

log = logging.getLogger(__name__)


def backoff_s(attempt: int, config: ClientConfig) -> float:
    """The pause after failed attempt ``attempt`` (0-based): full jitter below a capped exponential."""
    return random.uniform(0.0, min(config.backoff_max_s, config.backoff_initial_s * (2.0 ** min(attempt, 60))))


def call_all(
    transport: Transport,
    method: str,
    requests: Sequence[tuple[int, bytes]],
    config: ClientConfig,
    deadline: float,
) -> list[bytes]:
    """Responses to ``requests`` (``(shard, request bytes)``), in the same order.

    Blocks until every request succeeded; raises the ``PSError`` of the first request
    that failed for good: a non-retryable status, the deadline (``time.monotonic()``
    value) passed, or ``config.max_attempts`` used up.
    """
    results: list[bytes | None] = [None] * len(requests)
    errors: dict[int, grpc.RpcError] = {}  # request index -> its last retryable failure
    pending = list(range(len(requests)))
    started = time.monotonic()
    attempt = 0
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = f"deadline_s={config.deadline_s} passed"
            raise _gave_up(transport, method, requests, pending, errors, attempt, why)
        timeout = min(remaining, config.attempt_timeout_s or remaining)
        calls = [(i, transport.call(requests[i][0], method, requests[i][1], timeout)) for i in pending]
        failed: list[int] = []
        final: list[int] = []  # failed with a status that is not retried
        for i, call in calls:
            try:
                results[i] = call.result()
                errors.pop(i, None)
            except grpc.RpcError as exc:
                (failed if exc.code() in RETRYABLE else final).append(i)
                errors[i] = exc
        if final:
            # Every call of the round has answered, so the error can name all failing shards.
            i = final[0]
            err = convert(errors[i], requests[i][0], transport.address(requests[i][0]))
            raise type(err)(f"{err}{_also(transport, requests, [*final[1:], *failed], errors)}", code=err.code,
                            shard=err.shard) from errors[i]  # fmt: skip
        attempt += 1
        if not failed:
            if attempt > 1:
                log.info("%s: answered after %d attempts (%.1f s)", method, attempt, time.monotonic() - started)
            break
        if config.max_attempts is not None and attempt >= config.max_attempts:
            raise _gave_up(transport, method, requests, failed, errors, attempt, f"max_attempts={attempt}")
        if attempt == 1:
            i = failed[0]
            log.warning("%s: retrying for up to %.0f s: %s", method, deadline - time.monotonic(),
                        convert(errors[i], requests[i][0], transport.address(requests[i][0])))  # fmt: skip
        time.sleep(min(backoff_s(attempt - 1, config), max(0.0, deadline - time.monotonic())))
        pending = failed
    return [r for r in results if r is not None]


def _gave_up(
    transport: Transport,
    method: str,
    requests: Sequence[tuple[int, bytes]],
    failed: Sequence[int],
    errors: dict[int, grpc.RpcError],
    attempt: int,
    why: str,
) -> PSError:
    """The error for a call that ran out of time or attempts, naming the first failing shard."""
    i = failed[0]
    shard = requests[i][0]
    address = transport.address(shard)
    also = _also(transport, requests, failed[1:], errors)
    last = errors.get(i)
    if last is None:
        return DeadlineExceededError(
            f"shard {shard} ({address}): {method} got no answer before {why} ({attempt} attempts){also}",
            code=grpc.StatusCode.DEADLINE_EXCEEDED,
            shard=shard,
        )
    err = convert(last, shard, address)
    return type(err)(f"{err} (gave up after {attempt} attempts, {why}){also}", code=err.code, shard=shard)


def _also(transport: Transport, requests: Sequence[tuple[int, bytes]], others: Sequence[int],
          errors: dict[int, grpc.RpcError]) -> str:  # fmt: skip
    """``; shard 1 (ADDRESS) failed too: STATUS: first line`` for each other failing request."""
    parts = []
    for j in others:
        shard = requests[j][0]
        exc = errors.get(j)
        what = (
            f"{exc.code().name}: {str(exc.details()).splitlines()[0] if exc.details() else ''}" if exc else "no answer"
        )
        parts.append(f"; shard {shard} ({transport.address(shard)}) failed too: {what}")
    return "".join(parts)
