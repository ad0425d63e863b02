"""Failures a shard reports, each with exactly one gRPC status code.

Request handlers raise these; ``servicer.status_boundary`` turns them into the status
and message the client sees. Anything else that escapes a handler is a bug and becomes
INTERNAL (logged with its traceback), never UNKNOWN.
"""

from __future__ import annotations

import grpc

from protos.wire import MAP_EPOCH_METADATA, MOVING, WRONG_SHARD_METADATA

__all__ = [
    "InvalidRequest",
    "KeysMoving",
    "Moving",
    "NotConfigured",
    "OutOfCapacity",
    "RequestTooLarge",
    "BehindMap",
    "ShardError",
    "ShardMismatch",
    "ShuttingDown",
    "TableExists",
    "UnknownTable",
    "WrongMode",
    "WrongShard",
]


class ShardError(Exception):
    """Base of every error a shard reports on purpose; ``code`` is its gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    trailing_metadata: tuple[tuple[str, str], ...] = ()  # sent with the status


class InvalidRequest(ShardError):
    """Bad shape, dtype, byte length, NaN/Inf gradient or table spec (the message names the field)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownTable(ShardError):
    """The request names a table this shard does not hold."""

    code = grpc.StatusCode.NOT_FOUND


class TableExists(ShardError):
    """CreateTable for a name that exists with a different spec."""

    code = grpc.StatusCode.ALREADY_EXISTS


class WrongMode(ShardError):
    """The shard's mode forbids the call (e.g. Push to a read-only shard)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotConfigured(ShardError):
    """The call needs a setting this shard was started without (e.g. a checkpoint root)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ShardMismatch(ShardError):
    """The client routed keys for a different number of shards."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class BehindMap(ShardMismatch):
    """The request was routed by a newer cluster map than this shard has (``epoch``, sent
    as ``ps-map-epoch``): a replica started after a live reshard that has not been given
    the new map yet; a client of several replicas tries another."""

    def __init__(self, message: str, epoch: int) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.trailing_metadata = ((MAP_EPOCH_METADATA, str(epoch)),)


class WrongShard(ShardMismatch):
    """The request holds keys this shard does not own (``protos.keys.shard_of``); nothing
    of it was applied. ``owner`` is the shard of the key the message names, under the
    cluster map of ``epoch`` (this shard's: a client at an older one fetches it)."""

    def __init__(self, message: str, owner: int, epoch: int = 0) -> None:
        super().__init__(message)
        self.owner = owner
        self.epoch = epoch
        self.trailing_metadata = ((WRONG_SHARD_METADATA, str(owner)), (MAP_EPOCH_METADATA, str(epoch)))


class Moving(ShardError):
    """A reshard is not ready for the call yet: retry shortly."""

    code = grpc.StatusCode.UNAVAILABLE


class KeysMoving(Moving):
    """A reshard is handing over some keys of the request (a write to keys whose old owner
    is frozen, or a request routed by the new map before their new owner switched); refused
    before any of it was applied, so it is marked ``MOVING``: the client sends it again
    without using up an attempt."""

    trailing_metadata = (MOVING,)


class OutOfCapacity(ShardError):
    """A table cannot hold more rows."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RequestTooLarge(ShardError):
    """The request or its response exceeds the shard's message limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ShuttingDown(ShardError):
    """The shard is draining and takes no new work."""

    code = grpc.StatusCode.UNAVAILABLE
