"""What stands in front of every call to ``ps-server`` and ``ps-infer``: the token check,
admission control and RPC metrics, as one gRPC server interceptor.

In order, for each call to a guarded service (health checks and reflection pass freely):

1. **Token** (when the server has a token file, see ``protos.rpc.auth``): none or an unknown
   one gets UNAUTHENTICATED; a role below what the method needs gets PERMISSION_DENIED.
   A method may have a read-only twin that a caller without a ``write`` token runs
   instead (``Lookup`` that creates no rows).
2. **Admission**: at most ``max_in_flight`` calls run at once; one more gets
   RESOURCE_EXHAUSTED marked ``ps-overloaded`` at once (the server keeps spare handler
   threads, so a refusal never waits behind the calls that run). One peer (connection)
   may hold at most ``max_per_peer`` of them, so a client that sends too much is the one
   refused (and its retries back off), not the others. Response streams have their own
   ``max_streams``.
3. **Deadline**: a call cancelled or past its deadline before its handler starts is
   answered CANCELLED or DEADLINE_EXCEEDED without doing the work.
4. **Metrics** (``RpcMetrics``): latency histogram per method, calls by method and code,
   calls in flight, refusals by method and reason.

Refusals name the limit and the flag that sets it, never a token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import grpc

from protos.rpc.auth import Tokens, allows, bearer_token

__all__ = ["OPEN_SERVICES", "Guard", "RpcMetrics", "serve_metrics"]

OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
log = logging.getLogger(__name__)
CODES = tuple(grpc.StatusCode)
"""Every status code a call can end with (``RpcMetrics`` counts each from 0)."""
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RpcMetrics:
    """Prometheus metrics of a server's calls, named ``{prefix}_...``, in ``registry``.

    ``{prefix}_rpc_seconds{method,code}`` (histogram of calls handled), ``{prefix}_rpcs_total
    {method,code}`` (every call, refusals included), ``{prefix}_rpcs_in_flight``,
    ``{prefix}_rpcs_rejected_total{method,reason}``.
    """

    def __init__(self, prefix: str, registry: Any) -> None:
        from prometheus_client import Counter as PCounter
        from prometheus_client import Gauge, Histogram

        self.registry = registry
        self.duration = Histogram(
            f"{prefix}_rpc_seconds",
            "Time to answer a call, by method and status code",
            ["method", "code"],
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self.calls = PCounter(
            f"{prefix}_rpcs", "Calls answered, by method and status code", ["method", "code"], registry=registry
        )
        self.in_flight = Gauge(f"{prefix}_rpcs_in_flight", "Calls being handled now", registry=registry)
        self.rejected = PCounter(
            f"{prefix}_rpcs_rejected",
            "Calls refused before any work, by method and reason",
            ["method", "reason"],
            registry=registry,
        )

    def start_at_zero(self, methods: Iterable[str], reasons: Iterable[str]) -> None:
        """Create the call and refusal counters of ``methods`` at 0 for every status code in
        ``CODES`` and every refusal ``reasons``: a series that first appears with its first
        increment has no earlier sample, so ``rate()`` misses that whole first burst."""
        reasons = tuple(reasons)
        for method in methods:
            for code in CODES:
                self.calls.labels(method, code.name)
            for reason in reasons:
                self.rejected.labels(method, reason)

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.duration.labels(method, code.name).observe(seconds)
        self.calls.labels(method, code.name).inc()

    def reject(self, method: str, reason: str, code: grpc.StatusCode) -> None:
        self.rejected.labels(method, reason).inc()
        self.calls.labels(method, code.name).inc()


def serve_metrics(listen: str, port: int, registry: Any) -> tuple[Any, int]:
    """Serve ``registry`` as Prometheus text at ``http://HOST:port/metrics`` from a daemon
    thread, HOST being that of the gRPC ``listen`` address; returns (the HTTP server, its
    real port; port 0 picks a free one) and logs the URL."""
    from prometheus_client import start_http_server

    host = listen.rpartition(":")[0].strip("[]")
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise RuntimeError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return server, int(server.server_port)


OVERLOADED = ("ps-overloaded", "1")
"""Trailing metadata of a refusal for load: clients retry it with backoff."""


def _refuse(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:  # type: ignore[type-arg]
    """``handler`` with its behavior replaced by one that answers ``code`` (marked
    overloaded when it is RESOURCE_EXHAUSTED)."""

    def behavior(request: Any, context: grpc.ServicerContext) -> Any:
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            context.set_trailing_metadata((OVERLOADED,))
        context.abort(code, message)

    kind = "unary_stream" if handler.response_streaming else "unary_unary"
    if handler.request_streaming:
        kind = "stream_stream" if handler.response_streaming else "stream_unary"
    return handler._replace(**{kind: behavior})  # type: ignore[attr-defined,no-any-return]


def _code(context: grpc.ServicerContext) -> grpc.StatusCode | None:
    """The status code a handler set (by ``abort`` or ``set_code``), None if none."""
    code: grpc.StatusCode | None = context.code()  # type: ignore[attr-defined]
    return code


def _method_name(full: str) -> str:
    return full.rsplit("/", 1)[-1]


class Guard(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """The interceptor described in the module docstring.

    ``roles`` maps a full method name (``/ps.v1.ParameterServer/Push``) to the role it
    needs; a guarded method missing from it needs ``admin``. ``read_only`` maps a full
    method name to the handler that a caller whose token does not allow ``write`` runs
    instead of the method's own (same serializers). ``who`` names the server in
    refusals (e.g. ``shard 0``). ``limits_flag`` is the flag named when a call is refused
    for the in-flight limit. Response streams (``Follow``) are long-lived: they do not
    count against ``max_in_flight`` but against ``max_streams`` of their own.

    A slot is taken when the handler starts and given back when it ends, so a call gRPC
    never hands to its handler (cancelled while its request was still arriving) holds
    none. The server needs ``max_in_flight + max_streams`` handler threads plus spares
    that answer refusals.
    """

    def __init__(
        self,
        who: str,
        roles: Mapping[str, str],
        *,
        tokens: Tokens | None = None,
        read_only: Mapping[str, grpc.RpcMethodHandler] | None = None,  # type: ignore[type-arg]
        max_in_flight: int = 0,
        max_per_peer: int = 0,
        max_streams: int = 0,
        metrics: RpcMetrics | None = None,
        limits_flag: str = "--max-concurrent-rpcs",
    ) -> None:
        self.who, self.roles, self.tokens, self.metrics = who, dict(roles), tokens, metrics
        self.max_in_flight, self.max_per_peer, self.limits_flag = max_in_flight, max_per_peer, limits_flag
        self.max_streams = max_streams
        self.read_only = dict(read_only or {})
        self._lock = threading.Lock()
        self._in_flight = 0
        self._streams = 0
        self._per_peer: Counter[str] = Counter()
        self._wrapped: dict[str, tuple[Any, Any]] = {}  # method -> (handler, its wrapped handler)
        if metrics is not None:
            reasons = [
                reason
                for reason, on in (
                    ("no_token", tokens is not None),
                    ("bad_token", tokens is not None),
                    ("role", tokens is not None),
                    ("in_flight", max_in_flight > 0),
                    ("per_peer", max_per_peer > 0),
                    ("streams", max_streams > 0),
                )
                if on
            ]
            metrics.start_at_zero(sorted({_method_name(full) for full in self.roles}), reasons)

    @property
    def in_flight(self) -> int:
        """Unary calls being handled now."""
        return self._in_flight

    @property
    def streams(self) -> int:
        """Response streams open now."""
        return self._streams

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],  # type: ignore[type-arg]
        details: grpc.HandlerCallDetails,
    ) -> Any:
        full = details.method
        handler = continuation(details)
        if handler is None or full.startswith(OPEN_SERVICES):
            return handler
        method = _method_name(full)
        refusal, role = self._check_token(full, details.invocation_metadata)
        if refusal is not None:
            code, reason, message = refusal
            if self.metrics is not None:
                self.metrics.reject(method, reason, code)
            return _refuse(handler, code, message)
        key = full
        if role is not None and full in self.read_only and not allows(role, "write"):
            handler, key = self.read_only[full], full + " (read-only)"
        if handler.request_streaming:
            return handler  # no client-streaming methods here: not counted
        # Each call asks again; a method's handler is the same object every time, so it
        # is wrapped once (a wrap per call cost as much as the rest of this method).
        cached = self._wrapped.get(key)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[key] = (handler, self._wrap(handler, method))
        return cached[1]

    # -- the checks -------------------------------------------------------------------
    def _check_token(self, full: str, metadata: Any) -> tuple[tuple[grpc.StatusCode, str, str] | None, str | None]:
        """(the refusal of the call or None, the caller's role or None without tokens)."""
        if self.tokens is None:
            return None, None
        method = _method_name(full)
        token = bearer_token(metadata)
        if not token:
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "no_token",
                f"{method} refused: no bearer token; send 'authorization: Bearer TOKEN' metadata",
            ), None
        role = self.tokens.role_of(token)
        if role is None:
            return (grpc.StatusCode.UNAUTHENTICATED, "bad_token", f"{method} refused: unknown token"), None
        needed = self.roles.get(full, "admin")
        if not allows(role, needed):
            article = "an" if needed[0] in "aeiou" else "a"
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                "role",
                f"{method} refused: needs {article} {needed} token, this one is {role}",
            ), role
        return None, role

    # -- running a call -----------------------------------------------------------------
    def _take(self, streaming: bool, peer: str) -> str | None:
        """Take a slot for a call of ``peer``; None if taken, else the refusal's reason."""
        with self._lock:
            if streaming:
                if self.max_streams and self._streams >= self.max_streams:
                    return "streams"
                self._streams += 1
                return None
            if self.max_in_flight and self._in_flight >= self.max_in_flight:
                return "in_flight"
            if self.max_per_peer and self._per_peer[peer] >= self.max_per_peer:
                return "per_peer"
            self._in_flight += 1
            self._per_peer[peer] += 1
            return None

    def _give_back(self, streaming: bool, peer: str) -> None:
        with self._lock:
            if streaming:
                self._streams -= 1
                return
            self._in_flight -= 1
            self._per_peer[peer] -= 1
            if self._per_peer[peer] <= 0:
                del self._per_peer[peer]

    def _start(self, method: str, context: grpc.ServicerContext, streaming: bool) -> str:
        """Checks at the start of the handler; returns the peer whose slot it took. Aborts
        (holding no slot) when the call is over or there is no slot for it."""
        if not context.is_active():
            remaining = context.time_remaining()
            code = grpc.StatusCode.CANCELLED
            if remaining is not None and remaining <= 0:
                code = grpc.StatusCode.DEADLINE_EXCEEDED
            self._record(method, code, 0.0)
            context.abort(code, f"{method}: the call ended before its handler started")
        peer = context.peer()
        reason = self._take(streaming, peer)
        if reason is not None:
            limit = {
                "in_flight": (
                    self.max_in_flight,
                    f"{self.who} is handling {self.max_in_flight} calls ({self.limits_flag}={self.max_in_flight})",
                ),
                "per_peer": (
                    self.max_per_peer,
                    f"this client already has {self.max_per_peer} calls in "
                    f"flight on {self.who} (its share of {self.limits_flag})",
                ),
                "streams": (self.max_streams, f"{self.who} has {self.max_streams} streams open"),
            }[reason]
            if self.metrics is not None:
                self.metrics.reject(method, reason, grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_trailing_metadata((OVERLOADED,))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method} refused: {limit[1]}; retry with backoff")
        return peer

    def _record(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(method, code, seconds)

    def _wrap(self, handler: Any, method: str) -> Any:
        metrics = self.metrics

        def unary(behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
            def run(request: Any, context: grpc.ServicerContext) -> Any:
                peer = self._start(method, context, False)
                if metrics is not None:
                    metrics.in_flight.inc()
                t0 = time.perf_counter()
                code = grpc.StatusCode.UNKNOWN
                try:
                    reply = behavior(request, context)
                    code = _code(context) or grpc.StatusCode.OK
                    return reply
                except BaseException:
                    code = _code(context) or grpc.StatusCode.UNKNOWN
                    raise
                finally:
                    self._give_back(False, peer)
                    if metrics is not None:
                        metrics.in_flight.dec()
                        metrics.observe(method, code, time.perf_counter() - t0)

            return run

        def streaming(behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]]) -> Callable[..., Any]:
            def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                peer = self._start(method, context, True)
                if metrics is not None:
                    metrics.in_flight.inc()
                t0 = time.perf_counter()
                code = grpc.StatusCode.UNKNOWN
                try:
                    yield from behavior(request, context)
                    code = _code(context) or grpc.StatusCode.OK
                except GeneratorExit:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except BaseException:
                    code = _code(context) or grpc.StatusCode.UNKNOWN
                    raise
                finally:
                    self._give_back(True, peer)
                    if metrics is not None:
                        metrics.in_flight.dec()
                        metrics.observe(method, code, time.perf_counter() - t0)

            return run

        if handler.response_streaming:
            return handler._replace(unary_stream=streaming(handler.unary_stream))
        return handler._replace(unary_unary=unary(handler.unary_unary))
