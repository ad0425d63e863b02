"""Build and run the gRPC server of one shard: the service, health checking, reflection.

Example:
    >>> from ps.service.config import ServerConfig
    >>> server = build_server(ServerConfig())
    >>> server.port > 0
    True
    >>> server.stop(grace_s=0).clean
    True
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from grpc_health.v1 import health_pb2

from protos.rpc.security import caller_security
from protos.rpc.server import Readiness, RunningServer, start_server
from protos.services import BACKGROUND_HEALTH, FOLLOW_HEALTH, PS_SERVICE, WRITES_HEALTH
from ps.durability import (
    Durability,
    StopReport,
    apply_rescue,
    begin_epoch,
    checkpoint_root_of,
    copy_checkpoint,
    dump_places,
    is_rescue_dump,
    settle_dumps,
)
from ps.elastic import ReshardSettings, grpc_identify, grpc_move_stream
from ps.replication import ChangeLog, PeerMaps, Source
from ps.service.config import ServerConfig
from ps.service.servicer import Servicer
from ps.shard import Limits, Mode, Shard
from ps.store import DataDirError, Storage, StorageFailed
from ps.table import Eviction

__all__ = [
    "PSServer",
    "build_server",
    "open_shard",
]

FOLLOW_MAX_LAG_S = 5.0
"""A follower further behind its training shard than this reports ``FOLLOW_HEALTH`` NOT_SERVING,
and a starting one is not ready (health NOT_SERVING) until it is within it."""

READY_WITHOUT_LEADER_S = 30.0
"""A follower that restarted with rows in its data dir but cannot reach its training shard
serves them after this long (a serving shard outlives training)."""

SPARE_THREADS = 8
"""Handler threads beyond ``--threads``: refusals and health checks never wait for a busy one."""

ROLES = {
    f"/{PS_SERVICE}/{m}": role
    for m, role in [
        ("Lookup", "read"),
        ("ListTables", "read"),
        ("Stats", "read"),
        ("Follow", "read"),
        ("Push", "write"),
        ("CreateTable", "write"),
        ("Checkpoint", "admin"),
        ("LoadCheckpoint", "admin"),
        ("ServeFrom", "admin"),
        ("Publish", "write"),
        ("RollBack", "admin"),
        ("Erase", "admin"),
        ("GetMap", "read"),
        ("MoveRows", "write"),
        ("Reshard", "admin"),
    ]
}
"""The token role each method needs (see ``protos.rpc.auth``). A Lookup with a read token
creates no rows (``Servicer.read_only_handlers``)."""

log = logging.getLogger(__name__)


class PSServer:
    """A started shard server: ``port`` is the real bound port, ``metrics_port`` where its
    metrics are served (None without ``--metrics-port``). Stop with ``stop()``."""

    def __init__(self, running: RunningServer, shard: Shard, peers: PeerMaps | None, stopped: threading.Event) -> None:
        self._running, self.shard, self.peers, self._stopped = running, shard, peers, stopped
        self.server, self.port, self.metrics_port = running.server, running.port, running.metrics_port
        self.readiness = running.readiness

    def drain(self) -> None:
        """Health NOT_SERVING from now on; every call is still answered (see ``run_server``)."""
        self._running.drain()

    def stop(self, grace_s: float | None = None) -> StopReport:
        """Refuse new calls, let in-flight ones finish for up to ``grace_s``, then write what
        is dirty and close the data directory (blocks). If the data directory refuses
        that write, retry for up to ``grace_s`` more, then save what it did not take to
        a rescue dump (see ``Shard.shutdown``); the report says how it went."""
        self._stopped.set()
        if self.peers is not None:
            self.peers.stop()
        self.shard.close()
        self._running.stop(grace_s)
        if isinstance(self.shard.source, Source):
            self.shard.source.stop()
        return self.shard.shutdown(grace_s or 0.0)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stops; False on timeout."""
        return bool(self.server.wait_for_termination(timeout_s))

    @property
    def about(self) -> str:
        return f"shard={self.shard.index} num_shards={self.shard.num_shards}"

    def stop_and_report(self, grace_s: float) -> int:
        """``stop``, logged; the exit status: 0 clean, 3 acknowledged rows only in a rescue
        dump (the next start applies it), 4 rows lost (no place took the dump)."""
        report = self.stop(grace_s)
        if report.rescue_path is not None:
            log.error("stopped: %d rows saved to rescue dump %s (exit 3)", report.unpersisted_rows, report.rescue_path)
            return 3
        if report.lost:
            log.error(
                "stopped: %d rows not in the data dir are lost (exit 4): set --rescue-dir to a directory on another "
                "volume",
                report.unpersisted_rows,
            )
            return 4
        log.info("stopped")
        return 0


def open_shard(config: ServerConfig) -> Shard:
    """The shard ``config`` describes, with its data directory opened: first restored from
    the checkpoint ``config.restore_from`` (into an empty data dir), or with the rescue
    dump ``config.restore_from`` applied to it. Then the rescue dumps of the data dir not
    applied yet are applied, or refused (``ps.durability.rescue.settle_dumps``), and the data dir
    gets this start's epoch before anything else is written. Raises ``RuntimeError``
    with an actionable message."""
    return _open_shard(config)


def _peer_credentials(config: ServerConfig) -> dict[str, Any]:
    """TLS credentials and token metadata a shard sends another: a follower its training
    shard, a new owner in a reshard the old owners it pulls rows from."""
    try:
        peer = caller_security(
            tls_ca=config.client_tls_ca,
            tls_cert=config.client_tls_cert,
            tls_key=config.client_tls_key,
            token_file=config.client_token_file,
        )
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    return {"credentials": peer.credentials, "metadata": peer.metadata}


def _open_shard(config: ServerConfig) -> Shard:
    mode: Mode = "serve" if config.mode == "serve" else "train"
    source: Callable[[Shard], Source] | None = None
    peer = _peer_credentials(config)
    if mode == "serve":  # its rows come from its data dir, a checkpoint, or the training shard it follows

        def source(shard: Shard) -> Source:
            return Source(
                shard,
                config.follow,
                max_message_bytes=config.max_message_bytes,
                serve_dtype=config.serve_dtype,
                published_only=config.published_only,
                **peer,
            )

    if config.shard >= config.num_shards:
        log.warning(
            "shard %d is past the end of a cluster of %d shards: it starts as a spare that owns no keys until "
            "`ps-admin scale` takes it in (clients listing it get refusals until then)",
            config.shard,
            config.num_shards,
        )
    resharding = ReshardSettings(
        grpc_move_stream(peer["credentials"], peer["metadata"], config.max_message_bytes),
        config.reshard_settle_s,
        grpc_identify(peer["credentials"], peer["metadata"]),
    )

    def shard(storage: Storage | None, durability: Durability, memory_budget_bytes: int) -> Shard:
        return Shard(
            config.shard,
            config.num_shards,
            storage,
            durability,
            memory_budget_bytes,
            config.checkpoint_root,
            mode=mode,
            eviction=cast(Eviction, config.eviction),
            limits=Limits(config.max_tables, config.max_keys_per_request),
            rescue_dir=config.rescue_dir,
            changes=ChangeLog(config.follow_history_keys),
            source=source,
            resharding=resharding,
            health_window_s=config.health_window_s,
        )

    if config.data_dir is None:
        return shard(None, Durability.parse(config.durability), 0)
    if config.mode == "serve" and config.follow is None:  # serve the rows there as they are
        try:
            storage = Storage(config.data_dir, shard=config.shard, num_shards=config.num_shards, read_only=True)
        except DataDirError as exc:
            raise RuntimeError(f"--data-dir {config.data_dir} (served read-only): {exc}") from None
        served = shard(storage, Durability("checkpoint-only"), config.memory_budget_bytes)
        if not served.tables():
            log.warning("%s holds no tables: every lookup will get NOT_FOUND", config.data_dir)
        return served
    data_dir = config.data_dir.absolute()
    rescue = config.restore_from is not None and is_rescue_dump(config.restore_from)
    restored = config.restore_from if config.restore_from is not None and not rescue else None
    try:
        if restored is not None:
            copy_checkpoint(restored, data_dir)
        storage = Storage(
            data_dir, shard=config.shard, num_shards=config.num_shards, compression=config.disk_compression
        )
    except DataDirError as exc:
        raise RuntimeError(str(exc)) from None
    except OSError as exc:
        raise RuntimeError(f"data dir {config.data_dir}: {exc}") from None
    checkpoint_root = checkpoint_root_of(data_dir, config.checkpoint_root)
    try:
        _check_rescue_dir(config, data_dir, checkpoint_root)
        if config.restore_from is not None and rescue:
            try:
                apply_rescue(config.restore_from, storage)
            except (DataDirError, StorageFailed) as exc:
                raise RuntimeError(f"--restore-from {config.restore_from}: {exc}") from None
        try:
            settle_dumps(
                storage,
                dump_places(data_dir, config.rescue_dir, checkpoint_root),
                discard=config.discard_rescue,
                restored_checkpoint=restored,
            )
        except (DataDirError, StorageFailed) as exc:
            if restored is not None:  # as it was: the next try may restore it again
                storage.close()
                shutil.rmtree(data_dir / "db", ignore_errors=True)
            raise RuntimeError(str(exc)) from None
        try:
            begin_epoch(storage)
        except StorageFailed as exc:
            raise RuntimeError(
                f"data dir {config.data_dir}: cannot note this start in it ({exc}); free space and start again"
            ) from None
    except BaseException:
        storage.close()
        raise
    built = shard(storage, Durability.parse(config.durability), config.memory_budget_bytes)
    if built.role.takes_writes:
        try:  # before it listens: no request sees a row an interrupted erase left behind
            built.erasing.resume()
        except StorageFailed as exc:
            built.shutdown()
            raise RuntimeError(
                f"data dir {config.data_dir}: an erase a stop cut short cannot be completed ({exc}); fix the disk "
                "(or free space) and start again: the shard does not serve the rows it was asked to erase"
            ) from None
    return built


def _check_rescue_dir(config: ServerConfig, data_dir: Path, checkpoint_root: Path) -> None:
    """Make ``--rescue-dir``; warn when a full data volume would refuse every rescue place."""
    if config.rescue_dir is not None:
        try:
            config.rescue_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RuntimeError(f"--rescue-dir {config.rescue_dir}: cannot create it: {exc.strerror}") from None
    if Durability.parse(config.durability).kind == "every-push" or config.mode != "train":
        return
    device = data_dir.stat().st_dev
    places = [d for d, _ in dump_places(data_dir, config.rescue_dir, checkpoint_root)]
    if all(_device_of(p) == device for p in places):
        log.warning(
            "every place a rescue dump can go (%s) is on the data dir's filesystem: if it fills up, a stop loses "
            "the acknowledged updates not written yet (durability=%s). Set --rescue-dir to a directory on another "
            "volume",
            ", ".join(map(str, places)),
            config.durability,
        )


def _device_of(path: Path) -> int:
    """The filesystem ``path`` is on, or would be once made (that of its nearest existing parent)."""
    for p in (path, *path.parents):
        try:
            return p.stat().st_dev
        except OSError:
            continue
    return -1


def build_server(config: ServerConfig, shard: Shard | None = None) -> PSServer:
    """Bind ``config.listen``, register the services and start serving.

    Raises ``RuntimeError`` naming the address when it cannot be bound, or the data
    directory when it cannot be used.
    """
    shard = shard or open_shard(config)
    servicer = Servicer(shard, config.max_message_bytes)
    metrics = None
    if config.metrics_port is not None:
        from ps.service.metrics import shard_registry

        metrics = ("ps", shard_registry(shard))
    source = shard.source if isinstance(shard.source, Source) and shard.source.leader is not None else None
    try:
        running = start_server(
            config,
            [PS_SERVICE],
            [servicer.handler()],
            who=f"shard {config.shard}",
            roles=ROLES,
            threads=config.threads + config.max_follow_streams + SPARE_THREADS,
            thread_name="ps-rpc",
            max_message_bytes=config.max_message_bytes,
            metrics=metrics,
            ready=source is None,
            read_only=servicer.read_only_handlers(),
            max_in_flight=config.threads,
            max_per_peer=config.max_calls_per_client or max(1, config.threads * 3 // 4),
            max_streams=config.max_follow_streams,
            limits_flag="--threads",
        )
    except RuntimeError:
        shard.shutdown()
        raise
    health_servicer = running.health
    # Not services: reflection skips them. A serving shard takes no writes, so it has no
    # write health at all (NOT_FOUND) rather than a SERVING one that says otherwise.
    writes = shard.role.takes_writes
    for service in (WRITES_HEALTH, BACKGROUND_HEALTH) if writes else (BACKGROUND_HEALTH,):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)

    def listener(service: str) -> Callable[[bool], None]:
        def set_status(ok: bool) -> None:
            status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            health_servicer.set(service, status)

        return set_status

    if writes:
        shard.on_writable_change(listener(WRITES_HEALTH))
    shard.health.on_change(listener(BACKGROUND_HEALTH))
    shard.start()
    stopped = threading.Event()
    peers = None
    if source is not None:
        source.start()
        follow_health = listener(FOLLOW_HEALTH)
        follow_health(False)
        threading.Thread(
            target=_watch_follower,
            args=(source, follow_health, running.readiness, stopped),
            name="ps-follow-health",
            daemon=True,
        ).start()
        if config.serving_peers:
            peers = PeerMaps(shard, config.serving_peers, **_peer_credentials(config)).start()
    return PSServer(running, shard, peers, stopped)


def _watch_follower(
    source: Source, set_status: Callable[[bool], None], readiness: Readiness, stopped: threading.Event
) -> None:
    """Keep the follow health status in step with the follower's connection and lag, and
    mark the shard ready the first time it is caught up (or serves a pinned checkpoint,
    or has saved rows and no leader to reach for ``READY_WITHOUT_LEADER_S``)."""
    healthy: bool | None = None
    started = time.monotonic()
    while not stopped.wait(0.25):
        now = source.connected and source.lag_s() < FOLLOW_MAX_LAG_S
        if now != healthy:
            set_status(now)
            healthy = now
        if not readiness.ready:
            caught_up = source.caught_up(FOLLOW_MAX_LAG_S) or source.pinned is not None
            stranded = bool(source.history) and not source.connected
            if caught_up or (stranded and time.monotonic() - started > READY_WITHOUT_LEADER_S):
                if not caught_up:
                    log.warning(
                        "the training shard is out of reach: serving the rows saved at version %d",
                        source.applied_version,
                    )
                log.info("ready: serving (version %d)", source.applied_version)
                readiness.mark_ready()
