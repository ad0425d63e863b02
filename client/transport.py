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

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import grpc

from protos.tls import open_channel

__all__ = ["Call", "GrpcTransport", "Transport", "SERVICE_PATH", "when_done"]

SERVICE_PATH = "/ps.v1.ParameterServer/"


class Call(Protocol):
    """An RPC in flight: ``result()`` blocks and returns the response bytes or raises ``grpc.RpcError``.

    A call that can finish later also has ``add_done_callback(fn)`` (as gRPC futures do),
    calling ``fn(call)`` once it finished, at once if it already has, and takes
    ``result(timeout_s)``, raising ``TimeoutError`` (or ``grpc.FutureTimeoutError``) if it
    has not finished by then. A call without ``add_done_callback`` must be finished when
    ``Transport.call`` returns it (in-process transports).
    """

    def result(self, timeout_s: float | None = None) -> bytes: ...
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


class _PooledCall:
    """A blocking gRPC call run on one of the transport's own threads.

    gRPC's ``future()`` starts a thread per channel whenever the channel goes from no
    call in flight to one, and that thread exits when the call ends: a client that calls
    each shard once per request starts a thread per shard per request (about 0.3 ms of
    the caller's time each, measured on 2 cores). A blocking call on a thread that stays
    needs none. Such a call cannot be cancelled once running: it ends at its timeout.
    """

    def __init__(self, future: Future[bytes], done: Callable[[], None]) -> None:
        self._future = future
        future.add_done_callback(lambda _: done())

    def result(self, timeout_s: float | None = None) -> bytes:
        return self._future.result(timeout_s)

    def cancel(self) -> bool:
        return self._future.cancel()

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        self._future.add_done_callback(lambda _: fn(self))


class GrpcTransport:
    """One gRPC channel per endpoint address, opened by ``start()``: TLS with
    ``credentials`` (``protos.tls.channel_credentials``), and ``metadata`` (a bearer
    token) sent with every call.

    ``max_message_bytes`` is the largest message sent or accepted. A channel whose shard
    went away tries to reconnect at least every ``reconnect_max_s`` (gRPC's own default
    backs off to two minutes, which would keep a restarted shard unreachable long after
    it is back). Calls run as blocking calls on up to ``threads`` threads of the
    transport's own (see ``_PooledCall``); past that many in flight (e.g. calls stuck on
    a stopped shard until their timeout) they go out as gRPC futures. Thread-safe.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        max_message_bytes: int = 64 << 20,
        reconnect_max_s: float = 1.0,
        threads: int | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self._addresses = list(addresses)
        self._credentials, self._metadata = credentials, metadata
        self._max_bytes = max_message_bytes
        self._reconnect_max_ms = max(100, int(reconnect_max_s * 1000))
        self._channels: list[grpc.Channel] = []
        self._methods: dict[tuple[int, str], Any] = {}
        # Threads start as calls need them. 8 callers x 2 shards already need 16: past the
        # limit a call goes out as a gRPC future, which starts a thread of gRPC's per call.
        self._threads = threads if threads is not None else max(64, 8 * len(self._addresses))
        self._pool: ThreadPoolExecutor | None = None
        self._busy = 0
        self._busy_lock = threading.Lock()

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
        self._channels = [open_channel(a, self._credentials, options) for a in self._addresses]
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="ps-call")

    def close(self) -> None:
        for channel in self._channels:
            channel.close()  # calls still in flight end with CANCELLED
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
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
        with self._busy_lock:
            pooled = self._pool is not None and self._busy < self._threads
            if pooled:
                self._busy += 1
        if not pooled:
            future: Call = stub.future(request, timeout=timeout_s, metadata=self._metadata)
            return future
        assert self._pool is not None
        try:
            return _PooledCall(
                self._pool.submit(stub, request, timeout=timeout_s, metadata=self._metadata), self._release
            )
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        with self._busy_lock:
            self._busy -= 1
