"""A shard's role, training or serving: the one decision about what the two do differently.

The role is chosen once, when the shard is built (``ps-server --mode``), and answers every
question whose answer depends on it; ``Shard`` asks its role and never checks a mode.

* ``Training`` takes writes (CreateTable, Push, Checkpoint, MoveRows). A lookup creates the
  rows of missing keys, so it is a write that a reshard's freeze waits for. It numbers its
  changes for the serving shards that follow it (``Follow``), takes part in reshards,
  expires rows by TTL, and a stop that cannot write what it acknowledged saves a rescue dump.
* ``Serving`` refuses every write with ``WrongMode``. A lookup reads a missing key as its
  table's default and stores nothing, under the lock its source's changes take, so it
  sees a change whole or not at all. Its rows, version and lineage are its source's
  (``RowSource``: its data dir, a checkpoint, or the training shard it follows). Of a
  reshard it takes only the switch to a new map, and it never writes a rescue dump: it
  acknowledged no push.

Example:
    >>> role = Serving(0, ReadWriteLock())
    >>> role.mode, role.reads(read_only=False, budget_evicts=False)
    ('serve', (False, False))
    >>> role.refuse_writes("Push")
    Traceback (most recent call last):
    ...
    ps.errors.WrongMode: Push refused: shard 0 is read-only (mode=serve); send writes to the training shard it serves from
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

from protos import ps_pb2 as pb
from ps.errors import InvalidRequest, WrongMode
from ps.replication import DEFAULT_WAIT_S, ChangeLog, Held, Publications
from ps.rwlock import ReadWriteLock
from ps.shard.batches import Mode, RowSource

__all__ = ["Role", "Serving", "Training"]


class Training:
    """The role of a training shard (see the module docstring). ``writing()``: the context
    a write holds, which a reshard's freeze waits for; ``changes``: the shard's change
    log; ``lineage``: its data's."""

    mode: Mode = "train"
    takes_writes = True

    def __init__(
        self,
        index: int,
        writing: Callable[[], contextlib.AbstractContextManager[None]],
        changes: ChangeLog,
        lineage: str,
    ) -> None:
        self._index, self._writing, self._changes, self._lineage = index, writing, changes, lineage
        self.publications = Publications(changes)

    def refuse_writes(self, what: str) -> None:
        """A training shard takes every write."""

    def refuse_following(self) -> None:
        """A training shard is what serving shards follow."""

    def reading(self) -> contextlib.AbstractContextManager[None]:
        """What a lookup holds: it may create rows, a write a reshard's freeze waits for."""
        return self._writing()

    def reads(self, *, read_only: bool, budget_evicts: bool) -> tuple[bool, bool]:
        """``(create, touch)`` of a lookup: it creates missing rows and notes each row's use,
        unless the caller may only read (it then changes nothing a TTL or follower sees)."""
        return not read_only, not read_only

    def serve_from(self, checkpoint: str) -> pb.FollowStatus:
        raise WrongMode(
            f"ServeFrom refused: shard {self._index} is a training shard (mode=train); only serving shards switch sources"
        )

    def publish(self, request: pb.PublishRequest) -> pb.PublishResponse:
        """Publish the rows as they are now under ``request.name``, or hold or release
        publishing (``ps.replication.publish``); neither: only say where publishing stands.
        A held publication is an answer, not an error."""
        pubs, held = self.publications, False
        if request.name and request.hold:
            raise InvalidRequest("Publish: give a name (to publish) or hold (HOLD or RELEASE), not both")
        if len(request.name) > 200 or not request.name.isprintable():
            raise InvalidRequest(f"Publish: name {request.name[:200]!r}: at most 200 printable characters")
        if not math.isfinite(request.wait_s) or request.wait_s < 0:
            raise InvalidRequest(f"Publish: wait_s={request.wait_s}: seconds >= 0 (0: the default)")
        version, streams, exact = self._changes.version, 0, 0
        if request.hold == pb.PublishRequest.HOLD:
            pubs.hold("held by hand (ps-admin publish --hold); release with ps-admin publish --release")
        elif request.hold == pb.PublishRequest.RELEASE:
            pubs.release()
        elif request.name:
            try:
                version, streams, exact = pubs.publish(request.name, request.wait_s or DEFAULT_WAIT_S)
            except Held:
                held = True
        return pb.PublishResponse(
            version=version,
            held=held,
            followers=streams,
            exact=exact,
            published=pubs.published,
            held_by=pubs.held_by,
        )

    def roll_back(self) -> pb.FollowStatus:
        raise WrongMode(
            f"RollBack refused: shard {self._index} is a training shard (mode=train); serving shards roll back "
            "what they serve"
        )

    @property
    def source(self) -> RowSource | None:
        return None

    @property
    def publication(self) -> str:
        return ""

    @property
    def version(self) -> int:
        """The shard's version: its change log's."""
        return self._changes.version

    @property
    def lineage(self) -> str:
        return self._lineage


class Serving:
    """The role of a serving shard (see the module docstring). ``serve_lock``: what its
    lookups hold to read and its source's changes to write; ``source``: where its rows come
    from (None: its tables as they are, e.g. in tests)."""

    mode: Mode = "serve"
    takes_writes = False

    def __init__(
        self, index: int, serve_lock: ReadWriteLock, source: RowSource | None = None, lineage: str = ""
    ) -> None:
        self._index, self._lock, self.source, self._lineage = index, serve_lock, source, lineage

    def refuse_writes(self, what: str) -> None:
        raise WrongMode(
            f"{what} refused: shard {self._index} is read-only (mode=serve); send writes to the training shard it "
            "serves from"
        )

    def refuse_following(self) -> None:
        raise WrongMode(f"Follow refused: shard {self._index} is a serving shard; follow its training shard")

    def reading(self) -> contextlib.AbstractContextManager[None]:
        """What a lookup holds: the read side of the lock the source's changes take."""
        return self._lock.reading()

    def reads(self, *, read_only: bool, budget_evicts: bool) -> tuple[bool, bool]:
        """``(create, touch)`` of a lookup: nothing is created; a row's use is noted only
        where a memory budget evicts by it."""
        return False, budget_evicts

    def serve_from(self, checkpoint: str) -> pb.FollowStatus:
        if self.source is None:
            raise WrongMode(f"ServeFrom refused: serving shard {self._index} has no source to switch")
        return self.source.serve_from(checkpoint)

    def publish(self, request: pb.PublishRequest) -> pb.PublishResponse:
        raise WrongMode(
            f"Publish refused: shard {self._index} is a serving shard (mode=serve); publish on the training shards"
        )

    def roll_back(self) -> pb.FollowStatus:
        if self.source is None:
            raise WrongMode(f"RollBack refused: serving shard {self._index} has no source")
        return self.source.roll_back()

    @property
    def publication(self) -> str:
        """The publication served ("" without --published-only, or before the first)."""
        return self.source.publication if self.source is not None else ""

    @property
    def version(self) -> int:
        """The version of the rows served: its source's."""
        return self.source.applied_version if self.source is not None else 0

    @property
    def lineage(self) -> str:
        return self.source.lineage if self.source is not None else self._lineage


Role = Training | Serving
"""A shard's role; ``role.mode`` says which."""
