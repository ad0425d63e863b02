"""What every gRPC server of the system does alike: health, reflection, binding, port file.

``ps-server`` (``ps.service.server``) and ``ps-infer`` (``worker.serving``) both start with
``listen``, which registers gRPC health checking and server reflection for the given
services, binds the address, starts the server and marks the services SERVING; and
both tell launchers their real port with ``write_port_file``. Not imported by
``import protos``.

Example:
    >>> from concurrent import futures
    >>> server = grpc.server(futures.ThreadPoolExecutor(1))
    >>> port, health_servicer = listen(server, "127.0.0.1:0", ["ps.v1.Example"])
    >>> port > 0
    True
    >>> _ = server.stop(0).wait()
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from protos.auth import AuthError, Tokens
from protos.logs import configure_logging
from protos.tls import TLSError, server_credentials

__all__ = [
    "Served",
    "ServerSettings",
    "Readiness",
    "Status",
    "Stop",
    "listen",
    "run_server",
    "server_security",
    "settle_heap",
    "status_boundary",
    "stop_on_signals",
    "write_port_file",
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
    ``protos.tls``), start it, and mark ``""`` and every service SERVING (NOT_SERVING
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
        self._health, self._services = health, ("", *services)
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
            self._health.set(service, status)


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


def server_security(
    cert: Path | None, key: Path | None, client_ca: Path | None, token_file: Path | None
) -> tuple[Tokens | None, grpc.ServerCredentials | None]:
    """The tokens (``--auth-token-file``) and TLS credentials (``--tls-*``) a server is
    started with, None where not given; ``RuntimeError`` naming a file that cannot be used."""
    try:
        tokens = Tokens.load(token_file) if token_file is not None else None
        credentials = server_credentials(cert, key, client_ca) if cert is not None and key is not None else None
    except (AuthError, TLSError) as exc:
        raise RuntimeError(str(exc)) from None
    return tokens, credentials


def write_port_file(path: Path, port: int) -> None:
    """Write ``port`` to ``path`` through a temporary file and a rename: a reader never
    sees half a port."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


class Stop:
    """Set by the first SIGTERM or SIGINT (``stop_on_signals``); ``signum`` says which,
    and a second signal sets ``now`` (a drain in progress ends at once)."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.now = threading.Event()
        self.signum: int | None = None

    def wait(self, timeout_s: float) -> bool:
        return self.requested.wait(timeout_s)

    @staticmethod
    def ignore_more() -> None:
        """Ignore SIGTERM and SIGINT from now on (the process is stopping)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def stop_on_signals(drains: bool = False) -> Stop:
    """A ``Stop`` set by the first SIGTERM or SIGINT. From then on both are ignored, but
    for a server that ``drains`` on SIGTERM: a second signal during the drain sets ``now``
    (the drain ends), and ``Stop.ignore_more`` ignores them once the drain is over.

    Python restores every signal's default action as the interpreter exits, so a signal
    arriving after the shutdown finished (a launcher stopping a group, then each process)
    would still kill the process and turn its exit status 0 into -SIGTERM: the handler
    ignores further signals at once, at the C level, rather than from Python code that a
    main thread blocked in the shutdown would run only at its end.
    """
    stop = Stop()

    def on_signal(signum: int, frame: object) -> None:
        if stop.requested.is_set():
            stop.ignore_more()
            stop.now.set()
            return
        stop.signum = signum
        if not (drains and signum == signal.SIGTERM):
            stop.ignore_more()
        stop.requested.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop


def settle_heap() -> None:
    """Move everything a server built while starting (modules, compiled kernels, tables'
    metadata) out of the garbage collector's reach, once it is ready to serve.

    A full collection walks every tracked object: 40 ms in a ps-server heap (118K objects)
    and 106 ms in ps-infer's (257K, torch loaded), a stall for the requests in flight.
    Frozen objects are never walked again (0.01 ms after freezing); what requests
    allocate is still collected as before.
    """
    gc.collect()
    gc.freeze()


class ServerSettings(Protocol):
    """What ``run_server`` reads of a server's settings."""

    @property
    def log_level(self) -> str: ...
    @property
    def port_file(self) -> Path | None: ...
    @property
    def grace_s(self) -> float: ...
    @property
    def drain_s(self) -> float | None: ...


class Served(Protocol):
    """A started server, as ``run_server`` sees it."""

    @property
    def port(self) -> int: ...
    @property
    def about(self) -> str:
        """What the "listening" log line says besides the port (``key=value`` words)."""
        ...

    def drain(self) -> None:
        """Report NOT_SERVING (health) while still answering every call: clients that
        check health, and load balancers, move their calls elsewhere."""
        ...

    def stop_and_report(self, grace_s: float) -> int:
        """Stop (calls in progress get ``grace_s`` seconds), log how it went; the exit status."""
        ...


_S = TypeVar("_S", bound=ServerSettings)


def run_server(prog: str, parse: Callable[[], _S], start: Callable[[_S], Served], describe: Callable[[_S], str]) -> int:
    """The life of a server process (``ps-server``, ``ps-infer``); returns its exit status.

    ``parse()`` reads the settings (a ``ValueError``: one line on stderr, exit 2); logging is
    configured and the settings logged on one line (``describe``); ``start`` builds and
    starts the server (a ``RuntimeError`` or ``ValueError``: one log line, exit 1); the real
    port goes to the port file. On SIGTERM (how schedulers stop a process) the server
    first drains for ``drain_s`` seconds (``Served.drain``: health NOT_SERVING, every call
    still answered) so that clients move away, unless a second signal cuts it short; on
    SIGINT (Ctrl-C) it does not drain. Then it stops, given ``grace_s``, and its
    ``stop_and_report`` gives the exit status. Every step logs
    one line (starting, listening, shutting down, and how it stopped) in ``protos.logs``'
    format.
    """
    try:
        settings = parse()
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if settings.port_file is not None and not settings.port_file.parent.is_dir():
        print(f"{prog}: --port-file {settings.port_file}: no directory {settings.port_file.parent}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    log = logging.getLogger(prog)  # the process's own lines: logger=ps-server, logger=ps-infer
    log.info("starting %s", describe(settings))
    try:
        served = start(settings)
    except (RuntimeError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    drain_s = settings.drain_s or 0.0
    stop = stop_on_signals(drains=drain_s > 0)
    settle_heap()
    if settings.port_file is not None:
        try:
            write_port_file(settings.port_file, served.port)
        except OSError as exc:
            log.error("--port-file %s: cannot write it (%s); stopping", settings.port_file, exc.strerror)
            served.stop_and_report(0.0)
            return 1
    log.info("listening port=%d %s", served.port, served.about)
    while not stop.wait(1.0):
        pass
    if stop.signum == signal.SIGTERM and drain_s > 0:
        served.drain()
        log.info("draining drain_s=%s: health NOT_SERVING, still answering (a second signal stops now)", drain_s)
        stop.now.wait(drain_s)
        stop.ignore_more()
    log.info("shutting down grace_s=%s", settings.grace_s)
    try:
        return served.stop_and_report(settings.grace_s)
    finally:
        if settings.port_file is not None:  # a launcher waiting for it must not find a stopped server's port
            with contextlib.suppress(OSError):
                settings.port_file.unlink()
