"""Training data: the ``Batch`` type and delimited click-log readers (the synthetic stream
is in ``worker.synthetic``; ``auc`` and ``logloss``, in ``worker.metrics``, are re-exported here).

A sample is one row of ``Batch.dense``, one label and, per categorical feature,
exactly one key ``protos.keys.hash_feature(raw_value, feature_seed)``. The raw value
is the field's bytes as they appear in the file; an empty field hashes as ``""``, so
"missing" learns its own row. A multi-valued feature has any number of keys per sample,
one per value of its field (``worker.multivalued``). The default seed of a feature is
``feature_seed(name) = hash_feature(name, 0) mod 2**64``, so every process agrees.

Hot paths make no Python object per value: a file is read in byte chunks that numba
kernels split and parse in place, and ``protos.hashing.hash_fields`` hashes each
field's byte range (the same kernel ``hash_feature`` uses, so the hash exists once).

Example:
    >>> auc([0, 1, 0, 1], [0.1, 0.9, 0.3, 0.2])
    0.75
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import numba
import numpy as np
import numpy.typing as npt
import torch

from protos.hashing import hash_fields, hash_strings
from worker.fields import bucket_keys, dense_values, parse_numbers
from worker.jagged import JaggedIds
from worker.metrics import auc, logloss
from worker.multivalued import JaggedKeys, split_keys
from worker.rare import rare_key, share_rare
from worker.schema import (
    BadLines,
    ColumnNotFound,
    ColumnSchema,
    DataError,
    Layout,
    SchemaColumns,
    feature_seed,
    read_header,
    resolve_layout,
    schema_columns,
)

__all__ = [
    "BadLines",
    "Batch",
    "ClickLog",
    "DataError",
    "ColumnSchema",
    "JaggedKeys",
    "SchemaColumns",
    "auc",
    "feature_seed",
    "hash_strings",
    "load_click_log",
    "logloss",
    "parse_lines",
    "rare_key",
    "raw_columns",
    "read_click_log",
    "schema_columns",
]


F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
BOOL = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Batch:
    """One mini-batch: ``dense`` float32 ``[B, num_dense]``, one ``JaggedIds`` of int64
    keys per sparse feature, ``labels`` float32 ``[B]`` of 0/1. CPU tensors that no one
    else writes; consumers must not modify them in place (batches may view one chunk)."""

    dense: torch.Tensor
    sparse: dict[str, JaggedIds]
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])


# --- numba kernels: the whole chunk is one uint8 buffer, fields are [start, end) ranges.


@numba.njit(nogil=True, cache=True)
def _split_fields(buf: U8, line_starts: I64, line_ends: I64, sep: int, starts: I64, ends: I64, ok: BOOL) -> int:
    """Fills field ranges of every line and clears ``ok`` of each line with a wrong field
    count (its ranges are then undefined); returns the first such line, or -1."""
    nfields = starts.shape[1]
    first = -1
    for i in range(line_starts.shape[0]):
        s, e = line_starts[i], line_ends[i]
        if e > s and buf[e - 1] == 13:  # CRLF files (the Avazu sample is one)
            e -= 1
        f = 0
        good = True
        starts[i, 0] = s
        for p in range(s, e):
            if buf[p] == sep:
                if f + 1 >= nfields:
                    good = False
                    break
                ends[i, f] = p
                f += 1
                starts[i, f] = p + 1
        if good and f + 1 == nfields:
            ends[i, f] = e
        else:
            ok[i] = False
            if first < 0:
                first = i
    return first


# --- delimited click logs


def raw_columns(path: str | os.PathLike[str], schema: ColumnSchema, first: int, count: int) -> dict[str, list[str]]:
    """The raw text of rows ``[first, first + count)`` of ``path`` (after a header), by the
    names a predictor takes (``schema_columns``'s categorical and dense columns): what an
    online request would carry for those rows. For examples and tests: Python per field.
    """
    with open(path, "rb") as f:
        header = read_header(f, schema, os.fspath(path))
        start = f.tell()
        lay = resolve_layout(schema, header, f.readline())
        f.seek(start)
        lines = [line for _, line in zip(range(first + count), f)][first:]
    fields = [line.decode("utf-8").rstrip("\r\n").split(schema.sep) for line in lines]
    names = {
        **dict(zip(lay.features, lay.cat)),
        **dict(zip(lay.dense_names, lay.dense)),
        **dict(zip(lay.features[lay.key_rows :], lay.multi)),
    }
    return {name: [row[int(i)] for row in fields] for name, i in names.items()}


@dataclass(frozen=True)
class _Rows:
    """Parsed rows: labels 0/1 ``[n]``, final dense values ``[n, D]``, keys ``[F, n]``, order
    ``[n]`` or None, and the keys of each multi-valued feature."""

    labels: npt.NDArray[np.float32]
    dense: npt.NDArray[np.float32]
    keys: I64
    order: F64 | None
    bags: tuple[JaggedKeys, ...] = ()

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def _parse_lines(
    buf: U8,
    line_starts: I64,
    line_ends: I64,
    first_line_no: int,
    lay: Layout,
    schema: ColumnSchema,
    where: str,
    skipped: BadLines | None = None,
) -> _Rows:
    """The complete lines ``[line_starts, line_ends)`` of ``buf`` as ``_Rows``. A malformed
    line raises ``DataError``, or with ``skipped`` is left out and counted there."""
    n, sep = line_starts.shape[0], ord(schema.sep)
    starts, ends = np.empty((n, lay.nfields), np.int64), np.empty((n, lay.nfields), np.int64)
    ok = np.ones(n, np.bool_)
    line_nos = first_line_no + np.arange(n, dtype=np.int64)
    bad = _split_fields(buf, line_starts, line_ends, sep, starts, ends, ok)
    if bad >= 0:
        if skipped is None:
            line = bytes(buf[line_starts[bad] : line_ends[bad]]).rstrip(b"\r")
            got = line.count(bytes([sep])) + 1
            raise DataError(
                f"{where}:{first_line_no + bad}: {got} fields, expected {lay.nfields}: {line[:200]!r}",
                where,
                first_line_no + bad,
            )
        skipped.add(line_nos[~ok])
        starts, ends, line_nos = starts[ok], ends[ok], line_nos[ok]  # the bad lines' ranges are undefined
    drop = np.zeros(line_nos.shape[0], np.bool_)

    def field(i: int, col: int) -> bytes:
        return bytes(buf[starts[i, col] : ends[i, col]])

    def refuse(rows: I64, col: int, message: str) -> None:
        """Raise for the first of ``rows`` (``message`` names it, and column ``col``), or drop them all when skipping."""
        if skipped is None:
            line = int(line_nos[rows[0]])
            raise DataError(f"{where}:{line}: {message}", where, line, lay.names[col])
        drop[rows] = True

    def numbers(cols: I64) -> tuple[F64, npt.NDArray[np.bool_]]:
        out, empty, bad = parse_numbers(buf, starts, ends, cols)
        if bad.shape[0]:
            i, c = bad[0]
            refuse(
                bad[:, 0],
                int(cols[c]),
                f"column {lay.names[cols[c]]!r} (field {cols[c] + 1}): {field(i, cols[c])[:100]!r} is not a finite number",
            )
        return out, empty

    labels, missing = numbers(lay.label)
    col = int(lay.label[0])
    if schema.label_threshold is None:
        wrong = np.flatnonzero(missing[:, 0] | ((labels[:, 0] != 0.0) & (labels[:, 0] != 1.0)))
        expected = "expected 0 or 1"
    else:
        wrong = np.flatnonzero(missing[:, 0])
        expected = f"expected a number (positive when >= {schema.label_threshold})"
        labels = (labels >= schema.label_threshold).astype(np.float64)
    if wrong.size:
        i = int(wrong[0])
        refuse(wrong, col, f"column {lay.names[col]!r} (field {col + 1}): label {field(i, col)[:100]!r}, {expected}")
    raw, empty = numbers(lay.dense)  # empty -> 0 already
    order = None
    if lay.order.shape[0]:
        values, empty_order = numbers(lay.order)
        if empty_order.any():
            where_empty = np.flatnonzero(empty_order[:, 0])
            refuse(where_empty, int(lay.order[0]), f"column {lay.names[lay.order[0]]!r} (order_by) is empty")
        order = values[:, 0]
    if skipped is not None and drop.any():  # (without skipped, refuse() raised)
        skipped.add(line_nos[drop])
        keep = ~drop
        starts, ends, labels, raw, empty = starts[keep], ends[keep], labels[keep], raw[keep], empty[keep]
        order = None if order is None else order[keep]
    keys = np.empty((lay.key_rows, starts.shape[0]), np.uint64)
    hash_fields(buf, starts, ends, lay.cat, lay.bases, keys)
    for j, seed in enumerate(lay.bucket_seeds):
        keys[lay.cat.shape[0] + j] = bucket_keys(raw[:, j], empty[:, j], seed).view(np.uint64)
    bags = tuple(
        split_keys(buf, starts[:, col], ends[:, col], sep, basis)
        for col, sep, basis in zip(lay.multi.tolist(), lay.multi_seps, lay.multi_bases)
    )
    return _Rows(
        labels[:, 0].astype(np.float32),
        dense_values(raw, schema.log_transform),
        keys[: lay.key_rows].view(np.int64),
        order,
        bags,
    )


def _concat(parts: Sequence[_Rows]) -> _Rows:
    if len(parts) == 1:
        return parts[0]
    orders = [p.order for p in parts if p.order is not None]
    return _Rows(
        np.concatenate([p.labels for p in parts]),
        np.concatenate([p.dense for p in parts]),
        np.concatenate([p.keys for p in parts], axis=1),
        np.concatenate(orders) if orders else None,
        tuple(JaggedKeys.concat(bag) for bag in zip(*(p.bags for p in parts))),
    )


def _take(rows: _Rows, lo: int, hi: int) -> _Rows:
    return _Rows(
        rows.labels[lo:hi],
        rows.dense[lo:hi],
        rows.keys[:, lo:hi],
        None if rows.order is None else rows.order[lo:hi],
        tuple(b.rows(lo, hi) for b in rows.bags),
    )


def _read_rows(
    path: str | os.PathLike[str],
    schema: ColumnSchema,
    skip: int,
    limit: int | None,
    chunk_bytes: int,
    bad_lines: BadLines | None = None,
) -> Iterator[tuple[Layout, _Rows]]:
    """Parsed rows of ``path``, one chunk at a time (see ``read_click_log``). ``skip`` and
    ``limit`` count lines, skipped malformed ones included."""
    where = os.fspath(path)
    with open(path, "rb") as f:
        header = read_header(f, schema, where)
        line_no = 0 if header is None else 1  # lines consumed so far
        lay: Layout | None = None
        to_skip, left = skip, limit
        carry = b""
        while left is None or left > 0:
            block = f.read(chunk_bytes)
            data = carry + block
            if block:
                cut = data.rfind(b"\n") + 1
                if cut == 0:  # a line longer than the chunk: keep reading
                    carry = data
                    continue
                data, carry = data[:cut], data[cut:]
            elif not data:
                break
            elif not data.endswith(b"\n"):
                data += b"\n"  # last line without a newline
            buf = np.frombuffer(data, dtype=np.uint8)
            line_ends = np.flatnonzero(buf == 10)
            line_starts = np.concatenate(([0], line_ends[:-1] + 1))
            lo = min(to_skip, line_ends.shape[0])
            hi = line_ends.shape[0] if left is None else min(line_ends.shape[0], lo + left)
            to_skip -= lo
            if hi > lo:
                if lay is None:
                    try:
                        lay = resolve_layout(schema, header, bytes(buf[line_starts[lo] : line_ends[lo]]))
                    except ValueError as exc:
                        column = str(exc.column) if isinstance(exc, ColumnNotFound) else None
                        raise DataError(f"{where}: {exc}", where, column=column) from None
                rows = _parse_lines(
                    buf, line_starts[lo:hi], line_ends[lo:hi], line_no + lo + 1, lay, schema, where, bad_lines
                )
                yield lay, rows
                left = None if left is None else left - (hi - lo)
            line_no += line_ends.shape[0]
            if not block:
                break


def _make_batch(rows: _Rows, features: tuple[str, ...]) -> Batch:
    offsets = torch.arange(len(rows) + 1)
    keyed = features[: rows.keys.shape[0]]
    sparse = {f: JaggedIds(torch.from_numpy(rows.keys[c]), offsets) for c, f in enumerate(keyed)}
    for f, bag in zip(features[len(keyed) :], rows.bags):
        sparse[f] = JaggedIds(torch.from_numpy(bag.values), torch.from_numpy(bag.offsets))
    return Batch(torch.from_numpy(rows.dense), sparse, torch.from_numpy(rows.labels))


def parse_lines(
    data: bytes, schema: ColumnSchema, layout: Layout, where: str, first_line: int, bad_lines: BadLines | None = None
) -> Batch:
    """The complete lines of ``data`` (each ending in ``\\n``) as one ``Batch``: rows that
    arrive a few at a time (``worker.stream``). ``where`` and ``first_line`` (the 1-based
    number of the first line) name a malformed line in the ``DataError`` raised for it; with
    ``bad_lines`` it is left out instead, and counted there (the batch may then be empty).

    >>> from worker.schema import resolve_layout
    >>> s = ColumnSchema("y", ["n"], ["c"], sep=",", names=["y", "n", "c"])
    >>> lay = resolve_layout(s, None, b"1,3,a")
    >>> parse_lines(b"1,3,a\\n0,1,b\\n", s, lay, "clicks", 1).labels.tolist()
    [1.0, 0.0]
    """
    buf = np.frombuffer(data, dtype=np.uint8)
    line_ends = np.flatnonzero(buf == 10)
    line_starts = np.concatenate(([0], line_ends[:-1] + 1)).astype(np.int64)
    return _make_batch(
        _parse_lines(buf, line_starts, line_ends, first_line, layout, schema, where, bad_lines), layout.features
    )


def read_click_log(
    path: str | os.PathLike[str],
    schema: ColumnSchema,
    batch_size: int,
    *,
    limit: int | None = None,
    skip: int = 0,
    chunk_bytes: int = 1 << 20,
    bad_lines: BadLines | None = None,
) -> Iterator[Batch]:
    """Stream ``Batch``es of ``batch_size`` rows (the last one may be smaller) from a file.

    Skips the first ``skip`` data rows (after any header) and stops after ``limit``
    rows. Reads ``chunk_bytes`` at a time and holds at most about one chunk plus one
    batch of parsed rows. Lines end in ``\\n`` or ``\\r\\n``. The file is opened on the
    first ``next`` and closed when the iterator ends or is closed. Blocks while reading;
    one iterator per thread (the numba kernels release the GIL). A malformed row (wrong field
    count, unparsable number, label other than 0/1, blank line) raises ``DataError`` (a
    ``ValueError``) naming the file, the 1-based line number and the column; with
    ``bad_lines`` it is left out instead, and counted there (``skip`` and ``limit`` count
    it as a row). Nothing else is ever dropped.
    A schema with ``order_by`` raises ``ValueError``: use ``load_click_log``.

    >>> import tempfile, pathlib
    >>> from protos.keys import hash_feature
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "log.csv"
    >>> _ = p.write_text("y,n,c\\n1,3,a\\n0,,\\n")
    >>> b = next(read_click_log(p, ColumnSchema("y", ["n"], ["c"], sep=",", header=True), 8))
    >>> b.labels.tolist(), b.dense[:, 0].tolist(), b.sparse["c"].values[1].item() == hash_feature("", feature_seed("c"))
    ([1.0, 0.0], [1.3862943649291992, 0.0], True)
    """
    if batch_size < 1 or skip < 0 or (limit is not None and limit < 0) or chunk_bytes < 1:
        raise ValueError(f"batch_size={batch_size}, skip={skip}, limit={limit}, chunk_bytes={chunk_bytes}: bad value")
    if schema.order_by is not None:
        raise ValueError(
            f"the schema orders rows by {schema.order_by!r}: use load_click_log, which holds the whole file"
        )
    pending: list[_Rows] = []
    pending_n, features = 0, cast(tuple[str, ...], ())
    for lay, rows in _read_rows(path, schema, skip, limit, chunk_bytes, bad_lines):
        features = lay.features
        pending.append(rows)
        pending_n += len(rows)
        if pending_n >= batch_size:
            whole = _concat(pending)
            full = pending_n - pending_n % batch_size
            for s in range(0, full, batch_size):
                yield _make_batch(_take(whole, s, s + batch_size), features)
            pending, pending_n = [_take(whole, full, pending_n)], pending_n - full
    if pending_n:
        yield _make_batch(_concat(pending), features)


@dataclass(frozen=True)
class ClickLog:
    """A whole click log parsed into memory (``load_click_log``), in row order.

    ``labels`` float32 ``[n]`` of 0/1, ``dense`` float32 ``[n, D]`` (transformed as the
    schema says), ``keys`` int64 ``[F, n]``: one key per row of each of the first ``F`` of
    ``features``; ``bags``: the keys of each of the others (multi-valued features), in order.
    Immutable by convention: slices and batches are views of these arrays.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "u.data"
    >>> _ = p.write_text("1\\t10\\t5\\t300\\n2\\t10\\t1\\t100\\n1\\t11\\t4\\t200\\n")
    >>> log = load_click_log(p, ColumnSchema.movielens())
    >>> len(log), log.labels.tolist(), [b.batch_size for b in log[:2].batches(1)]
    (3, [0.0, 1.0, 1.0], [1, 1])
    """

    labels: npt.NDArray[np.float32]
    dense: npt.NDArray[np.float32]
    keys: I64
    features: tuple[str, ...]
    bags: tuple[JaggedKeys, ...] = ()

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, rows: slice) -> ClickLog:
        """The rows ``rows`` (a slice with step 1), as views."""
        lo, hi, step = rows.indices(len(self))
        if step != 1:
            raise ValueError(f"ClickLog[{rows}]: only contiguous slices")
        bags = tuple(b.rows(lo, hi) for b in self.bags)
        return ClickLog(self.labels[lo:hi], self.dense[lo:hi], self.keys[:, lo:hi], self.features, bags)

    def take(self, order: I64) -> ClickLog:
        """The rows ``order`` (row indices, in that order), as copies."""
        bags = tuple(b.take(order) for b in self.bags)
        return ClickLog(self.labels[order], self.dense[order], self.keys[:, order], self.features, bags)

    def _feature_keys(self) -> Iterator[tuple[str, I64]]:
        """Every feature's keys, all rows together."""
        yield from zip(self.features, [*self.keys, *(b.values for b in self.bags)])

    def frequent_keys(self, min_count: int) -> dict[str, I64]:
        """Per feature, the sorted keys found at least ``min_count`` times (the vocabulary;
        in as many rows, but for a multi-valued feature that holds a value twice in a row)."""
        out: dict[str, I64] = {}
        for name, keys in self._feature_keys():
            values, counts = np.unique(keys, return_counts=True)
            out[name] = values[counts >= min_count]
        return out

    def with_rare_keys(self, min_count: int, counted_in: ClickLog | None = None) -> ClickLog:
        """A copy in which each key found in fewer than ``min_count`` rows of ``counted_in``
        (default: this log) is replaced by its feature's rare key, ``rare_key(feature)``.

        Count on the training rows and apply the result to them and to the evaluation
        rows: the keys the trainer's embeddings read (``worker.rare``, which the trainer
        applies batch by batch, leaving the first-order weights every value).
        """
        counted = self if counted_in is None else counted_in
        if counted.features != self.features:
            raise ValueError(f"features differ: {self.features} vs {counted.features}")
        vocabulary = counted.frequent_keys(min_count)

        def shared(name: str, keys: I64) -> I64:
            return share_rare(keys, vocabulary[name], rare_key(name))

        nkeyed = self.keys.shape[0]
        keys = np.stack([shared(n, k) for n, k in zip(self.features, self.keys)]) if nkeyed else self.keys.copy()
        bags = tuple(b.with_values(shared(n, b.values)) for n, b in zip(self.features[nkeyed:], self.bags))
        return ClickLog(self.labels, self.dense, keys.reshape(self.keys.shape), self.features, bags)

    def batches(self, batch_size: int, *, rank: int = 0, world_size: int = 1, start: int = 0) -> Iterator[Batch]:
        """Batches of ``batch_size`` rows in order (the last may be short); ``rank`` of
        ``world_size`` takes the batches ``start + rank, start + rank + world_size, ...``
        (``start``: the batches before it were trained on already)."""
        if batch_size < 1 or not 0 <= rank < world_size or start < 0:
            raise ValueError(f"batch_size={batch_size}, rank={rank}, world_size={world_size}, start={start}")
        rows = _Rows(self.labels, self.dense, self.keys, None, self.bags)
        for lo in range((start + rank) * batch_size, len(self), batch_size * world_size):
            yield _make_batch(_take(rows, lo, lo + batch_size), self.features)


def load_click_log(
    path: str | os.PathLike[str], schema: ColumnSchema, *, chunk_bytes: int = 1 << 22, bad_lines: BadLines | None = None
) -> ClickLog:
    """Read all of ``path`` into a ``ClickLog`` (sorted by ``schema.order_by``, stably, if set).

    Holds every row in memory (about 4 bytes per dense value and 8 per key); raises
    ``DataError`` as ``read_click_log`` does (or skips into ``bad_lines``), and for a file
    without data rows.
    """
    parts: list[_Rows] = []
    features: tuple[str, ...] = ()
    for lay, rows in _read_rows(path, schema, 0, None, chunk_bytes, bad_lines):
        parts.append(rows)
        features = lay.features
    if not parts or not sum(len(p) for p in parts):
        skipped = f" ({bad_lines})" if bad_lines is not None and bad_lines.count else ""
        raise DataError(f"{os.fspath(path)}: no data rows{skipped}", os.fspath(path))
    rows = _concat(parts)
    log = ClickLog(rows.labels, rows.dense, rows.keys, features, rows.bags)
    return log if rows.order is None else log.take(np.argsort(rows.order, kind="stable"))
