"""``ps-launch --scale LOG_DIR --to N``: grow or shrink the shards of a running launch;
``--serving-replicas R`` instead: give each of its serving shards R replicas.

The launch owns its shard processes (it restarts them when they die and stops them at
the end), so another ``ps-launch`` cannot start shards for it: it asks instead. The ask
is a file in the launch's log dir (``scale.request.json``, written atomically); the
launch looks for it between its checks on the shards, starts the new shards (and a
serving shard following each, with ``--followers``) as spares, runs ``ps-admin scale``'s
steps (``deploy.scale``) in a thread of its own, and after a shrink stops the shards it
retired. Progress lines go to ``scale.<id>.log`` beside the request, the outcome to
``scale.<id>.result.json``; the asking process prints the lines as they come and exits
with the outcome's status (0 done, 1 failed). A step that fails (a shard killed during
the move: the launch restarts it) is tried again from where it stopped, a few times.

A replicas ask starts the missing replicas (clients call them once they are ready) and
stops the extra ones, each after its drain (``deploy.replicas.ServingReplicas.resize``).

The current addresses are in the log dir too: ``addresses`` (training shards, in order)
and, with ``--followers``, ``serving-addresses`` (``+`` between a shard's replicas;
``ps-infer --ps-file`` follows it); workers keep the addresses they started with and
learn each new cluster map from the shards.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from deploy.local import LocalCluster, ShardStartError
from deploy.operations import GrpcShards, scale_cluster
from deploy.replicas import ServingReplicas
from deploy.reshard import AdminError
from deploy.scale import RetryLater

__all__ = ["ADDRESSES_FILE", "SERVING_ADDRESSES_FILE", "Scaler", "ScaleRequest", "request_scale"]

log = logging.getLogger("ps-launch")

REQUEST_FILE = "scale.request.json"
ADDRESSES_FILE = "addresses"
SERVING_ADDRESSES_FILE = "serving-addresses"
_TRIES = 5  # runs of the scale steps before the launch reports a failure
_RETRY_S = 2.0  # between them: a killed shard is restarted meanwhile


@dataclass(frozen=True)
class ScaleRequest:
    """One ask: move the launch's training shards to ``to`` shards, or (``to`` 0) give each
    shard ``replicas`` serving replicas."""

    to: int
    max_rows_per_s: float = 0.0
    id: str = ""
    replicas: int = 0


def request_scale(
    log_dir: Path, request: ScaleRequest, say: Callable[[str], None], check: Callable[[], None], timeout_s: float
) -> int:
    """Ask the launch logging to ``log_dir`` to scale (``request``); print its progress
    through ``say`` until it answers; its exit status. ``check`` raises to stop waiting
    (an interrupt); ``ValueError`` if ``log_dir`` holds no running launch."""
    if not (log_dir / ADDRESSES_FILE).exists():
        raise ValueError(
            f"{log_dir / ADDRESSES_FILE} does not exist: is {log_dir} the --log-dir of a running ps-launch?"
        )
    if (log_dir / REQUEST_FILE).exists():
        raise ValueError(f"{log_dir / REQUEST_FILE} exists: the launch has not taken the last request yet")
    request = ScaleRequest(request.to, request.max_rows_per_s, uuid.uuid4().hex[:12], request.replicas)
    _write(log_dir / REQUEST_FILE, json.dumps(asdict(request)))
    lines, result = log_dir / f"scale.{request.id}.log", log_dir / f"scale.{request.id}.result.json"
    deadline, seen = time.monotonic() + timeout_s, 0
    while True:
        check()
        done = result.exists()  # before reading the lines: every line is written before the result
        if lines.exists():
            text = lines.read_text()
            for line in text[seen:].splitlines():
                say(line)
            seen = len(text)
        if done:
            outcome = json.loads(result.read_text())
            return int(outcome["status"])
        if time.monotonic() > deadline:
            say(
                f"no answer from the launch in {timeout_s:.0f} s (is it running? its request: {log_dir / REQUEST_FILE})"
            )
            return 1
        time.sleep(0.1)


class Scaler:
    """The launch's side: ``poll()`` between its checks on the shards (same thread, which
    alone starts and stops shard processes); the moves run in a thread of their own."""

    def __init__(self, root: Path, cluster: LocalCluster, followers: ServingReplicas | None) -> None:
        self.root, self.cluster, self.followers = root, cluster, followers
        self.size = len(cluster.shards)  # the shards of the cluster map (spares started for a grow are not)
        self._job: threading.Thread | None = None
        self._request: ScaleRequest | None = None
        self._status = 0
        self._write_addresses()

    @property
    def busy(self) -> bool:
        return self._job is not None

    def poll(self) -> None:
        """Finish a scale whose moves ended (stop retired shards, answer); take a new ask."""
        if self._job is not None:
            if self._job.is_alive():
                return
            self._finish()
        path = self.root / REQUEST_FILE
        if not path.exists():
            return
        try:
            raw = json.loads(path.read_text())
            request = ScaleRequest(
                int(raw["to"]), float(raw.get("max_rows_per_s", 0.0)), str(raw["id"]), int(raw.get("replicas", 0))
            )
        except (OSError, KeyError, TypeError, ValueError) as exc:
            log.error("%s is not a scale request (%s); ignoring it", path, exc)
            path.unlink(missing_ok=True)
            return
        path.unlink(missing_ok=True)
        self._start(request)

    def close(self) -> None:
        """The launch ends: answer a scale still under way (it stops with the shards)."""
        if self._request is not None:
            self._say("the launch ended before the scale did (its workers exited or it was stopped)")
            self._answer(1)
        (self.root / REQUEST_FILE).unlink(missing_ok=True)

    def _say(self, line: str) -> None:
        assert self._request is not None
        log.info("scale: %s", line)
        with (self.root / f"scale.{self._request.id}.log").open("a") as out:
            out.write(line + "\n")

    def _answer(self, status: int) -> None:
        assert self._request is not None
        _write(self.root / f"scale.{self._request.id}.result.json", json.dumps({"status": status}))
        self._request, self._job = None, None

    def _start(self, request: ScaleRequest) -> None:
        self._request = request
        n = self.size
        if request.replicas:
            return self._resize(request.replicas)
        if request.to < 1 or request.to == n:
            self._say(f"--to {request.to}: the launch has {n} shards; give another count, at least 1")
            return self._answer(1)
        src = self.cluster.addresses[:n]
        serving_src = self.followers.addresses[:n] if self.followers is not None else []
        if request.to > len(self.cluster.shards):  # shards started for a grow that failed are reused
            first = len(self.cluster.shards)
            try:
                added = self.cluster.add_shards(request.to - first)
                if self.followers is not None:
                    self.followers.add_shards([s.address for s in added])
            except ShardStartError as exc:
                self._say(f"a new shard did not start: {exc}")
                return self._answer(1)
            self._say(f"started shards {first}..{request.to - 1}: {', '.join(s.address for s in added)}")
        dst = self.cluster.addresses[: request.to]
        serving_dst = self.followers.addresses[: request.to] if self.followers is not None else []
        serving = (serving_src, serving_dst) if self.followers is not None else None

        def run() -> None:
            for attempt in range(1, _TRIES + 1):
                try:
                    scale_cluster(
                        src, dst, serving=serving, say=self._say, max_rows_per_s=request.max_rows_per_s, timeout_s=600
                    )
                    _wait_dropped(src[request.to :], self._say)
                    self._status, self.size = 0, request.to
                    return
                except AdminError as exc:
                    self._say(f"try {attempt} of {_TRIES} failed: {exc}")
                    time.sleep(_RETRY_S)
            self._status = 1

        self._job = threading.Thread(target=run, name="ps-launch-scale", daemon=True)
        self._job.start()

    def _resize(self, per_shard: int) -> None:
        """Give each serving shard ``per_shard`` replicas, in the job's thread."""
        if self.followers is None:
            self._say("this launch has no serving shards: start it with --followers (or --serving-replicas N)")
            return self._answer(1)
        followers = self.followers

        def run() -> None:
            try:
                followers.resize(per_shard, self._say)
                self._status = 0
            except (ShardStartError, ValueError) as exc:
                self._say(f"the serving replicas did not change: {exc}")
                self._status = 1

        self._job = threading.Thread(target=run, name="ps-launch-replicas", daemon=True)
        self._job.start()

    def _finish(self) -> None:
        status = self._status
        self._write_addresses()  # before retired shards stop: nobody is sent to them from here on
        if status == 0 and self.size < len(self.cluster.shards):
            retired = len(self.cluster.shards) - self.size
            try:
                self.cluster.remove_shards(retired)
                if self.followers is not None:
                    self.followers.remove_shards(retired)
            except ShardStartError as exc:
                self._say(f"a retired shard did not stop cleanly: {exc}")
            else:
                self._say(f"stopped the {retired} retired shards (their data dirs stay)")
        elif status and self._request is not None and not self._request.replicas:
            self._say("the scale did not finish: run `ps-launch --scale` with the same --to again to go on")
        self._answer(status)

    def _write_addresses(self) -> None:
        """The current address lists, one line each, into the log dir (atomically)."""
        _write(self.root / ADDRESSES_FILE, ",".join(self.cluster.addresses[: self.size]) + "\n")
        if self.followers is not None:
            self.followers.set_size(self.size)  # its file is SERVING_ADDRESSES_FILE


def _wait_dropped(retired: list[str], say: Callable[[str], None], timeout_s: float = 300.0) -> None:
    """Wait until each shard a shrink ``retired`` dropped the rows it gave away (its reshard
    is done), so that stopping it leaves no moved row in its data dir."""
    shards, deadline = GrpcShards(10.0), time.monotonic() + timeout_s
    try:
        for address in retired:
            while shards.get_map(address).reshard.phase != "done":
                if time.monotonic() > deadline:
                    say(f"{address} still drops the rows it gave away; stopping it anyway (its next start goes on)")
                    return
                time.sleep(0.1)
    except (AdminError, RetryLater) as exc:
        say(f"could not ask a retired shard whether it dropped its rows ({exc}); stopping it anyway")
    finally:
        shards.close()


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
