"""``--data dir:PATH``: a directory that keeps growing, one click-log file at a time.

Files land complete: written elsewhere (or under a name this source ignores: one that
starts with ``.`` or ends in ``.tmp``, ``.part`` or ``.inprogress``), then renamed in.
They are read in name order, every row once, so their names must sort in the order they
land (an hourly partition ``2026-11-29T13.tsv``, a zero-padded counter). A file that
lands with a name before the one being read would be skipped by that order: it stops the
run with a ``StreamError`` instead. Old files may be deleted once read (the position
names the file being read, its byte offset, and how many files came before it).

A batch never spans two files: the last one of a file holds the rows left in it. With a
header (``--schema`` with ``header = true``) every file starts with its own. Several workers
split the files by a hash of their names, each reading its own in name order.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import BinaryIO

import numpy as np

from worker.schema import ColumnSchema
from worker.stream import Lag, Lines, Position, StreamError, part_of

__all__ = ["DirectorySource", "IGNORED_SUFFIXES"]

IGNORED_SUFFIXES = (".tmp", ".part", ".inprogress")
CHUNK_BYTES = 1 << 20
POLL_S = 0.05  # how often an idle source looks for a new file


class DirectorySource:
    """Rows of the files in ``path``, in name order (see the module's docstring). One reader
    thread; blocks on the disk and, in ``next_batch``, up to ``wait_s`` for a new file."""

    def __init__(self, path: str, schema: ColumnSchema, part: tuple[int, int] = (0, 1)) -> None:
        """``part``: ``(rank, world)``: this reader takes the files whose name hashes to
        ``rank`` (``part_of``): each of ``world`` workers owns a part of the stream."""
        self.root = Path(path)
        self.url = f"dir:{path}"
        self.rank, self.world = part
        if not self.root.is_dir():
            raise StreamError(f"--data {self.url}: no such directory")
        self.schema = schema
        self._f: BinaryIO | None = None
        self._file: str | None = None  # the file being read (None: none yet)
        self._offset, self._line, self._eof, self._done = 0, 0, False, 0
        self._header: tuple[str, ...] | None = None
        self._bytes_read, self._rows_read = 0, 0  # for the lag in rows
        # Bytes of the current file read past the offset, where the buffer starts, and the
        # positions of its line ends.
        self._ahead, self._ahead_at, self._ends = b"", -1, np.empty(0, np.int64)

    # -- position -------------------------------------------------------------------
    def position(self) -> Position:
        return {
            "file": self._file,
            "offset": self._offset,
            "line": self._line,
            "eof": self._eof,
            "files_done": self._done,
        }

    def seek(self, position: Position | None) -> None:
        """Go to ``position`` (None: before the first file). A file the position is inside
        of that is gone raises ``StreamError``: the rows after the offset would be lost."""
        self.close()
        self._file, self._offset, self._line, self._eof, self._done = None, 0, 0, False, 0
        if position is None or position.get("file") is None:
            return
        name = str(position["file"])
        path = self.root / name
        self._file, self._done, self._eof = name, int(position["files_done"]), bool(position["eof"])
        self._offset, self._line = int(position["offset"]), int(position["line"])
        if not path.is_file():
            if self._eof:
                return  # read to its end before it was deleted: the next file follows
            raise StreamError(
                f"{self.url}: {name}, read up to byte {self._offset} at the saved position, is gone: the rows "
                "after that point would be lost. Put it back, or start over with another --checkpoint-dir"
            )
        self._f = path.open("rb")
        self._header = self._read_header(self._f, name)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self._ahead, self._ahead_at, self._ends = b"", -1, np.empty(0, np.int64)

    # -- reading --------------------------------------------------------------------
    def next_batch(self, max_rows: int, wait_s: float) -> Lines | None:
        """The next batch: at most ``max_rows`` rows of the file being read, or the next
        file's first ones. None when no row arrives within ``wait_s`` seconds."""
        if max_rows < 1:
            raise ValueError(f"max_rows={max_rows}: must be >= 1")
        deadline = time.monotonic() + wait_s
        while True:
            if self._f is not None and not self._eof:
                lines = self._read(max_rows)
                if lines is not None:
                    return lines
            if self._advance():
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(POLL_S, left))

    def _names(self) -> list[str]:
        with os.scandir(self.root) as entries:
            return sorted(
                e.name
                for e in entries
                if not e.name.startswith(".")
                and not e.name.endswith(IGNORED_SUFFIXES)
                and (self.world == 1 or part_of(e.name.encode(), self.world) == self.rank)
                and e.is_file()
            )

    def _advance(self) -> bool:
        """Open the file after the current one, if one has landed (False: none yet)."""
        names = self._names()
        current = self._file
        later = [n for n in names if current is None or n > current]
        if current is not None:
            earlier = sum(1 for n in names if n < current)
            if earlier > self._done:
                raise StreamError(
                    f"{self.url}: {earlier - self._done} file(s) landed with a name that sorts before {current}, "
                    "which was read already: files are read in name order, each once, so their rows would be "
                    "skipped. Give files names that sort in the order they land (a UTC timestamp, a zero-padded "
                    "counter), and move that file in again under such a name"
                )
            self._done = earlier  # old files deleted once read lower the count
        if not later:
            return False
        self.close()
        if current is not None:
            self._done += 1
        name = later[0]
        try:
            f = (self.root / name).open("rb")
        except FileNotFoundError:  # deleted between the listing and here: look again
            return True
        self._f, self._file, self._eof = f, name, False
        self._header = self._read_header(f, name)
        self._offset, self._line = f.tell(), 1 if self.schema.header else 0
        return True

    def _read_header(self, f: BinaryIO, name: str) -> tuple[str, ...] | None:
        if not self.schema.header:
            return None
        first = f.readline()
        return tuple(first.decode("utf-8-sig").rstrip("\r\n").split(self.schema.sep)) if first else None

    def _read(self, max_rows: int) -> Lines | None:
        """Up to ``max_rows`` lines of the current file from the offset (None: at its end).
        What was read past them waits in a buffer for the next batch: each byte is read once."""
        assert self._f is not None and self._file is not None
        f = self._f
        if self._ahead_at != self._offset:  # after a seek or a new file: read from the offset
            f.seek(self._offset)
            self._ahead, self._ends, self._ahead_at = b"", np.empty(0, np.int64), self._offset
        while self._ends.shape[0] < max_rows:
            block = f.read(CHUNK_BYTES)
            if not block:
                break
            ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10) + len(self._ahead)
            self._ahead, self._ends = self._ahead + block, np.concatenate([self._ends, ends])
        if self._ends.shape[0] >= max_rows:
            cut = int(self._ends[max_rows - 1]) + 1
            data, self._ahead = self._ahead[:cut], self._ahead[cut:]
            self._ends = self._ends[max_rows:] - cut
        else:
            data, self._ahead, self._ends = self._ahead, b"", np.empty(0, np.int64)
            if data and not data.endswith(b"\n"):
                data += b"\n"  # the last line of a file without a newline
        size = os.fstat(f.fileno()).st_size
        offset = min(size, self._offset + len(data))
        self._ahead_at = offset
        first_line, self._line = self._line + 1, self._line + data.count(b"\n")
        self._offset, self._eof = offset, offset >= size
        if not data:
            return None
        rows = data.count(b"\n")
        self._bytes_read, self._rows_read = self._bytes_read + len(data), self._rows_read + rows
        return Lines(
            data,
            rows,
            str(self.root / self._file),
            first_line,
            self.position(),
            self._header,
            os.fstat(f.fileno()).st_mtime,
        )

    def lag(self) -> Lag:
        """Bytes behind (the rest of the current file and every later one) as rows at the
        mean row size read so far; seconds since the oldest unread file landed."""
        behind, oldest = 0, None
        if self._f is not None and not self._eof:
            st = os.fstat(self._f.fileno())
            behind, oldest = st.st_size - self._offset, st.st_mtime
        for name in self._names():
            if self._file is None or name > self._file:
                try:
                    st = (self.root / name).stat()
                except FileNotFoundError:
                    continue
                behind += st.st_size
                oldest = st.st_mtime if oldest is None else min(oldest, st.st_mtime)
        rows = None if not self._rows_read else round(behind * self._rows_read / self._bytes_read)
        return Lag(rows, 0.0 if oldest is None or behind == 0 else max(0.0, time.time() - oldest))
