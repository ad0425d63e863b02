"""Start shard processes on this machine and stop them cleanly.

Each shard is a real ``python -m ps`` process listening on 127.0.0.1 port 0; the
launcher waits for the port file the shard writes once it is serving, so there is no
race on picking a free port. Stopping sends SIGINT (the shard finishes the calls in
flight and writes what it holds; SIGTERM when a serving replica leaves a cluster that
goes on: it drains first) and checks the exit code.

Example:
    with LocalCluster(num_shards=2, root=Path("/tmp/ps")) as cluster:
        client = PSClient(cluster.addresses)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = ["LocalCluster", "ShardProcess", "ShardStartError", "threads_beside_local_shards"]

from client.errors import PSError
from protos.rpc import child_command

REPO = Path(__file__).resolve().parents[1]


def threads_beside_local_shards(workers: int = 1) -> int:
    """Torch threads for each of ``workers`` workers whose shards run on this machine.

    One core is left to the shards and the client's lookup/push threads: torch's OpenMP
    threads spin, and on every core they starve the shards (DLRM, 2 cores: 77.8K
    samples/s with 2 threads against 90.0K with 1 beside idle shards, and under
    ps-launch with other load 1.2K against 11.8K). CPUs this process may not use (an
    affinity mask, a container's cpuset) do not count.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cores - 1) // max(1, workers))


class ShardStartError(PSError):
    """A shard process did not come up or did not stop cleanly; the message has its log tail."""


@dataclass
class ShardProcess:
    """A running shard: its index, ``127.0.0.1:PORT`` address, process and log file."""

    index: int
    address: str
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def start_shard(
    index: int,
    num_shards: int,
    root: Path,
    *extra_args: str,
    timeout_s: float = 60.0,
    file_size_limit_bytes: int | None = None,
    listen: str = "127.0.0.1:0",
) -> ShardProcess:
    """Start shard ``index`` of ``num_shards`` with files under ``root``; blocks until it serves.

    ``{shard}`` in an extra argument becomes the shard index, so that every shard gets its
    own directory: ``--data-dir=/var/ps/shard-{shard}``. ``file_size_limit_bytes``: the
    shard's soft ``RLIMIT_FSIZE`` (its disk "fills" there). ``listen`` is port 0 (the kernel
    picks) unless a restarted shard must keep its address. The shard gets SIGTERM when the
    thread that started it ends (``protos.rpc.child``).

    Raises ``ShardStartError`` (with the log tail) if it exits or is not ready in ``timeout_s``.
    """
    shard = spawn_shard(
        index, num_shards, root, *extra_args, file_size_limit_bytes=file_size_limit_bytes, listen=listen
    )
    return await_shard(shard, root, timeout_s)


def spawn_shard(
    index: int,
    num_shards: int,
    root: Path,
    *extra_args: str,
    file_size_limit_bytes: int | None = None,
    listen: str = "127.0.0.1:0",
) -> ShardProcess:
    """Start the process of shard ``index`` (``start_shard``'s arguments) without waiting for
    it: ``await_shard`` waits. Several shards spawned first and awaited then start together."""
    root = root.absolute()  # the shard runs in root: a relative --port-file would be read from there
    root.mkdir(parents=True, exist_ok=True)
    port_file, log = root / f"port.{index}", root / f"shard.{index}.log"
    port_file.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    with log.open("ab") as out:
        command = [
            sys.executable,
            "-m",
            "ps",
            f"--shard={index}",
            f"--num-shards={num_shards}",
            f"--listen={listen}",
            f"--port-file={port_file}",
            *(a.replace("{shard}", str(index)) for a in extra_args),
        ]
        proc = subprocess.Popen(
            child_command(command, file_size_limit_bytes=file_size_limit_bytes),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=root,
            env=env,
        )
    return ShardProcess(index, "", proc, log)


def advertised_host(listen_host: str) -> str:
    """The host others dial to reach a server listening on ``listen_host``: that host itself,
    or, for every interface (``0.0.0.0``, ``::``, empty), this machine's own address (the
    first non-loopback address its name resolves to, else the one its default route leaves
    from, else 127.0.0.1).

    >>> advertised_host("127.0.0.1"), advertised_host("10.0.0.5")
    ('127.0.0.1', '10.0.0.5')
    """
    if listen_host.strip("[]") not in ("", "0.0.0.0", "::"):
        return listen_host
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
        outside = [str(sockaddr[0]) for *_, sockaddr in found if not str(sockaddr[0]).startswith("127.")]
        if outside:
            return outside[0]
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route's source address
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def await_shard(shard: ShardProcess, root: Path, timeout_s: float = 60.0, *, host: str = "127.0.0.1") -> ShardProcess:
    """Wait until the spawned ``shard`` (files under ``root``) serves; returns it with its
    address, ``host:PORT`` (``host``: the one others dial, see ``advertised_host``).

    Raises ``ShardStartError`` (with the log tail) if it exits or is not ready in
    ``timeout_s``; the process is killed then (also on an interrupt).
    """
    port_file, proc = root / f"port.{shard.index}", shard.proc
    deadline = time.monotonic() + timeout_s
    try:
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                how = f"exit {proc.returncode}" if proc.returncode is not None else f"no port after {timeout_s:g} s"
                raise ShardStartError(f"shard {shard.index} did not start ({how}):\n{shard.log_tail()}")
            time.sleep(0.05)
    except BaseException:  # also an interrupt: leave no shard behind
        proc.kill()
        proc.wait()
        raise
    port = port_file.read_text().strip()
    shard.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # an IPv6 host is bracketed
    return shard


def stop_shard(shard: ShardProcess, timeout_s: float = 30.0, *, drain: bool = False) -> None:
    """Stop ``shard`` and wait. Raises ``ShardStartError`` unless it exits 0 in time.

    ``drain``: SIGTERM, so that a serving replica drains first (``--drain-s``: health
    NOT_SERVING while it still answers, and clients move to the others); otherwise SIGINT,
    which stops at once (the rest of the cluster is stopping too). Either way calls in
    flight finish and a training shard writes what it holds."""
    how = signal.SIGTERM if drain else signal.SIGINT
    if shard.proc.poll() is None:
        shard.proc.send_signal(how)
    try:
        code = shard.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        shard.proc.kill()
        shard.proc.wait()
        raise ShardStartError(f"shard {shard.index} ignored {how.name} for {timeout_s}s:\n{shard.log_tail()}") from None
    if code != 0:
        raise ShardStartError(f"shard {shard.index} exited {code}:\n{shard.log_tail()}")


@dataclass
class LocalCluster:
    """``num_shards`` shard processes on this machine; files under ``root`` (a temp dir if None).

    ``start()`` (or ``with``) starts them all; ``stop()`` stops them all and raises
    ``ShardStartError`` if any did not exit 0. Not thread-safe. ``follow``: the addresses
    of a training cluster, shard order; each shard is then a serving shard following
    its training shard (``--mode=serve --follow=...``). The shards listen on
    ``listen_host`` (127.0.0.1: this machine only; ``0.0.0.0``: every interface), port 0,
    and ``addresses`` name them by ``advertise_host`` (None: ``advertised_host(listen_host)``),
    the host other machines dial.
    """

    num_shards: int
    root: Path | None = None
    extra_args: tuple[str, ...] = ()
    follow: Sequence[str] | None = None
    shards: list[ShardProcess] = field(default_factory=list)
    listen_host: str = "127.0.0.1"
    advertise_host: str | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def host(self) -> str:
        """The host in ``addresses``: what other machines dial (found once, then kept)."""
        if self.advertise_host is None:
            self.advertise_host = advertised_host(self.listen_host)
        return self.advertise_host

    def _listen(self, port: int = 0) -> str:
        return f"[{self.listen_host}]:{port}" if ":" in self.listen_host else f"{self.listen_host}:{port}"

    def _args(self, index: int) -> tuple[str, ...]:
        if self.follow is None:
            return self.extra_args
        return ("--mode=serve", f"--follow={self.follow[index]}", *self.extra_args)

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.shards]

    def start(self) -> LocalCluster:
        if self.follow is not None and len(self.follow) != self.num_shards:
            raise ValueError(f"follow: {len(self.follow)} addresses for {self.num_shards} shards")
        if self.root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="ps-cluster-")
            self.root = Path(self._tmp.name)
        try:
            # All spawned first, then awaited: the shards start together.
            for i in range(self.num_shards):
                self.shards.append(spawn_shard(i, self.num_shards, self.root, *self._args(i), listen=self._listen()))
            for shard in self.shards:
                await_shard(shard, self.root, host=self.host)
        except BaseException:
            self._stop_quietly()
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp, self.root = None, None
            raise
        return self

    def restart(self, index: int, timeout_s: float = 60.0) -> ShardProcess:
        """Start shard ``index`` again, on its old address and with the same arguments (so
        the same data dir); the old process must have exited. Raises ``ShardStartError``."""
        result = self.restart_all([index], timeout_s)[index]
        if isinstance(result, ShardStartError):
            raise result
        return result

    def restart_all(self, indices: Sequence[int], timeout_s: float = 60.0) -> dict[int, ShardProcess | ShardStartError]:
        """Start the shards ``indices`` again together (``restart``'s contract for each): every
        process is spawned first, then each is awaited, so restarts overlap. Returns, per
        index, the new shard or the ``ShardStartError`` saying why it did not come back."""
        assert self.root is not None
        root = self.root
        out: dict[int, ShardProcess | ShardStartError] = {}
        spawned: list[ShardProcess] = []
        for index in indices:
            old = self.shards[index]
            if old.proc.poll() is None:
                out[index] = ShardStartError(f"shard {index} (pid {old.proc.pid}) is still running")
                continue
            port = int(old.address.rpartition(":")[2])
            spawned.append(spawn_shard(index, self.num_shards, root, *self._args(index), listen=self._listen(port)))
        for shard in spawned:
            try:
                self.shards[shard.index] = out[shard.index] = await_shard(shard, root, timeout_s, host=self.host)
            except ShardStartError as exc:
                out[shard.index] = exc
            except BaseException:
                for other in spawned:  # an interrupt: leave no shard behind
                    if other.proc.poll() is None:
                        other.proc.kill()
                        other.proc.wait()
                raise
        return out

    def add_shards(self, count: int, follow: Sequence[str] = ()) -> list[ShardProcess]:
        """Start ``count`` more shards, numbered on from the last, as spares (started with
        this cluster's first ``num_shards``, so past its end: they own nothing until
        ``ps-admin scale`` takes them in); blocks until they serve. ``follow``: for a
        serving cluster, the training shard each new one follows. Raises ``ShardStartError``
        (none of them left running)."""
        assert self.root is not None
        if self.follow is not None:
            if len(follow) != count:
                raise ValueError(f"follow: {len(follow)} addresses for {count} new serving shards")
            self.follow = [*self.follow, *follow]
        first = len(self.shards)
        spawned = [
            spawn_shard(i, self.num_shards, self.root, *self._args(i), listen=self._listen())
            for i in range(first, first + count)
        ]
        try:
            for shard in spawned:
                await_shard(shard, self.root, host=self.host)
        except BaseException:
            for shard in spawned:
                if shard.proc.poll() is None:
                    shard.proc.kill()
                    shard.proc.wait()
            if self.follow is not None:
                self.follow = self.follow[:first]
            raise
        self.shards.extend(spawned)
        return spawned

    def remove_shards(self, count: int) -> None:
        """Stop the last ``count`` shards (retired by a shrink: they own nothing); their data
        dirs stay. Raises ``ShardStartError`` if one does not exit 0."""
        keep = len(self.shards) - count
        leaving, self.shards = self.shards[keep:], self.shards[:keep]
        if self.follow is not None:
            self.follow = self.follow[:keep]
        failures = []
        for shard in leaving:
            try:
                stop_shard(shard)
            except ShardStartError as exc:
                failures.append(str(exc))
        if failures:
            raise ShardStartError("\n".join(failures))

    def stop(self) -> None:
        failures = []
        for shard in self.shards:
            try:
                stop_shard(shard)
            except ShardStartError as exc:
                failures.append(str(exc))
        self.shards.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if failures:
            raise ShardStartError("\n".join(failures))

    def _stop_quietly(self) -> None:
        for shard in self.shards:
            if shard.proc.poll() is None:
                shard.proc.kill()
                shard.proc.wait()
        self.shards.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self._stop_quietly()
            if self._tmp is not None:
                self._tmp.cleanup()
        else:
            self.stop()
