"""What every gRPC server of the system does alike: health, reflection, binding, port file.

``ps-server`` (``ps.server``) and ``ps-infer`` (``worker.serving``) both start with
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

import os
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.auth import AuthError, Tokens
from protos.tls import TLSError, server_credentials

__all__ = ["listen", "server_security", "write_port_file"]


def listen(
    server: grpc.Server, address: str, services: Sequence[str], credentials: grpc.ServerCredentials | None = None
) -> tuple[int, health.HealthServicer]:
    """Register health and reflection for ``services`` on ``server`` (its own services
    already added), bind ``address`` (with TLS when ``credentials`` are given, see
    ``protos.tls``), start it, and mark ``""`` and every service SERVING.

    Returns the real port and the health servicer. Raises ``RuntimeError`` naming the
    address when it cannot be bound (the server is not started then).
    """
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {address}: {exc}") from None
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}: address in use or not available")
    server.start()
    for service in ("", *services):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return port, health_servicer


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
