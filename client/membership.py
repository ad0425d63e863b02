"""Where each shard's replicas come from while a client runs, and which of them take calls.

Fixed addresses stay as given. Two kinds of entry change while the client runs
(``Members``):

* ``dns:HOST:PORT``, in place of one replica: every address HOST resolves to, at PORT,
  is a replica of that shard (a Kubernetes headless Service has one A record per ready
  pod). The name is resolved again every round; a failed resolution keeps what the last
  one found.
* an addresses file (``PSClient(addresses_file=PATH)``, ``ps-infer --ps-file PATH``): the
  ``--ps`` syntax (``h:1+h:2,h:3``, ``dns:`` entries too), read again every round. A
  file that cannot be read or parsed keeps the replicas it listed last (logged once).

``MembershipWatcher`` runs a round as the client starts, then one every
``ClientConfig.membership_refresh_s``: it
resolves, applies that to the current cluster view (a replica that left gets no new call
from then on; one that joined is pending), and asks every member for its gRPC health
(the server as a whole): a pending replica that answers SERVING takes calls from then on,
a serving one that answers NOT_SERVING (it is draining before it stops) gets calls only
when nothing else is left, and one that answers SERVING again is back. A shard whose
entries resolve to nothing keeps its replicas. After a live reshard the new cluster map
names the replicas (``dns:`` entries in it too), unless they come from a file: a file
listing another number of shards than the map has is not applied until the two agree
(the map and the file each catch up).

Example:
    >>> Members([["dns:127.0.0.1:50051", "10.0.0.9:50051"]]).resolve()[0]
    [['127.0.0.1:50051', '10.0.0.9:50051']]
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from client.cluster import ClusterView, ClusterViews
from client.errors import InvalidRequestError
from client.replicas import DNS_PREFIX, normalize_addresses, parse_addresses, placeholder
from protos.rpc.names import addresses_of, resolve_name
from protos.rpc.names import dns_name as _dns_name

__all__ = ["DNS_PREFIX", "Members", "MembershipWatcher", "addresses_of", "resolve_name"]

log = logging.getLogger(__name__)

Resolve = Callable[[str, int], list[str]]
"""``HOST``, ``PORT`` -> the ``ADDRESS:PORT`` replicas of that name (``resolve_name``)."""


class Members:
    """Each shard's replica entries (``spec``, or an addresses file's ``path``), and the
    addresses they resolve to now (see the module docstring)."""

    def __init__(
        self, spec: Sequence[Sequence[str]] | None = None, path: Path | None = None, resolve: Resolve = resolve_name
    ) -> None:
        if (spec is None) == (path is None):
            raise ValueError("give the replicas or the file that lists them, one of the two")
        self.path = path
        self._resolve = resolve
        self._text = ""
        self._warned = ""
        if path is not None:
            self._text, spec = self._read_file(path)
        assert spec is not None
        self.spec = [list(entries) for entries in spec]
        self._found: dict[str, list[str]] = {}  # a dns: entry's last resolution
        self.server_names: dict[str, str] = {}  # a resolved address -> the name it came from (TLS)

    @property
    def dynamic(self) -> bool:
        """Whether the replicas may change: a file, or a ``dns:`` entry."""
        return self.path is not None or any(_dns_name(e) for entries in self.spec for e in entries)

    def placeholders(self) -> list[list[str]]:
        """The spec with each ``dns:HOST:PORT`` as ``HOST:PORT`` (gRPC resolves that name
        itself): the replicas a client starts with before its first round."""
        return [[placeholder(e) for e in entries] for entries in self.spec]

    @staticmethod
    def _read_file(path: Path) -> tuple[str, list[list[str]]]:
        try:
            text = path.read_text()
        except OSError as exc:
            raise InvalidRequestError(f"addresses file {path}: cannot read it ({exc.strerror or exc})") from None
        try:
            return text, parse_addresses(" ".join(text.split()))
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"addresses file {path}: {exc}") from None

    def reread(self) -> bool:
        """Read the file again (no file: nothing to do); True if what it lists changed.
        A file that cannot be read or parsed keeps the last spec (logged once)."""
        if self.path is None:
            return False
        try:
            text, spec = self._read_file(self.path)
        except InvalidRequestError as exc:
            if str(exc) != self._warned:
                log.warning("%s; keeping the replicas it listed before", exc)
                self._warned = str(exc)
            return False
        self._warned = ""
        if text == self._text:
            return False
        self._text, changed = text, spec != self.spec
        self.spec = spec
        return changed

    def resolve(self) -> tuple[list[list[str]], dict[str, str]]:
        """Per shard, the addresses its entries resolve to now (a ``dns:`` entry that does
        not resolve keeps its last addresses); and the name each resolved one came from."""
        out = []
        for entries in self.spec:
            addresses: dict[str, None] = {}
            for entry in entries:
                name = _dns_name(entry)
                if name is None:
                    addresses[entry] = None
                    continue
                try:
                    found = self._resolve(*name)
                except OSError as exc:
                    found = self._found.get(entry, [])
                    if entry not in self._warned:
                        log.warning("%s does not resolve (%s); keeping %s", entry, exc, ", ".join(found) or "nothing")
                        self._warned = entry
                else:
                    self._found[entry] = found
                for address in found:
                    addresses[address] = None
                    self.server_names[address] = name[0]
            out.append(list(addresses))
        return out, dict(self.server_names)


def members_of(
    addresses: Sequence[str | Sequence[str]] | None, addresses_file: str | os.PathLike[str] | None
) -> Members:
    """The members a client is given: ``addresses`` (each shard's, or its replicas'), or an
    ``addresses_file`` re-read as it changes; ``InvalidRequestError`` unless exactly one."""
    if (addresses is None) == (addresses_file is None):
        raise InvalidRequestError(
            "give the shards' addresses or addresses_file (a file of them, re-read as it changes), one of the two"
        )
    if addresses_file is not None:
        return Members(path=Path(addresses_file))
    assert addresses is not None
    return Members(normalize_addresses(addresses))


class MembershipWatcher:
    """Keeps ``views``' current view's replicas in step with ``members`` and their health
    (see the module docstring): ``start()`` runs a first round at once, then one every
    ``refresh_s`` on a thread of its own, until ``close()``."""

    def __init__(self, views: ClusterViews, members: Members, refresh_s: float) -> None:
        self._views, self._members, self._refresh_s = views, members, refresh_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._leaving: dict[int, ClusterView] = {}  # endpoints that left, until their channel is closed
        self._skipped: tuple[int, int] | None = None
        self._epoch = views.current.epoch
        self.rounds = 0

    @property
    def needed(self) -> bool:
        """Whether the current view has replicas that may change or need health checks:
        a file, a ``dns:`` entry, or a shard with several replicas."""
        view = self._views.current
        return self._members.dynamic or any(
            len(shard) > 1 or any(e.startswith(DNS_PREFIX) for e in shard) for shard in view.entries
        )

    def start_if_needed(self) -> None:
        """``start`` if ``needed`` (a training cluster's client never needs it)."""
        if self.needed:
            self.start()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="ps-health")
        self.round()
        self._thread = threading.Thread(target=self._run, name="ps-membership", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _run(self) -> None:
        while not self._stop.wait(self._refresh_s):
            try:
                self.round()
            except Exception:  # a round must never end the watcher
                log.exception("replica membership round failed; trying again in %.1f s", self._refresh_s)

    def round(self) -> None:
        """Resolve, apply, check health (see the module docstring). Until one of a shard's
        replicas answered SERVING, its calls go to the others anyway (``ReplicaSet.pick``):
        a client whose names resolved to replicas not checked yet still calls them."""
        view = self._views.current
        if self._members.path is None and view.epoch != self._epoch:
            # A cluster map newer than the addresses given names the replicas now.
            self._members.spec = [list(shard) for shard in view.entries]
        self._epoch = view.epoch
        self._members.reread()
        resolved, names = self._members.resolve()
        if len(resolved) != view.num_shards:
            if self._skipped != (len(resolved), view.num_shards):
                where = self._members.path or "the addresses given"
                log.warning(
                    "%s: %d shards, the cluster map %d: its replicas wait until the two agree",
                    where,
                    len(resolved),
                    view.num_shards,
                )
                self._skipped = (len(resolved), view.num_shards)
        else:
            self._skipped = None
            for shard, addresses in enumerate(resolved):
                if addresses and set(addresses) != set(view.replica_set.members(shard)[0]):
                    change = view.set_members(shard, addresses, server_names=names)
                    self._leaving.update(dict.fromkeys(change.left, view))
        self._close_left()
        self._check(view)
        self.rounds += 1

    def _close_left(self) -> None:
        for endpoint, view in list(self._leaving.items()):
            replicas = view.replica_set
            if replicas.state(endpoint) != "gone":  # it came back
                del self._leaving[endpoint]
            elif replicas.inflight(endpoint) == 0:
                if view is self._views.current:
                    view.transport.drop(endpoint)
                del self._leaving[endpoint]

    def _check(self, view: ClusterView) -> None:
        checks = view.transport
        if self._pool is None:
            return
        replicas = view.replica_set
        endpoints = [
            e
            for shard in range(view.num_shards)
            if self._members.dynamic or len(replicas.members(shard)[0]) > 1
            for e in replicas.endpoints(shard)
        ]
        timeout_s = min(1.0, self._refresh_s)
        answers = list(self._pool.map(lambda e: checks.check(e, timeout_s), endpoints))
        for endpoint, serving in zip(endpoints, answers):
            if serving is not None:
                replicas.set_health(endpoint, serving)
