"""Serving replicas on this machine that join and leave while they serve.

``ServingReplicas`` runs any number of serving shards (``ps-server --mode serve
--follow``) per shard index of a training cluster, and keeps their addresses, in the
``--ps`` syntax (``h:1+h:2,h:3``), in one file that clients follow as it changes:
``ps-infer --ps-file FILE``, ``PSClient(addresses_file=FILE)``. A replica that joins
is listed once it listens; clients send it calls once its health turns SERVING (it has
its training shard's rows). One that leaves is taken out of the file first, then stopped
with SIGTERM: it drains (``--drain-s``, still answering) while clients move away, then
exits 0.

Example (a training cluster running at ``addresses``):
    with ServingReplicas(addresses, root=Path("/tmp/serving")) as replicas:
        replicas.add(0)                        # a second replica of shard 0
        client = PSClient(addresses_file=replicas.addresses_file)
        replicas.remove(replicas.replicas[0][0].address)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from deploy.local import ShardProcess, ShardStartError, await_shard, spawn_shard, stop_shard

__all__ = ["ServingReplicas"]

log = logging.getLogger(__name__)


class ServingReplicas:
    """Serving shards following the training shards at ``follow`` (shard order), under
    ``root``, with ``per_shard`` replicas each at ``start()``; their addresses in
    ``addresses_file`` (``root/serving-addresses`` unless given). ``extra_args`` go to
    every replica (``{shard}`` becomes its index). Replicas listen on ``listen_host`` and
    are listed at ``host`` (what clients dial; as ``LocalCluster``'s). ``add`` and
    ``remove`` may run on several threads at once (a replica drains for seconds); the rest
    is not thread-safe."""

    def __init__(
        self,
        follow: Sequence[str],
        root: Path,
        *,
        per_shard: int = 1,
        addresses_file: Path | None = None,
        extra_args: Sequence[str] = (),
        listen_host: str = "127.0.0.1",
        host: str = "127.0.0.1",
    ) -> None:
        if per_shard < 1:
            raise ValueError(f"per_shard={per_shard}: each shard needs at least one replica")
        self.follow = list(follow)
        self.root = root.absolute()
        self.per_shard = per_shard
        self.addresses_file = addresses_file or self.root / "serving-addresses"
        self.extra_args = tuple(extra_args)
        self.listen_host, self.host = listen_host, host
        self.replicas: list[list[ShardProcess]] = [[] for _ in self.follow]
        self.size = len(self.follow)  # the shards listed in the file (spares a grow started are not)
        self._started_as = len(self.follow)  # --num-shards of every replica
        self._count = 0  # replicas ever started: each gets a directory of its own
        self._lock = threading.Lock()  # the lists and the file
        # Linux sends a replica SIGTERM when the thread that started it ends (the shard asks
        # for that, so that none outlives its launcher): every replica is started by this
        # one thread, which lives until ``stop``, whichever thread calls ``add``.
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="ps-replicas")

    @property
    def num_shards(self) -> int:
        """Shards with replicas here, spares included."""
        return len(self.follow)

    @property
    def addresses(self) -> list[list[str]]:
        """Each shard's replica addresses, spares included (not those still starting)."""
        return [[r.address for r in shard if r.address] for shard in self.replicas]

    def add_shards(self, follow: Sequence[str]) -> list[list[ShardProcess]]:
        """Replicas (``per_shard`` each) of new shards following the training shards
        ``follow``, numbered on from the last, as spares of a live reshard: not listed until
        ``set_size`` (``deploy.scale`` switches the serving map to them). Raises
        ``ShardStartError`` (none of them left running)."""
        first = self.num_shards
        self.follow += list(follow)
        self.replicas += [[] for _ in follow]
        try:
            spawned = [self._spawn(s) for _ in range(self.per_shard) for s in range(first, self.num_shards)]
            for replica in spawned:
                self._await(replica)
        except BaseException:
            for group in self.replicas[first:]:
                for replica in group:
                    replica.proc.kill()
                    replica.proc.wait()
            del self.follow[first:], self.replicas[first:]
            raise
        return self.replicas[first:]

    def set_size(self, size: int) -> None:
        """List the first ``size`` shards in the file: the serving map has that many now."""
        if not 1 <= size <= self.num_shards:
            raise ValueError(f"size={size}: must be in [1, {self.num_shards}]")
        self.size = size
        self._write()

    def remove_shards(self, count: int) -> None:
        """Stop the replicas of the last ``count`` shards (retired by a shrink, and no longer
        listed: ``set_size`` first). Raises ``ShardStartError`` if one does not exit 0."""
        keep = self.num_shards - count
        if keep < self.size:
            raise ValueError(f"shards {keep} and up are still listed: set_size({keep}) first")
        leaving, self.replicas, self.follow = self.replicas[keep:], self.replicas[:keep], self.follow[:keep]
        failures = []
        for replica in (r for group in leaving for r in group):
            try:
                stop_shard(replica)
            except ShardStartError as exc:
                failures.append(str(exc))
        if failures:
            raise ShardStartError("\n".join(failures))

    def start(self) -> ServingReplicas:
        """Start ``per_shard`` replicas of every shard together; blocks until they listen."""
        try:
            spawned = [self._spawn(s) for _ in range(self.per_shard) for s in range(self.num_shards)]
            for shard in spawned:
                self._await(shard)
        except BaseException:
            self.stop(quietly=True)
            raise
        self._write()
        return self

    def add(self, shard: int) -> ShardProcess:
        """One more replica of ``shard``, listed in the file once it listens (clients send
        it calls once it is ready). Raises ``ShardStartError`` (nothing left running)."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard={shard}: this cluster has shards 0 to {self.num_shards - 1}")
        replica = self._await(self._spawn(shard))
        self._write()
        return replica

    def resize(self, per_shard: int, say: Callable[[str], None] = lambda line: None) -> None:
        """Give every shard ``per_shard`` replicas: start the missing ones together (listed
        once they listen), then remove the extra ones, newest first, each draining before it
        stops (together). Raises ``ShardStartError`` (what started stays)."""
        if per_shard < 1:
            raise ValueError(f"per_shard={per_shard}: each shard needs at least one replica")
        self.per_shard = per_shard
        missing = [s for s in range(self.num_shards) for _ in range(per_shard - len(self.replicas[s]))]
        if missing:
            spawned = [self._spawn(s) for s in missing]
            for replica in spawned:
                self._await(replica)
            self._write()
            say(f"started {len(spawned)} serving replicas: {', '.join(r.address for r in spawned)}")
        extra = [r.address for group in self.replicas for r in group[per_shard:]]
        if extra:
            with ThreadPoolExecutor(len(extra)) as pool:
                list(pool.map(self.remove, extra))
            say(f"stopped {len(extra)} serving replicas after their drain: {', '.join(extra)}")

    def replace_dead(self) -> list[tuple[ShardProcess, ShardProcess | ShardStartError]]:
        """Start a replica in place of each listed one whose process exited (a new address,
        the file rewritten); returns each dead one with its replacement, or why none started."""
        with self._lock:
            dead = [r for group in self.replicas for r in group if r.address and r.proc.poll() is not None]
            for replica in dead:
                self.replicas[replica.index].remove(replica)
        out: list[tuple[ShardProcess, ShardProcess | ShardStartError]] = []
        for replica in dead:
            try:
                out.append((replica, self._await(self._spawn(replica.index))))
            except ShardStartError as exc:
                out.append((replica, exc))
        if dead:
            self._write()
        return out

    def remove(self, address: str, *, kill: bool = False) -> int | None:
        """Take the replica at ``address`` out of the file, then stop it: SIGTERM (it
        drains, then exits; raises ``ShardStartError`` unless it exits 0), or SIGKILL with
        ``kill`` (a crash, for fault tests). Returns the exit status. A shard's last replica
        cannot be removed (``ValueError``)."""
        with self._lock:
            found = next((r for group in self.replicas for r in group if r.address == address), None)
            if found is None:
                raise ValueError(f"{address} is not a serving replica here (replicas: {self._describe()})")
            group = self.replicas[found.index]
            if len(group) == 1:
                raise ValueError(f"{address} is shard {found.index}'s last replica: add another first")
            group.remove(found)
            self._write_locked()
        if kill:
            os.kill(found.proc.pid, signal.SIGKILL)
            return found.proc.wait()
        stop_shard(found, timeout_s=120.0, drain=True)
        return 0

    def stop(self, quietly: bool = False) -> None:
        """Stop every replica (at once: SIGINT, no drain); raises ``ShardStartError`` if one
        does not exit 0, unless ``quietly`` (which also kills what does not stop)."""
        failures = []
        for group in self.replicas:
            for replica in group:
                if quietly:
                    if replica.proc.poll() is None:
                        replica.proc.kill()
                        replica.proc.wait()
                    continue
                try:
                    stop_shard(replica)
                except ShardStartError as exc:
                    failures.append(str(exc))
        self.replicas = [[] for _ in self.follow]
        self._starter.shutdown(wait=True)
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="ps-replicas")  # for a start() after
        if failures:
            raise ShardStartError("\n".join(failures))

    def __enter__(self) -> ServingReplicas:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop(quietly=exc_type is not None)

    def _spawn(self, shard: int) -> ShardProcess:
        with self._lock:
            root = self.root / f"replica-{self._count}"
            self._count += 1
        args = ("--mode=serve", f"--follow={self.follow[shard]}", *self.extra_args)
        listen = f"[{self.listen_host}]:0" if ":" in self.listen_host else f"{self.listen_host}:0"
        replica = self._starter.submit(spawn_shard, shard, self._started_as, root, *args, listen=listen).result()
        with self._lock:
            self.replicas[shard].append(replica)
        return replica

    def _await(self, replica: ShardProcess) -> ShardProcess:
        try:
            await_shard(replica, replica.log.parent, host=self.host)
        except BaseException:
            with self._lock:
                self.replicas[replica.index].remove(replica)
            raise
        self._adopt_map(replica)
        return replica

    def _adopt_map(self, replica: ShardProcess) -> None:
        """After a live reshard the serving replicas route by a newer map than a new one
        starts with: hand it the map of a replica that has it (``deploy.scale``)."""
        from deploy.operations import GrpcShards  # the gRPC admin calls, only where needed
        from deploy.reshard import AdminError
        from deploy.scale import RetryLater, ScaleError, adopt_serving_map

        with self._lock:
            peers = [r.address for group in self.replicas[: self.size] for r in group if r.address and r is not replica]
        if replica.index >= self.size or not peers:
            return  # a spare of a grow: the switch to the new map gives it its map
        shards = GrpcShards(10.0)
        try:
            if adopt_serving_map(shards, replica.address, peers[0]):
                log.info("serving replica %s took the serving map of %s", replica.address, peers[0])
        except (AdminError, RetryLater, ScaleError) as exc:
            log.warning("serving replica %s did not take the current serving map: %s", replica.address, exc)
        finally:
            shards.close()

    def _write(self) -> None:
        with self._lock:
            self._write_locked()

    def _write_locked(self) -> None:
        """The addresses file, replaced whole (a reader never sees half of it)."""
        self.addresses_file.parent.mkdir(parents=True, exist_ok=True)
        temp = self.addresses_file.with_name(self.addresses_file.name + ".tmp")
        temp.write_text(",".join("+".join(shard) for shard in self.addresses[: self.size]) + "\n")
        temp.replace(self.addresses_file)

    def _describe(self) -> str:
        return ", ".join(f"shard {s}: {'+'.join(a)}" for s, a in enumerate(self.addresses)) or "none"
