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
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ps.checkpoint import copy_checkpoint
from ps.config import Durability, ServerConfig
from ps.rescue import StopReport, apply_rescue, is_rescue_dump
from ps.servicer import SERVICE_NAME, Servicer
from ps.shard import Shard
from ps.storage import DataDirError, Storage, StorageFailed

__all__ = ["BACKGROUND_HEALTH_SERVICE", "WRITE_HEALTH_SERVICE", "PSServer", "build_server", "open_shard"]

WRITE_HEALTH_SERVICE = SERVICE_NAME + ".Writes"
"""Health service name that is NOT_SERVING while the shard refuses writes (storage failed)."""

BACKGROUND_HEALTH_SERVICE = SERVICE_NAME + ".Background"
"""Health service name that is NOT_SERVING while a background loop of the shard (evictor,
interval flush, TTL sweep, storage recovery) is failing; ``Stats.failing_loops`` says which."""

log = logging.getLogger(__name__)


class PSServer:
    """A started shard server: ``port`` is the real bound port. Stop with ``stop()``."""

    def __init__(self, server: grpc.Server, port: int, shard: Shard, health: health.HealthServicer) -> None:
        self.server = server
        self.port = port
        self.shard = shard
        self._health = health

    def stop(self, grace_s: float | None = None) -> StopReport:
        """Refuse new calls, let in-flight ones finish for up to ``grace_s``, then write what
        is dirty and close the data directory (blocks). If the data directory refuses
        that write, retry for up to ``grace_s`` more, then save what it did not take to
        a rescue dump (see ``Shard.shutdown``); the report says how it went."""
        self._health.enter_graceful_shutdown()
        self.shard.close()
        self.server.stop(grace_s).wait()
        return self.shard.shutdown(grace_s or 0.0)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stops; False on timeout."""
        return bool(self.server.wait_for_termination(timeout_s))


def open_shard(config: ServerConfig) -> Shard:
    """The shard ``config`` describes, with its data directory opened: first restored from
    the checkpoint ``config.restore_from`` (into an empty data dir), or with the rescue
    dump ``config.restore_from`` applied to it. Raises ``RuntimeError`` with an
    actionable message."""
    if config.data_dir is None:
        return Shard(config.shard, config.num_shards, checkpoint_root=config.checkpoint_root)
    rescue = config.restore_from is not None and is_rescue_dump(config.restore_from)
    try:
        if config.restore_from is not None and not rescue:
            copy_checkpoint(config.restore_from, config.data_dir)
        storage = Storage(config.data_dir, shard=config.shard, num_shards=config.num_shards)
    except DataDirError as exc:
        raise RuntimeError(str(exc)) from None
    except OSError as exc:
        raise RuntimeError(f"data dir {config.data_dir}: {exc}") from None
    if rescue:
        assert config.restore_from is not None
        try:
            apply_rescue(config.restore_from, storage)
        except (DataDirError, StorageFailed) as exc:
            storage.close()
            raise RuntimeError(f"--restore-from {config.restore_from}: {exc}") from None
    return Shard(
        config.shard,
        config.num_shards,
        storage,
        Durability.parse(config.durability),
        config.memory_budget_bytes,
        config.checkpoint_root,
    )


def build_server(config: ServerConfig, shard: Shard | None = None) -> PSServer:
    """Bind ``config.listen``, register the services and start serving.

    Raises ``RuntimeError`` naming the address when it cannot be bound, or the data
    directory when it cannot be used.
    """
    shard = shard or open_shard(config)
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
        shard.shutdown()
        raise RuntimeError(f"cannot listen on {config.listen}: {exc}") from None
    if port == 0:
        shard.shutdown()
        raise RuntimeError(f"cannot listen on {config.listen}: address in use or not available")
    server.start()
    for service in ("", SERVICE_NAME, WRITE_HEALTH_SERVICE, BACKGROUND_HEALTH_SERVICE):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)

    def listener(service: str) -> Callable[[bool], None]:
        def set_status(ok: bool) -> None:
            status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            health_servicer.set(service, status)

        return set_status

    shard.on_writable_change(listener(WRITE_HEALTH_SERVICE))
    shard.health.on_change(listener(BACKGROUND_HEALTH_SERVICE))
    shard.start()
    return PSServer(server, port, shard, health_servicer)
