"""The one start-up of every gRPC server of the system: ``ps-server`` (``ps.service.server``)
and ``ps-infer`` (``worker.serving``) both call ``start_server``.

It sets up TLS and tokens (``protos.rpc.security``), the guard every call passes (tokens,
admission, RPC metrics: ``protos.rpc.guard``), a thread pool and message limits, registers
the given handlers with gRPC health checking and server reflection (``listen``), binds
the address, starts serving, and serves Prometheus metrics beside it. A handler body ends
in ``status_boundary``, which turns what it raises into a status a person can act on.

Example:
    >>> server = start_server(Listening("127.0.0.1:0"), ["ps.v1.Example"], [], who="example", roles={})
    >>> server.port > 0, server.metrics_port
    (True, None)
    >>> server.stop(0)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from protos.rpc.guard import Guard, RpcMetrics, serve_metrics
from protos.rpc.security import server_security

__all__ = [
    "Listening",
    "Readiness",
    "RunningServer",
    "Status",
    "listen",
    "start_server",
    "status_boundary",
]


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Status:
    """The status a call ends with: its code, the message a person can act on, and
    trailing metadata for a client that acts on it by program."""

    code: grpc.StatusCode
    message: str
    trailing: tuple[tuple[str, str], ...] = ()


@contextlib.contextmanager
def status_boundary(
    context: grpc.ServicerContext, method: str, status_of: Callable[[Exception, str], Status | None], process: str
) -> Iterator[None]:
    """End the call with ``status_of(exc, method)`` for an exception the handler body raises, or,
    for one ``status_of`` does not know (None), with INTERNAL naming an incident that
    ``process``'s log holds in full: no traceback, path or value leaves the server.
    Every gRPC server of the system (``ps.service.servicer``, ``worker.serving``) uses this one."""
    try:
        yield
    except Exception as exc:
        status = status_of(exc, method)
        if status is None:
            incident = uuid.uuid4().hex[:12]
            log.error("unhandled error in %s (incident %s)", method, incident, exc_info=exc)
            status = Status(
                grpc.StatusCode.INTERNAL, f"{method}: internal error, incident {incident} in the {process} log"
            )
        if status.trailing:
            context.set_trailing_metadata(status.trailing)
        context.abort(status.code, status.message)


def listen(
    server: grpc.Server,
    address: str,
    services: Sequence[str],
    credentials: grpc.ServerCredentials | None = None,
    *,
    serving: bool = True,
) -> tuple[int, health.HealthServicer]:
    """Register health and reflection for ``services`` on ``server`` (its own services
    already added), bind ``address`` (with TLS when ``credentials`` are given, see
    ``protos.rpc.tls``), start it, and mark ``""`` and every service SERVING (NOT_SERVING
    when not ``serving`` yet: ``Readiness`` says when it is).

    Returns the real port and the health servicer. Raises ``RuntimeError`` naming the
    address when it cannot be bound (the server is not started then).
    """
    health_servicer = health.HealthServicer()
    names = (*services, health.SERVICE_NAME, reflection.SERVICE_NAME)
    for add, servicer in (
        (health_pb2_grpc.add_HealthServicer_to_server, health_servicer),
        (reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflection.ReflectionServicer(names)),
    ):
        _add_decoding_itself(server, add, servicer)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {address}: {exc}") from None
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}: address in use or not available")
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", *services):  # before the server starts: no check sees another status first
        health_servicer.set(service, status)
    server.start()
    return port, health_servicer


class Readiness:
    """The overall health (``""`` and the service's name) of a server: SERVING once it is
    ready (a follower: ``mark_ready`` when caught up; anything else at once) and until it
    drains (``drain``, on SIGTERM), NOT_SERVING otherwise. Clients add a replica once it
    is SERVING and stop sending to one that is not. Thread-safe."""

    def __init__(self, health: health.HealthServicer, services: tuple[str, ...], ready: bool) -> None:
        self.health, self._services = health, ("", *services)
        self._lock = threading.Lock()
        self.ready, self.draining = ready, False
        self._publish()

    def mark_ready(self) -> None:
        with self._lock:
            self.ready = True
            self._publish()

    def drain(self) -> None:
        with self._lock:
            self.draining = True
            self._publish()

    def _publish(self) -> None:
        serving = self.ready and not self.draining
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in self._services:
            self.health.set(service, status)


class _Handlers:
    """Stands in for a server to catch what a generated ``add_*_to_server`` registers."""

    def __init__(self) -> None:
        self.service = ""
        self.methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # the same methods come again through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, methods: dict[str, grpc.RpcMethodHandler[Any, Any]]) -> None:
        self.service, self.methods = service, methods


def _add_decoding_itself(server: grpc.Server, add: Callable[[Any, Any], None], servicer: object) -> None:
    """Add ``servicer`` as the generated ``add`` would, except that its handlers take the
    request bytes and decode them themselves: bytes that do not decode get
    INVALID_ARGUMENT naming the message type. Left to gRPC, they get INTERNAL, and gRPC
    Python keeps each such call's state for good (~20 kB a call; a reflection stream's also
    holds up a graceful stop): anyone who can reach the port could grow the server."""
    caught = _Handlers()
    add(servicer, caught)
    methods = {name: _decoding_itself(caught.service, name, h) for name, h in caught.methods.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(caught.service, methods),))


def _decoding_itself(
    service: str, name: str, handler: grpc.RpcMethodHandler[Any, Any]
) -> grpc.RpcMethodHandler[Any, Any]:
    parse = handler.request_deserializer
    assert parse is not None, f"{service}/{name} has no request deserializer"
    what = f"{service}/{name}"

    def decode(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            return parse(raw)
        except (DecodeError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: the request does not decode: {exc}")

    serialize = handler.response_serializer
    if handler.request_streaming:
        streamed = handler.stream_stream if handler.response_streaming else handler.stream_unary
        assert streamed is not None
        behavior: Callable[..., Any] = streamed

        def streaming(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            return behavior((decode(raw, context) for raw in requests), context)

        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        return make(streaming, response_serializer=serialize)
    single = handler.unary_stream if handler.response_streaming else handler.unary_unary
    assert single is not None
    behavior = single

    def unary(raw: bytes, context: grpc.ServicerContext, *callback: Any) -> Any:
        return behavior(decode(raw, context), context, *callback)

    # Health's Watch answers through a callback instead of holding a thread per stream.
    unary.experimental_non_blocking = getattr(behavior, "experimental_non_blocking", False)  # type: ignore[attr-defined]
    make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
    return make(unary, response_serializer=serialize)


class ListenSettings(Protocol):
    """Where and how a server listens: what ``start_server`` reads of its settings."""

    @property
    def listen(self) -> str: ...
    @property
    def tls_cert(self) -> Path | None: ...
    @property
    def tls_key(self) -> Path | None: ...
    @property
    def tls_client_ca(self) -> Path | None: ...
    @property
    def auth_token_file(self) -> Path | None: ...
    @property
    def metrics_port(self) -> int | None: ...


@dataclass(frozen=True)
class Listening:
    """``ListenSettings`` given directly: an address, no TLS, no tokens, no metrics."""

    listen: str
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    auth_token_file: Path | None = None
    metrics_port: int | None = None


class RunningServer:
    """A server ``start_server`` started: its ``port``, its health (``readiness``), its
    ``guard`` and where its metrics are served (``metrics_port``, None without)."""

    def __init__(
        self,
        server: grpc.Server,
        port: int,
        readiness: Readiness,
        guard: Guard,
        metrics_http: Any,
        metrics_port: int | None,
    ) -> None:
        self.server, self.port, self.readiness, self.guard = server, port, readiness, guard
        self.metrics_port = metrics_port
        self._metrics_http = metrics_http

    @property
    def health(self) -> health.HealthServicer:
        return self.readiness.health

    def drain(self) -> None:
        """Health NOT_SERVING from now on; every call is still answered (``run_server``)."""
        self.readiness.drain()

    def stop(self, grace_s: float | None) -> None:
        """NOT_SERVING, refuse new calls, let calls in progress finish for up to ``grace_s``
        (blocks), stop serving metrics."""
        self.health.enter_graceful_shutdown()
        # Bounded: a handler gRPC cannot cancel (a reflection stream fed bytes that do not
        # decode) must not keep the process from stopping.
        if not self.server.stop(grace_s).wait((grace_s or 0.0) + 5.0):
            log.warning("calls still running 5 s after the grace period; stopping anyway")
        if self._metrics_http is not None:
            self._metrics_http.shutdown()


def start_server(
    settings: ListenSettings,
    services: Sequence[str],
    handlers: Sequence[grpc.GenericRpcHandler],  # type: ignore[type-arg]
    *,
    who: str,
    roles: Mapping[str, str],
    threads: int = 8,
    thread_name: str = "rpc",
    max_message_bytes: int = 64 << 20,
    max_concurrent_rpcs: int | None = None,
    metrics: tuple[str, Any] | None = None,
    ready: bool = True,
    read_only: Mapping[str, grpc.RpcMethodHandler] | None = None,  # type: ignore[type-arg]
    max_in_flight: int = 0,
    max_per_peer: int = 0,
    max_streams: int = 0,
    limits_flag: str = "--max-concurrent-rpcs",
) -> RunningServer:
    """Start a gRPC server of ``services`` (see the module docstring) and return it.

    ``who`` names the server in refusals; ``roles``, ``read_only``, ``max_in_flight``,
    ``max_per_peer``, ``max_streams`` and ``limits_flag`` are the guard's (``Guard``).
    ``threads`` handler threads; ``max_message_bytes`` both ways; past
    ``max_concurrent_rpcs`` gRPC itself refuses calls (RESOURCE_EXHAUSTED). ``metrics``:
    ``(prefix, registry)``, served at ``settings.metrics_port`` with the RPC metrics added
    to the registry. ``ready``: SERVING at once (else once ``readiness.mark_ready``).

    Raises ``RuntimeError`` naming the address, port or file that cannot be used; nothing
    is left running then.
    """
    tokens, credentials = server_security(
        settings.tls_cert, settings.tls_key, settings.tls_client_ca, settings.auth_token_file
    )
    prefix, registry = metrics if metrics is not None else ("", None)
    guard = Guard(
        who,
        roles,
        tokens=tokens,
        read_only=read_only,
        max_in_flight=max_in_flight,
        max_per_peer=max_per_peer,
        max_streams=max_streams,
        metrics=RpcMetrics(prefix, registry) if registry is not None else None,
        limits_flag=limits_flag,
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=thread_name),
        interceptors=[guard],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Two servers must never share a port by accident.
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers(tuple(handlers))
    port, health_servicer = listen(server, settings.listen, services, credentials, serving=ready)
    readiness = Readiness(health_servicer, tuple(services), ready=ready)
    metrics_http, metrics_port = None, None
    if registry is not None and settings.metrics_port is not None:
        try:
            metrics_http, metrics_port = serve_metrics(settings.listen, settings.metrics_port, registry)
        except RuntimeError:
            server.stop(0)
            raise
    return RunningServer(server, port, readiness, guard, metrics_http, metrics_port)
