"""Send a set of shard requests in parallel and retry the ones that may be retried.

Only UNAVAILABLE and DEADLINE_EXCEEDED are retried (pushes are safe to resend: each
carries its ``(client_id, seq)`` and a shard applies it at most once). Backoff is
exponential with full jitter, and everything stays inside the call's total deadline.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import grpc

from client.config import ClientConfig
from client.errors import RETRYABLE, DeadlineExceededError, convert
from client.transport import Transport

__all__ = ["call_all"]


def _backoff_s(attempt: int, config: ClientConfig) -> float:
    return random.uniform(0.0, min(config.backoff_max_s, config.backoff_initial_s * (2**attempt)))


def call_all(
    transport: Transport,
    method: str,
    requests: Sequence[tuple[int, bytes]],
    config: ClientConfig,
    deadline: float,
) -> list[bytes]:
    """Responses to ``requests`` (``(shard, request bytes)``), in the same order.

    Blocks until every request succeeded; raises the ``PSError`` of the first
    request that failed for good (non-retryable status, attempts or deadline used up).
    """
    results: list[bytes | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    attempt = 0
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            shard = requests[pending[0]][0]
            raise DeadlineExceededError(
                f"shard {shard} ({transport.address(shard)}): {method} got no answer within "
                f"deadline_s={config.deadline_s} ({attempt} attempts)",
                code=grpc.StatusCode.DEADLINE_EXCEEDED,
                shard=shard,
            )
        timeout = min(remaining, config.attempt_timeout_s or remaining)
        calls = [(i, transport.call(requests[i][0], method, requests[i][1], timeout)) for i in pending]
        failed: list[int] = []
        last: grpc.RpcError | None = None
        for i, call in calls:
            try:
                results[i] = call.result()
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE:
                    for _, other in calls:
                        other.cancel()
                    raise convert(exc, requests[i][0], transport.address(requests[i][0])) from exc
                failed.append(i)
                last = exc
        attempt += 1
        if failed and (attempt >= config.max_attempts or time.monotonic() >= deadline):
            shard = requests[failed[0]][0]
            assert last is not None
            err = convert(last, shard, transport.address(shard))
            raise type(err)(f"{err} (gave up after {attempt} attempts)", code=err.code, shard=shard) from last
        if failed:
            time.sleep(min(_backoff_s(attempt - 1, config), max(0.0, deadline - time.monotonic())))
        pending = failed
    return [r for r in results if r is not None]
