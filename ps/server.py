"""Build and run the gRPC server of one shard: the service, health checking, reflection.

Example:
    >>> from ps.config import ServerConfig
    >>> server = build_server(ServerConfig())
    >>> server.port > 0
    True
    >>> server.stop(grace_s=0)
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ps.config import ServerConfig
from ps.servicer import SERVICE_NAME, Servicer
from ps.shard import Shard

__all__ = ["PSServer", "build_server"]

log = logging.getLogger(__name__)


class PSServer:
    """A started shard server: ``port`` is the real bound port. Stop with ``stop()``."""

    def __init__(self, server: grpc.Server, port: int, shard: Shard, health: health.HealthServicer) -> None:
        self.server = server
        self.port = port
        self.shard = shard
        self._health = health

    def stop(self, grace_s: float | None = None) -> None:
        """Refuse new calls, let in-flight ones finish for up to ``grace_s``, then stop (blocks)."""
        self._health.enter_graceful_shutdown()
        self.shard.close()
        self.server.stop(grace_s).wait()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stops; False on timeout."""
        return bool(self.server.wait_for_termination(timeout_s))


def build_server(config: ServerConfig, shard: Shard | None = None) -> PSServer:
    """Bind ``config.listen``, register the services and start serving.

    Raises ``RuntimeError`` naming the address when it cannot be bound.
    """
    shard = shard or Shard(config.shard, config.num_shards)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="ps-rpc"),
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            # Two shards must never share a port by accident.
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers((Servicer(shard, config.max_message_bytes).handler(),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = server.add_insecure_port(config.listen)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen on {config.listen}: {exc}") from None
    if port == 0:
        raise RuntimeError(f"cannot listen on {config.listen}: address in use or not available")
    server.start()
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return PSServer(server, port, shard, health_servicer)
