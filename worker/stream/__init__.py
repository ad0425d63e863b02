"""Stream sources: rows that keep arriving, read from a position the trainer checkpoints.

``--data dir:PATH`` reads a directory that keeps growing (``DirectorySource``);
``--data redis://HOST:PORT/STREAM`` reads a Redis stream (``RedisSource``). Every source
is a log of click-log rows (the lines ``--schema`` reads from a file) with a position:

* ``next_batch(max_rows, wait_s)`` hands out the next batch of rows, or None when none is
  complete within ``wait_s``. Where a batch ends is a function of the log alone, never of
  when it was read: at most ``max_rows`` rows, cut at each file's end (a directory) or at
  each ``window_ms`` tick of the entries' IDs (Redis, whose IDs are the milliseconds they
  were appended at). A trainer restarted at a saved position therefore cuts the same
  batches again, and pushes each under the seq it had before: the shards skip the ones
  they applied, and exactly-once holds for any checkpoint interval.
* ``position()`` (after the last batch handed out) is a small JSON-able dict;
  ``seek(position)`` goes back to one, and raises ``StreamError`` when the log no longer
  holds every row after it (trimmed or deleted): never a silent skip.
* ``lag()``: how far behind the head of the log the position is.

A Kafka source would implement the same four methods: a partition's offset is the
position, and a batch is cut at ``max_rows`` or at a tick of the records' log-append
timestamps (``message.timestamp.type=LogAppendTime``), so that it too is a function of
the log. It is not shipped: no broker runs on the machines this project is tested on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

from worker.schema import ColumnSchema, DataError

__all__ = [
    "Lag",
    "Lines",
    "StreamError",
    "StreamSource",
    "StreamBadLines",
    "is_stream",
    "part_of",
    "open_stream",
]

Position = dict[str, Any]


class StreamError(ValueError):
    """A stream that cannot be read from the position asked for (gone, trimmed past it,
    renamed out of order), or a ``--data`` stream address that does not parse."""


@dataclass(frozen=True)
class Lines:
    """One batch's rows as read: complete lines, each ending in ``\\n``.

    ``where`` and ``first_line`` name the first line in messages (a file and its 1-based
    line; a stream and the entry ID it starts at, its lines counted from 1); ``header``:
    the column names of the file they come from (None: the schema's own names); ``end``:
    the position after them; ``appended_s``: when the last row was appended to the log
    (Unix seconds), for the lag from event to trained row."""

    data: bytes
    rows: int
    where: str
    first_line: int
    end: Position
    header: tuple[str, ...] | None = None
    appended_s: float | None = None


@dataclass(frozen=True)
class Lag:
    """How far a position is behind the head of its log: ``rows`` (None: the source cannot
    count them cheaply) and ``seconds`` (age of the oldest row not yet handed out; 0 when
    caught up)."""

    rows: int | None
    seconds: float


class StreamBadLines:
    """Malformed rows a stream left out (``--bad-lines skip``): how many, and where the
    first ``KEEP`` were. Unlike a file's ``BadLines`` it keeps no set of rows seen: a
    stream reads each row once, forever."""

    KEEP = 5

    def __init__(self) -> None:
        self.count = 0
        self.first: list[str] = []

    def add(self, where: str, count: int, first: list[int]) -> None:
        """``count`` rows of one batch from ``where``, the first of them at lines ``first``."""
        self.count += count
        self.first.extend(f"{where}:{n}" for n in first[: self.KEEP - len(self.first)])

    def __str__(self) -> str:
        more = ", ..." if self.count > len(self.first) else ""
        return f"{self.count} malformed rows skipped (first at {', '.join(self.first)}{more})"


class StreamSource(Protocol):
    """What the online trainer reads (see the module's docstring)."""

    url: str

    def next_batch(self, max_rows: int, wait_s: float) -> Lines | None: ...

    def position(self) -> Position: ...

    def seek(self, position: Position | None) -> None: ...

    def lag(self) -> Lag: ...

    def close(self) -> None: ...


def part_of(name: bytes, world: int) -> int:
    """The part (of ``world``) a file name or entry ID belongs to: a hash spread evenly over
    any names (CRC-32 is not: its low bits follow names that differ in a digit or two).

    >>> sorted({part_of(f"part-{k:08d}.tsv".encode(), 2) for k in range(8)})
    [0, 1]
    """
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little") % world


def is_stream(data: str) -> bool:
    """Whether ``--data`` names a stream rather than a file (or ``synthetic``)."""
    return data.startswith(("dir:", "redis://"))


def open_stream(
    data: str, schema: ColumnSchema, *, window_ms: int = 100, part: tuple[int, int] = (0, 1)
) -> StreamSource:
    """The source ``--data`` names (``dir:PATH`` or ``redis://HOST:PORT/STREAM``), at the
    start of its log (``seek`` moves it). Raises ``StreamError`` (one line) for an address
    that does not parse or a stream that cannot be reached, ``DataError`` for a schema the
    source cannot read (a Redis row has no header line to name its columns). ``part``:
    ``(rank, world)``, the part of the stream this worker of ``world`` reads."""
    if data.startswith("dir:"):
        from worker.stream.directory import DirectorySource

        return DirectorySource(data.removeprefix("dir:"), schema, part)
    if data.startswith("redis://"):
        if schema.header:
            raise DataError(
                f"{data}: a stream entry is one row, with no header line to name the columns: use a schema with "
                "header = false (and names = [...] to name them)",
                data,
            )
        from worker.stream.redisstream import RedisSource

        return RedisSource(data, window_ms=window_ms, part=part)
    raise StreamError(f"--data {data!r}: a stream is dir:PATH or redis://HOST:PORT/STREAM")
