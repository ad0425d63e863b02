"""``--data redis://HOST:PORT/STREAM``: a Redis stream, one click-log row per entry.

An entry's field ``row`` holds one line in the ``--schema`` layout (no header; a trailing
line break is dropped). Producers append with ``XADD STREAM * row "<line>"``: the entry ID
is then the millisecond the server appended it at, which is what makes batches a function
of the log: a batch holds at most ``max_rows`` entries, all of one ``window_ms`` tick of
their IDs, and a tick is complete once the server's clock (``TIME``) is past its end, as
Redis gives every later entry an ID at or above its clock.

The position is the ID of the last entry handed out (and, when known, of the next one).
Several workers split the entries by a hash of their IDs, each reading the whole stream and
keeping its own.
Nothing is kept on the server: no consumer group, no acknowledgement, so the trainer's
checkpoint alone says what it trained. Trimming (``XTRIM``, ``XADD MAXLEN``) entries
the trainer has read is fine; ``seek`` refuses a stream trimmed past the position. On
Redis 7 that check is exact (``max-deleted-entry-id``); before 7 the saved entry, or the
entry after it, must still be there, else ``seek`` refuses, as it cannot tell whether
rows were lost.

An entry without a ``row`` field, or whose row spans lines, is a malformed row (it
follows ``--bad-lines``). Messages name a row as ``redis://HOST:PORT/STREAM#ID:N``: the
N-th entry of the batch that starts at entry ``ID``.
"""

from __future__ import annotations

import time
import urllib.parse
from collections import deque
from typing import Any

from worker.stream import Lag, Lines, Position, StreamError, part_of

__all__ = ["RedisSource"]

READ_COUNT = 4096  # entries per XREAD
LAG_COUNT = 10_000  # lag(): entries counted past the buffer at most (an XRANGE of them)
FIELD = b"row"

_Entry = tuple[str, int, bytes | None]  # ID, its milliseconds, the row (None: no row field)


def _id(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class RedisSource:
    """Entries of one Redis stream, in ID order (see the module's docstring). One reader thread."""

    def __init__(self, url: str, *, window_ms: int = 100, part: tuple[int, int] = (0, 1)) -> None:
        """``part``: ``(rank, world)``: this reader takes the entries whose ID hashes to
        ``rank`` (``part_of``): each of ``world`` workers owns a part of the stream."""
        self.rank, self.world = part
        try:
            import redis
        except ImportError:
            raise StreamError(
                f"--data {url}: reading a Redis stream needs the redis package: pip install 'embedding-ps[stream]'"
            ) from None
        parts = urllib.parse.urlsplit(url)
        self.stream = parts.path.lstrip("/")
        try:
            port = parts.port or 6379
        except ValueError:
            port = -1
        if parts.scheme != "redis" or not parts.hostname or not self.stream or port < 0:
            raise StreamError(f"--data {url!r}: expected redis://HOST:PORT/STREAM")
        if window_ms < 1:
            raise ValueError(f"window_ms={window_ms}: must be >= 1")
        self.url, self.window_ms = url, window_ms
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self.redis = redis.Redis(parts.hostname, port, socket_connect_timeout=5, socket_timeout=30)
        try:
            self.redis.ping()
        except self._errors as exc:
            raise StreamError(f"--data {url}: cannot reach Redis at {parts.hostname}:{port} ({exc})") from None
        self._last = "0-0"  # the last entry handed out
        self._buf: deque[_Entry] = deque()  # this part's entries after it, read ahead
        self._seen = "0-0"  # the last entry read, of any part

    # -- position -------------------------------------------------------------------
    def position(self) -> Position:
        return {"last": self._last, "next": self._buf[0][0] if self._buf else None}

    def seek(self, position: Position | None) -> None:
        """Go to ``position`` (None: the start of the stream). Raises ``StreamError`` when
        entries after it were trimmed or deleted (or may have been: see the module)."""
        self._buf.clear()
        self._last = "0-0" if position is None else str(position.get("last") or "0-0")
        self._seen = self._last
        if self._last == "0-0":
            return
        try:
            info: dict[Any, Any] = self.redis.xinfo_stream(self.stream)
        except Exception as exc:  # redis.ResponseError: no such key
            raise StreamError(
                f"{self.url}: the stream is gone ({exc}); it held the saved position {self._last}"
            ) from None
        info = {k.decode() if isinstance(k, bytes) else k: v for k, v in info.items()}
        last = _id(self._last)
        first = info.get("first-entry")
        first_id = _id(first[0]) if first else None
        deleted = info.get("max-deleted-entry-id")
        if deleted is not None:  # Redis 7: exact
            lost = _id(deleted) > last
        elif self._exists(self._last) or (position and position.get("next") and self._exists(position["next"])):
            lost = False
        else:
            lost = first_id is not None or _id(info["last-generated-id"]) > last
        if lost:
            raise StreamError(
                f"{self.url}: the stream was trimmed past the saved position {self._last} (it now starts at "
                f"{first[0].decode() if first else 'nothing'}): the entries in between would be skipped. Keep more "
                "of the stream (XADD ... MAXLEN) than a trainer may fall behind, or start over with another "
                "--checkpoint-dir"
            )

    def _exists(self, entry_id: str) -> bool:
        return bool(self.redis.xrange(self.stream, entry_id, entry_id, count=1))

    def close(self) -> None:
        self.redis.close()

    # -- reading --------------------------------------------------------------------
    def next_batch(self, max_rows: int, wait_s: float) -> Lines | None:
        """The next batch (at most ``max_rows`` entries of one ``window_ms`` tick), once
        complete; None when it is not complete within ``wait_s`` seconds."""
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows}: must be >= 1")
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            if not self._buf:
                if not self._read(max(1, int(left * 1000)) if left > 0 else None):
                    if time.monotonic() >= deadline:
                        return None
                continue
            tick = self._buf[0][1] // self.window_ms
            n = 0
            while n < min(max_rows, len(self._buf)) and self._buf[n][1] // self.window_ms == tick:
                n += 1
            if n == max_rows or n < len(self._buf):
                return self._take(n)
            # The tick may still get entries: read what is there after asking the time.
            pipe = self.redis.pipeline(transaction=False)
            pipe.time()
            pipe.xread({self.stream: self._seen}, count=READ_COUNT)
            (sec, usec), found = pipe.execute()
            if self._extend(found):
                continue
            now_ms = sec * 1000 + usec // 1000
            end_ms = (tick + 1) * self.window_ms
            if now_ms >= end_ms:
                return self._take(n)
            if left <= 0:
                return None
            self._read(max(1, min(int(left * 1000), end_ms - now_ms)))

    def _read(self, block_ms: int | None) -> bool:
        """Read entries after the buffered ones (blocking up to ``block_ms``; None: not at all)."""
        try:
            found = self.redis.xread({self.stream: self._seen}, count=READ_COUNT, block=block_ms)
        except self._errors as exc:
            raise StreamError(f"{self.url}: lost the connection to Redis ({exc})") from exc
        return self._extend(found)

    def _extend(self, found: Any) -> bool:
        if not found:
            return False
        entries = found[0][1]
        for entry_id, fields in entries:
            if self.world == 1 or part_of(entry_id, self.world) == self.rank:
                text = entry_id.decode()
                self._buf.append((text, _id(text)[0], fields.get(FIELD)))
        if entries:
            self._seen = entries[-1][0].decode()
        return bool(entries)

    def _take(self, n: int) -> Lines:
        entries = [self._buf.popleft() for _ in range(n)]
        rows = []
        for _, _, row in entries:
            line = None if row is None else row.rstrip(b"\r\n")
            # A malformed entry becomes an empty line: it keeps its place (messages count
            # entries) and fails the schema's field count like any malformed row.
            rows.append(b"" if line is None or b"\n" in line else line)
        self._last = entries[-1][0]
        return Lines(
            b"\n".join(rows) + b"\n",
            n,
            f"{self.url}#{entries[0][0]}",
            1,
            self.position(),
            None,
            entries[-1][1] / 1000,
        )

    def lag(self) -> Lag:
        """Entries after the position (counted up to ``LAG_COUNT`` past the buffer), and the
        age of the oldest of them by the server's clock."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        pipe.xrange(self.stream, f"({self._seen}", "+", count=LAG_COUNT)
        (sec, usec), more = pipe.execute()
        oldest = self._buf[0][1] if self._buf else (_id(more[0][0])[0] if more else None)
        now_ms = sec * 1000 + usec // 1000
        behind = len(self._buf) + round(len(more) / self.world)  # this part's share of those not read
        return Lag(behind, 0.0 if oldest is None else max(0.0, (now_ms - oldest) / 1000))
