"""What a delimited click log's columns are: ``ColumnSchema`` (label, dense, categorical and
multi-valued columns, by name or index) resolved against a file's header or first line,
the feature names and hash seeds it gives (``feature_seed``), and ``DataError`` for a
file that does not read as its schema says. The readers are in ``worker.data``.

Example:
    >>> feature_seed("C1") == feature_seed("C1") != feature_seed("C2")
    True
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import numpy.typing as npt

from protos.hashing import fnv_basis
from protos.keys import hash_feature

__all__ = [
    "BadLines",
    "ColumnNotFound",
    "ColumnSchema",
    "DataError",
    "Layout",
    "SchemaColumns",
    "feature_seed",
    "read_header",
    "resolve_layout",
    "columns_of",
    "schema_columns",
]

_MASK64 = (1 << 64) - 1

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


def feature_seed(feature: str) -> int:
    """Default hash seed of a feature: ``hash_feature(feature, 0)`` as an unsigned int.

    >>> feature_seed("C1") == hash_feature("C1", 0) % 2**64
    True
    """
    return hash_feature(feature, 0) & _MASK64


class DataError(ValueError):
    """A data file that does not read as its schema says. The message names the file and,
    for one line, its 1-based number (``line``; 0 when it is about the file as a whole),
    and ``column``, the column it is about (None: the line or file as a whole)."""

    def __init__(self, message: str, path: str, line: int = 0, column: str | None = None) -> None:
        super().__init__(message)
        self.path, self.line, self.column = path, line, column


class ColumnNotFound(ValueError):
    """A schema's ``column`` that a file does not have (not in its header or names, or an
    index past its fields)."""

    def __init__(self, message: str, column: str | int) -> None:
        super().__init__(message)
        self.column = column


@dataclass
class BadLines:
    """The malformed lines a reader skipped instead of raising ``DataError``: how many, and
    the first ``KEEP`` line numbers (1-based). A line is counted once however often it is
    read (every epoch reads it again). Not thread-safe: one per reader thread.

    >>> bad = BadLines()
    >>> bad.add(np.array([51, 7])); bad.add(np.array([7]))
    >>> bad.count, bad.first, str(bad)
    (2, [7, 51], '2 malformed lines skipped (first at lines 7, 51)')
    """

    KEEP = 5
    count: int = 0
    first: list[int] = field(default_factory=list)
    _seen: I64 = field(default_factory=lambda: np.empty(0, np.int64), repr=False)

    def add(self, line_numbers: I64) -> None:
        new = np.setdiff1d(np.asarray(line_numbers, np.int64), self._seen)
        if new.size:
            self._seen = np.union1d(self._seen, new)
            self.count += int(new.size)
            self.first = self._seen[: self.KEEP].tolist()

    def __str__(self) -> str:
        lines = ", ".join(map(str, self.first)) + (", ..." if self.count > len(self.first) else "")
        return f"{self.count} malformed line{'s' if self.count != 1 else ''} skipped (first at line{'s' if self.count != 1 else ''} {lines})"


@dataclass(frozen=True)
class ColumnSchema:
    """Layout of a delimited click log: which columns are the label, dense, categorical and multi-valued.

    Columns are named (resolved against the header, or ``names`` for a file without
    one) or 0-based indices. A categorical feature is named after its column; an
    index-addressed column in a file with neither header nor ``names`` is ``C{j+1}``
    for the j-th categorical. ``sep`` is one ASCII character; fields are not quoted.
    ``seeds`` overrides ``feature_seed(name)`` per feature (unknown names raise at read
    time). Dense values: empty -> 0, then ``log1p(max(x, 0))`` when ``log_transform``.
    ``multi_valued`` maps a column to its separator (one ASCII character, not ``sep``): its
    field holds any number of values, every one a key of the feature named after the column
    (``M{j+1}`` when index-addressed without names), pooled like any jagged feature (see
    ``worker.multivalued`` for how a field splits).

    Derived columns:

    * ``label_threshold``: None means labels must be 0 or 1; a number t makes the label
      column any number, positive when >= t (MovieLens ratings >= 4).
    * ``dense_buckets``: each dense column is also the categorical feature
      ``{column}_bucket`` (``I{j+1}_bucket`` without names), one key per log-scale
      bucket of the raw value: ``floor(v)`` for v <= 2, ``3 + floor(ln(v)**2)`` above,
      and a key of its own for an empty field. Counts spanning orders of magnitude
      (Criteo's I1..I13) then get a learned row per bucket, and "missing" is not 0.
    * ``order_by``: a numeric column (a timestamp) the rows are sorted by, stably,
      before use; only ``load_click_log`` can do that (it holds the whole file).

    Raises ``ValueError`` for a bad ``sep``; the readers raise it for an unknown column
    or one used twice.

    >>> s = ColumnSchema.criteo()
    >>> s.label, s.dense[0], s.categorical[-1], len(s.names or ()), s.dense_buckets
    ('label', 'I1', 'C26', 40, True)
    """

    label: str | int
    dense: Sequence[str | int]
    categorical: Sequence[str | int]
    sep: str = "\t"
    header: bool = False
    log_transform: bool = True
    seeds: Mapping[str, int] | None = None
    names: Sequence[str] | None = None
    label_threshold: float | None = None
    dense_buckets: bool = False
    order_by: str | int | None = None
    multi_valued: Mapping[str | int, str] | None = None

    def __post_init__(self) -> None:
        if len(self.sep) != 1 or not self.sep.isascii():
            raise ValueError(f"sep={self.sep!r}: must be one ASCII character")
        for col, sep in (self.multi_valued or {}).items():
            if len(sep) != 1 or not sep.isascii() or sep in "\r\n" or sep == self.sep:
                raise ValueError(
                    f"multi_valued[{col!r}]: separator {sep!r} must be one ASCII character other than "
                    f"sep={self.sep!r} and a line break"
                )
        if self.label_threshold is not None and not math.isfinite(self.label_threshold):
            raise ValueError(f"label_threshold={self.label_threshold}: must be finite")
        for name, value in (("dense", self.dense), ("categorical", self.categorical), ("names", self.names)):
            if value is not None:
                object.__setattr__(self, name, tuple(value))

    @classmethod
    def criteo(cls, *, dense_buckets: bool = True) -> ColumnSchema:
        """Criteo Kaggle/1TB: ``label, I1..I13, C1..C26``, tab-separated, no header; the
        counts I1..I13 are dense (log1p) and, with ``dense_buckets``, also bucketed features."""
        dense, cat = [f"I{i}" for i in range(1, 14)], [f"C{i}" for i in range(1, 27)]
        return cls("label", dense, cat, sep="\t", names=["label", *dense, *cat], dense_buckets=dense_buckets)

    @classmethod
    def avazu(cls) -> ColumnSchema:
        """Avazu CTR: csv with header, label ``click``, every other column categorical
        except ``id`` (unique per row) and ``hour`` (``YYMMDDHH``: as a raw id every hour
        is new, so a held-out hour never hits a trained row)."""
        cat = [
            "C1",
            "banner_pos",
            "site_id",
            "site_domain",
            "site_category",
            "app_id",
            "app_domain",
            "app_category",
            "device_id",
            "device_ip",
            "device_model",
            "device_type",
            "device_conn_type",
            *(f"C{i}" for i in range(14, 22)),
        ]
        return cls("click", (), cat, sep=",", header=True, log_transform=False)

    @classmethod
    def movielens(cls) -> ColumnSchema:
        """MovieLens ``u.data``: ``user_id, item_id, rating, timestamp``, tab-separated, no
        header; positive when rating >= 4; rows in time order (``load_click_log`` only)."""
        return cls(
            "rating",
            (),
            ["user_id", "item_id"],
            sep="\t",
            names=["user_id", "item_id", "rating", "timestamp"],
            log_transform=False,
            label_threshold=4.0,
            order_by="timestamp",
        )


@dataclass(frozen=True)
class Layout:
    """A schema resolved against one file: column indices, feature names and hash seeds."""

    nfields: int
    names: tuple[str, ...]  # every column, for messages
    label: I64
    dense: I64
    cat: I64
    order: I64  # the order_by column, or empty
    features: tuple[str, ...]  # categorical features, then bucket features
    bases: U64  # FNV bases of the categorical features
    bucket_seeds: tuple[int, ...]  # hash seeds of the bucket features
    dense_names: tuple[str, ...]  # the dense columns' names (I{j+1} without names)
    seeds: tuple[int, ...]  # hash seed of every feature
    multi: I64  # the multi-valued columns
    multi_seps: tuple[int, ...]  # their separator bytes
    multi_bases: tuple[int, ...]  # their FNV bases

    @property
    def key_rows(self) -> int:
        """Features with one key per row (categorical, then bucket features), before the multi-valued ones."""
        return len(self.features) - int(self.multi.shape[0])


def resolve_layout(schema: ColumnSchema, header: list[str] | None, first_line: bytes) -> Layout:
    """``schema`` against a file's ``header`` (or ``names``, or the field count of ``first_line``);
    ``ValueError`` naming a column that is missing, out of range or used twice."""
    names = header if header is not None else list(schema.names) if schema.names is not None else None
    nfields = len(names) if names is not None else first_line.rstrip(b"\r\n").count(schema.sep.encode()) + 1

    def index(col: str | int) -> int:
        if isinstance(col, str):
            if names is None or col not in names:
                shown = repr(names)[:200] + ("..." if len(repr(names)) > 200 else "") if names else ""
                raise ColumnNotFound(f"column {col!r} not in {shown or 'a file without header or names'}", col)
            return names.index(col)
        if not 0 <= col < nfields:
            raise ColumnNotFound(f"column index {col} out of range: rows have {nfields} fields", col)
        return col

    dense, cat = [index(c) for c in schema.dense], [index(c) for c in schema.categorical]
    order = [] if schema.order_by is None else [index(schema.order_by)]
    multi_seps = dict(schema.multi_valued or {})
    multi = [index(c) for c in multi_seps]
    cols = [index(schema.label), *dense, *cat, *order, *multi]
    if len(set(cols)) != len(cols):
        raise ValueError(f"a column is used twice: label, dense, categorical, order_by, multi_valued = {cols}")
    cat_names = [names[i] if names is not None else f"C{j + 1}" for j, i in enumerate(cat)]
    dense_names = [names[i] if names is not None else f"I{j + 1}" for j, i in enumerate(dense)]
    multi_names = [names[i] if names is not None else f"M{j + 1}" for j, i in enumerate(multi)]
    buckets = [f"{d}_bucket" for d in dense_names]
    features = tuple(cat_names + (buckets if schema.dense_buckets else []) + multi_names)
    if len(set(features)) != len(features):
        raise ValueError(f"two categorical columns share a feature name: {features}")
    seeds = dict(schema.seeds or {})
    if unknown := set(seeds) - set(features):
        raise ValueError(f"seeds for unknown features {sorted(unknown)}; features are {list(features)}")
    key_seeds = [seeds.get(f, feature_seed(f)) & _MASK64 for f in features]
    nkeyed = len(features) - len(multi)
    return Layout(
        nfields,
        tuple(names if names is not None else (f"column {i}" for i in range(nfields))),
        np.array(cols[:1], np.int64),
        np.array(dense, np.int64),
        np.array(cat, np.int64),
        np.array(order, np.int64),
        features,
        np.array([fnv_basis(k) for k in key_seeds[: len(cat)]], np.uint64),
        tuple(key_seeds[len(cat) : nkeyed]),
        tuple(dense_names),
        tuple(key_seeds),
        np.array(multi, np.int64),
        tuple(ord(s) for s in multi_seps.values()),
        tuple(fnv_basis(k) for k in key_seeds[nkeyed:]),
    )


def read_header(f: BinaryIO, schema: ColumnSchema, where: str) -> list[str] | None:
    """The header line's column names when ``schema`` has a header (read from ``f``), else None."""
    if not schema.header:
        return None
    first = f.readline()
    if not first:
        raise DataError(f"{where}: empty file, expected a header line", where)
    return first.decode("utf-8-sig").rstrip("\r\n").split(schema.sep)


@dataclass(frozen=True)
class SchemaColumns:
    """The columns ``schema`` reads from a file, named as the readers name them.

    ``categorical``: the categorical features (named after their columns); ``dense``: the
    dense columns in ``Batch.dense`` order; ``buckets``: their bucket features (empty
    without ``dense_buckets``); ``multi``: each multi-valued feature's separator;
    ``seeds``: the hash seed of every categorical, bucket and multi-valued feature.
    """

    categorical: tuple[str, ...]
    dense: tuple[str, ...]
    buckets: tuple[str, ...]
    seeds: Mapping[str, int]
    multi: Mapping[str, str] = field(default_factory=dict)


def schema_columns(path: str | os.PathLike[str], schema: ColumnSchema) -> SchemaColumns:
    """The named columns of ``path`` under ``schema`` (reads its header or first line).

    Raises ``ValueError`` as the readers do for an unknown column or one used twice.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "log.csv"
    >>> _ = p.write_text("y,n,c\\n1,3,a\\n")
    >>> cols = schema_columns(p, ColumnSchema("y", ["n"], ["c"], sep=",", header=True, dense_buckets=True))
    >>> cols.categorical, cols.dense, cols.buckets, cols.seeds["c"] == feature_seed("c")
    (('c',), ('n',), ('n_bucket',), True)
    """
    with open(path, "rb") as f:
        header = read_header(f, schema, os.fspath(path))
        return columns_of(schema, header, f.readline())


def columns_of(schema: ColumnSchema, header: Sequence[str] | None, first_line: bytes) -> SchemaColumns:
    """``schema_columns`` of rows with this ``header`` (None: none) and ``first_line``."""
    lay = resolve_layout(schema, None if header is None else list(header), first_line)
    ncat, nkeyed = lay.cat.shape[0], lay.key_rows
    multi = {name: chr(sep) for name, sep in zip(lay.features[nkeyed:], lay.multi_seps)}
    return SchemaColumns(
        lay.features[:ncat], lay.dense_names, lay.features[ncat:nkeyed], dict(zip(lay.features, lay.seeds)), multi
    )
