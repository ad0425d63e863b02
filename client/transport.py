"""How requests reach shards: the ``Transport`` protocol and its gRPC implementation.

The client speaks in encoded request and response bytes; a transport only moves
them. It knows endpoints (addresses, numbered as the client lists them: each shard's
replicas in turn, so endpoint ``i`` is shard ``i`` when every shard has one address), not
shards. ``GrpcTransport`` keeps one channel per endpoint.

Example:
    >>> t = GrpcTransport(["127.0.0.1:1"])   # no I/O until start()
    >>> t.address(0)
    '127.0.0.1:1'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

__all__ = ["Call", "GrpcTransport", "Transport", "SERVICE_PATH", "when_done"]

SERVICE_PATH = "/ps.v1.ParameterServer/"


class Call(Protocol):
    """An RPC in flight: ``result()`` blocks and returns the response bytes or raises ``grpc.RpcError``.

    A call that can finish later also has ``add_done_callback(fn)`` (as gRPC futures do),
    calling ``fn(call)`` once it finished, at once if it already has. A call without it
    must be finished when ``Transport.call`` returns it (in-process transports).
    """

    def result(self) -> bytes: ...
    def cancel(self) -> bool: ...


class Transport(Protocol):
    """Moves encoded requests to endpoints (``endpoint``: index into the address list).
    Implementations are thread-safe."""

    def start(self) -> None: ...
    def close(self) -> None: ...
    def address(self, endpoint: int) -> str: ...
    def call(self, endpoint: int, method: str, request: bytes, timeout_s: float) -> Call: ...


def when_done(call: Call, fn: Callable[[], None]) -> None:
    """Run ``fn()`` once ``call`` has finished: from gRPC's thread, or now for a finished call."""
    add = getattr(call, "add_done_callback", None)
    if add is None:
        fn()
    else:
        add(lambda _: fn())


class GrpcTransport:
    """One insecure gRPC channel per endpoint address, opened by ``start()``.

    ``max_message_bytes`` is the largest message sent or accepted. A channel whose shard
    went away tries to reconnect at least every ``reconnect_max_s`` (gRPC's own default
    backs off to two minutes, which would keep a restarted shard unreachable long after
    it is back). Thread-safe.
    """

    def __init__(
        self, addresses: Sequence[str], max_message_bytes: int = 64 << 20, reconnect_max_s: float = 1.0
    ) -> None:
        self._addresses = list(addresses)
        self._max_bytes = max_message_bytes
        self._reconnect_max_ms = max(100, int(reconnect_max_s * 1000))
        self._channels: list[grpc.Channel] = []
        self._methods: dict[tuple[int, str], Any] = {}

    def start(self) -> None:
        if self._channels:
            return
        options = [
            ("grpc.max_receive_message_length", self._max_bytes),
            ("grpc.max_send_message_length", self._max_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", self._reconnect_max_ms),
        ]
        self._channels = [grpc.insecure_channel(a, options=options) for a in self._addresses]

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels = []
        self._methods.clear()

    def address(self, endpoint: int) -> str:
        return self._addresses[endpoint]

    def call(self, endpoint: int, method: str, request: bytes, timeout_s: float) -> Call:
        stub = self._methods.get((endpoint, method))
        if stub is None:
            if not self._channels:
                raise RuntimeError("GrpcTransport.call before start()")
            # Identity (de)serializers: the client encodes and decodes messages itself.
            stub = self._channels[endpoint].unary_unary(SERVICE_PATH + method, None, None)
            self._methods[(endpoint, method)] = stub
        future: Call = stub.future(request, timeout=timeout_s)
        return future
