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

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from protos.rpc.tls import open_channel
from protos.services import PS_SERVICE

__all__ = ["Call", "GrpcTransport", "Transport", "SERVICE_PATH", "when_done"]

log = logging.getLogger(__name__)

SERVICE_PATH = f"/{PS_SERVICE}/"
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"


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
    Implementations are thread-safe. These are every method the client calls; a transport
    that subclasses ``Transport`` gets the defaults of the last six: one that reaches only
    the endpoints it was made with, runs each call as ``call`` does and checks no health."""

    def start(self) -> None:
        """Open the connections (idempotent); no I/O before it."""
        ...

    def close(self) -> None: ...

    def address(self, endpoint: int) -> str:
        """The address of ``endpoint``, for messages."""
        ...

    def call(self, endpoint: int, method: str, request: bytes, timeout_s: float) -> Call:
        """Send ``request`` to ``endpoint``'s ``method`` (``Lookup``...); the call in flight."""
        ...

    def call_here(self, endpoint: int, method: str, request: bytes, timeout_s: float) -> Call:
        """``call``, made on this thread and returned finished: a caller that would only wait
        for its last call anyway saves a thread hand-off with it."""
        return self.call(endpoint, method, request, timeout_s)

    @property
    def tls(self) -> bool | None:
        """Whether the connections use TLS (errors then say so when a server disagrees); None: not known."""
        return None

    @property
    def client_certificate(self) -> bool:
        """Whether the connections present a client certificate (mutual TLS)."""
        return False

    @property
    def grows(self) -> bool:
        """Whether ``add`` reaches new addresses (replicas that join while the client runs)."""
        return False

    def add(self, address: str, server_name: str | None = None) -> int:
        """The endpoint of ``address``, new or known (``grows``); ``server_name``: the name its
        TLS certificate must carry when ``address`` is a resolved IP."""
        raise NotImplementedError(f"this transport reaches no new address ({address})")

    def drop(self, endpoint: int) -> None:
        """Close ``endpoint``'s connection (a replica that left); a later call opens it again."""

    def check(self, endpoint: int, timeout_s: float) -> bool | None:
        """Ask ``endpoint``'s health service about the server as a whole: True SERVING, False
        anything else, None when it does not answer (or the transport cannot ask)."""
        return None

    def for_addresses(self, addresses: Sequence[str]) -> Transport:
        """A transport of the same kind to ``addresses`` (a new cluster map)."""
        raise NotImplementedError(f"this transport reaches no other cluster ({', '.join(addresses)})")


def when_done(call: Call, fn: Callable[[], None]) -> None:
    """Run ``fn()`` once ``call`` has finished: from gRPC's thread, or now for a finished call."""
    add = getattr(call, "add_done_callback", None)
    if add is None:
        fn()
    else:
        add(lambda _: fn())


class _PooledCall:
    """A blocking gRPC call run on one of the transport's own threads (``_CallThreads``).

    gRPC's ``future()`` starts a thread per channel whenever the channel goes from no
    call in flight to one, and that thread exits when the call ends: a client that calls
    each shard once per request starts a thread per shard per request (about 0.3 ms of
    the caller's time each, measured on 2 cores). A blocking call on a thread that stays
    needs none. Waiting is one lock (no ``concurrent.futures`` condition variables: under
    concurrency each of those Python-level steps waits for the GIL again). A call cannot
    be cancelled once running: it ends at its timeout.
    """

    __slots__ = (
        "_stub",
        "_request",
        "_kwargs",
        "_done",
        "_started",
        "_finished",
        "_cancelled",
        "_value",
        "_error",
        "_callbacks",
        "_release",
    )

    def __init__(self, stub: Any, request: bytes, kwargs: dict[str, Any], release: Callable[[], None]) -> None:
        self._stub, self._request, self._kwargs, self._release = stub, request, kwargs, release
        self._done = threading.Lock()
        self._done.acquire()  # released once the call has finished
        self._started = self._finished = self._cancelled = False
        self._value: bytes = b""
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Any], None]] = []

    def run(self) -> None:
        """On a call thread: make the call (unless cancelled first), then report."""
        with _CALLBACKS_LOCK:
            self._started = True
            cancelled = self._cancelled
        if cancelled:
            self._error = CancelledError()
        else:
            self._value, self._error = _make_call(self._stub, self._request, self._kwargs)
        self._request = b""
        self._release()
        with _CALLBACKS_LOCK:
            self._finished = True
            callbacks, self._callbacks = self._callbacks, []
        self._done.release()
        for fn in callbacks:
            _run_callback(fn, self)
        # A failure's traceback keeps this frame (the caller of the frame that raised): it
        # must not keep the call, or failed calls live until the cycle collector runs.
        del self, callbacks

    def result(self, timeout_s: float | None = None) -> bytes:
        if not self._finished:
            done = False
            try:
                done = self._done.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s))
            finally:
                if done:
                    self._done.release()  # the next waiter's turn
            if not done:
                raise TimeoutError(f"call not finished within {timeout_s} s")
        if self._error is not None:
            try:
                raise self._error
            finally:
                del self  # the raise adds this frame to the error's traceback: no cycle back
        return self._value

    def cancel(self) -> bool:
        """True if the call had not started: it will not be made (its result raises
        ``CancelledError``). False once it runs: it ends at its timeout."""
        with _CALLBACKS_LOCK:
            if self._started:
                return False
            self._cancelled = True
            return True

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        with _CALLBACKS_LOCK:
            if not self._finished:
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)


class _FinishedCall:
    """A call made on the caller's thread (``GrpcTransport.call_here``): its answer or error."""

    __slots__ = ("_value", "_error")

    def __init__(self, value: bytes, error: BaseException | None) -> None:
        self._value, self._error = value, error

    def result(self, timeout_s: float | None = None) -> bytes:
        if self._error is not None:
            try:
                raise self._error
            finally:
                del self  # as in _PooledCall.result: the error's traceback must not keep the call
        return self._value

    def cancel(self) -> bool:
        return False


def _make_call(stub: Any, request: bytes, kwargs: dict[str, Any]) -> tuple[bytes, BaseException | None]:
    try:
        return stub(request, **kwargs), None
    except BaseException as exc:  # handed to whoever waits for the result
        return b"", exc


def _run_callback(fn: Callable[[Any], None], call: _PooledCall) -> None:
    """A callback that raises is logged (as ``concurrent.futures`` does); the call thread,
    and the callbacks after it, carry on."""
    try:
        fn(call)
    except Exception:
        log.exception("a callback of a finished call raised")


# Guards every pooled call's callbacks against finishing while one is being added:
# rarely contended (the retry loop adds callbacks only when a first attempt fails or lags).
_CALLBACKS_LOCK = threading.Lock()


class _CallThreads:
    """Up to ``limit`` threads that make pooled calls, started as calls need them; calls
    wait in a ``SimpleQueue`` (C-level, no Python condition variables)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._jobs: queue.SimpleQueue[_PooledCall | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._busy = 0
        self._closed = False
        self._threads: list[threading.Thread] = []

    def submit(self, stub: Any, request: bytes, kwargs: dict[str, Any]) -> _PooledCall | None:
        """Queue a call; None when ``limit`` calls are in flight already (or after close)."""
        with self._lock:  # queued under the lock: close() then comes before or after, whole
            if self._closed or self._busy >= self.limit:
                return None
            call = _PooledCall(stub, request, kwargs, self._finished)
            if self._busy >= len(self._threads):  # every thread is busy: one more
                thread = threading.Thread(target=self._work, name=f"ps-call-{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)
            self._busy += 1
            self._jobs.put(call)
        return call

    def close(self, wait_s: float = 2.0) -> None:
        """Threads exit once the calls queued before finish (calls on closed channels end
        at once, CANCELLED); waits up to ``wait_s`` for them, so none is still inside gRPC
        when the process exits. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
            for _ in threads:
                self._jobs.put(None)  # after every call queued: each thread takes one, then stops
        until = time.monotonic() + wait_s
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, until - time.monotonic()))

    def _finished(self) -> None:
        with self._lock:
            self._busy -= 1

    def _work(self) -> None:
        while True:
            call = self._jobs.get()
            if call is None:
                return
            call.run()
            del call  # not kept alive (its answer, or its error) while waiting for the next


class GrpcTransport(Transport):
    """One gRPC channel per endpoint address, opened by ``start()``: TLS with
    ``credentials`` (``protos.rpc.tls.channel_credentials``), and ``metadata`` (a bearer
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
        client_certificate: bool = False,
    ) -> None:
        self._addresses = list(addresses)
        self._credentials, self._metadata = credentials, metadata
        self._client_certificate = client_certificate
        self._max_bytes = max_message_bytes
        self._reconnect_max_ms = max(100, int(reconnect_max_s * 1000))
        self._channels: list[grpc.Channel | None] = []  # None: closed by ``drop``
        self._server_names: dict[int, str] = {}
        self._methods: dict[tuple[int, str], Any] = {}
        self._lock = threading.Lock()
        self._started = False
        # Threads start as calls need them. 8 callers x 2 shards already need 16: past the
        # limit a call goes out as a gRPC future, which starts a thread of gRPC's per call.
        self._threads_given = threads
        self._threads = threads if threads is not None else max(64, 8 * len(self._addresses))
        self._calls: _CallThreads | None = None

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._channels = [self._open(e) for e in range(len(self._addresses))]
            self._calls = _CallThreads(self._threads)
            self._started = True

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                if channel is not None:
                    channel.close()  # calls still in flight end with CANCELLED
            if self._calls is not None:
                self._calls.close()
                self._calls = None
            self._channels = []
            self._methods.clear()
            self._started = False

    def address(self, endpoint: int) -> str:
        return self._addresses[endpoint]

    def add(self, address: str, server_name: str | None = None) -> int:
        """The endpoint of ``address``: a new one numbered on from the last (its channel
        open if the transport is), or the one it had, its channel reopened if ``drop`` closed
        it. ``server_name``: the name its TLS certificate must carry when ``address`` is a
        resolved IP (``client.membership``)."""
        with self._lock:
            if address in self._addresses:
                endpoint = self._addresses.index(address)
            else:
                endpoint = len(self._addresses)
                self._addresses.append(address)
                if self._started:
                    self._channels.append(None)
            if server_name is not None:
                self._server_names[endpoint] = server_name
            if self._started and self._channels[endpoint] is None:
                self._channels[endpoint] = self._open(endpoint)
            return endpoint

    def drop(self, endpoint: int) -> None:
        """Close ``endpoint``'s channel (a replica that left, no call in flight to it); a
        later call to it opens it again."""
        with self._lock:
            channel = self._channels[endpoint] if endpoint < len(self._channels) else None
            if channel is None:
                return
            self._channels[endpoint] = None
            for key in [k for k in self._methods if k[0] == endpoint]:
                del self._methods[key]
        channel.close()

    def check(self, endpoint: int, timeout_s: float) -> bool | None:
        """Ask ``endpoint``'s gRPC health service about the server as a whole: True for
        SERVING, False for anything else it answers, None when it does not answer."""
        if not self._started:
            raise RuntimeError("GrpcTransport.check before start()")
        stub = self._stub(endpoint, _HEALTH_CHECK)
        request = health_pb2.HealthCheckRequest(service="").SerializeToString()
        try:
            answer = stub(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError:
            return None
        try:
            status = health_pb2.HealthCheckResponse.FromString(answer).status
        except DecodeError:
            return None
        return bool(status == health_pb2.HealthCheckResponse.SERVING)

    def _open(self, endpoint: int) -> grpc.Channel:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self._max_bytes),
            ("grpc.max_send_message_length", self._max_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", self._reconnect_max_ms),
        ]
        name = self._server_names.get(endpoint)
        if name is not None and self._credentials is not None:
            options.append(("grpc.ssl_target_name_override", name))
        return open_channel(self._addresses[endpoint], self._credentials, options)

    @property
    def tls(self) -> bool:
        """Whether the channels use TLS (errors say so when a server disagrees)."""
        return self._credentials is not None

    @property
    def client_certificate(self) -> bool:
        return self._client_certificate

    @property
    def grows(self) -> bool:
        return True

    def for_addresses(self, addresses: Sequence[str]) -> GrpcTransport:
        return GrpcTransport(
            addresses,
            self._max_bytes,
            self._reconnect_max_ms / 1000,
            self._threads_given,
            credentials=self._credentials,
            metadata=self._metadata,
            client_certificate=self._client_certificate,
        )

    def call(self, endpoint: int, method: str, request: bytes, timeout_s: float) -> Call:
        stub = self._stub(endpoint, method)
        kwargs = {"timeout": timeout_s, "metadata": self._metadata}
        pooled = None if self._calls is None else self._calls.submit(stub, request, kwargs)
        if pooled is not None:
            return pooled
        future: Call = stub.future(request, timeout=timeout_s, metadata=self._metadata)
        return future

    def call_here(self, endpoint: int, method: str, request: bytes, timeout_s: float) -> Call:
        """``call`` made on this thread: blocks until it finished, then returns it."""
        stub = self._stub(endpoint, method)
        return _FinishedCall(*_make_call(stub, request, {"timeout": timeout_s, "metadata": self._metadata}))

    def _stub(self, endpoint: int, method: str) -> Any:
        stub = self._methods.get((endpoint, method))
        if stub is None:
            with self._lock:
                if not self._started:
                    raise RuntimeError("GrpcTransport.call before start()")
                channel = self._channels[endpoint]
                if channel is None:  # dropped, and called after all (a call pinned to it)
                    channel = self._channels[endpoint] = self._open(endpoint)
                # Identity (de)serializers: the client encodes and decodes messages itself.
                path = method if method.startswith("/") else SERVICE_PATH + method
                stub = channel.unary_unary(path, None, None)
                self._methods[(endpoint, method)] = stub
        return stub
