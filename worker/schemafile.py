"""A click log's layout written in a TOML file: ``--schema my.toml`` wherever ``--schema criteo`` works.

A user with a log of their own describes it once, with no Python::

    delimiter = ","          # one character (default ","; "\\t" for tabs)
    header = true            # the first line names the columns (default true)
    label = "clicked"        # 0 or 1 ...
    # label_threshold = 4    # ... or any number, positive when >= this
    # log_transform = true   # numeric columns feed log1p(max(x, 0)) (default), or x as it is
    # names = [...]          # with header = false: every column's name, in file order

    [columns]
    price = "numeric"
    user = "categorical"
    tags = { kind = "multi-valued", separator = "|" }

Each ``[columns]`` entry is a column of the file, by name, and its kind: ``categorical`` (one
key per row, hashed from the field's text), ``numeric`` (a dense input: a number, empty is 0)
or ``multi-valued`` (the field holds values split at ``separator``, each a key of the
column's feature; see ``worker.multivalued``). A table ``{ kind = "categorical" }`` works
for every kind. Columns not named are not read. ``load_schema_file`` turns the file into a
``ColumnSchema`` and refuses a mistake with one ``SchemaFileError`` line naming the key,
or the column, and what it may be.

Example:
    >>> f = parse_schema_file('label = "y"\\n[columns]\\nn = "numeric"\\nt = { kind = "multi-valued", separator = "|" }\\n', "my.toml")
    >>> f.schema.label, f.schema.dense, f.schema.multi_valued, f.describe("t")
    ('y', ('n',), {'t': '|'}, "t is multi-valued, separated by '|'")
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from worker.schema import ColumnSchema

__all__ = ["COLUMN_KEYS", "KINDS", "KEYS", "SchemaFile", "SchemaFileError", "load_schema_file", "parse_schema_file"]

KEYS = ("delimiter", "header", "names", "label", "label_threshold", "log_transform", "columns")
COLUMN_KEYS = ("kind", "separator")
KINDS = ("categorical", "numeric", "multi-valued")


class SchemaFileError(ValueError):
    """A schema file that cannot be used; the message is one line naming the file and the key or column."""


@dataclass(frozen=True)
class SchemaFile:
    """A schema file read (``load_schema_file``): its ``path`` and ``text``, the
    ``ColumnSchema`` it describes, and each column's kind (the label's is ``label``)."""

    path: str
    text: str
    schema: ColumnSchema
    kinds: Mapping[str, str]

    def describe(self, column: str) -> str:
        """What the file says ``column`` is, for messages ("price is numeric")."""
        kind = self.kinds.get(column)
        if kind is None:
            return f"{column} is not in it"
        if kind == "label":
            t = self.schema.label_threshold
            return f"{column} is the label: " + ("0 or 1" if t is None else f"a number, positive when >= {t:g}")
        if kind == "multi-valued":
            return f"{column} is multi-valued, separated by {(self.schema.multi_valued or {})[column]!r}"
        return f"{column} is {kind}"


def load_schema_file(path: str | os.PathLike[str]) -> SchemaFile:
    """Read the schema file ``path`` (see the module docstring). Raises ``SchemaFileError``
    (a ``ValueError``), one line naming the file and what is wrong, for a file that cannot
    be read, is not TOML, or does not describe a layout."""
    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SchemaFileError(f"schema {where}: cannot read it ({exc})") from None
    return parse_schema_file(text, where)


def parse_schema_file(text: str, where: str) -> SchemaFile:
    """``load_schema_file`` of a file's ``text`` (``where`` names it in messages)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SchemaFileError(f"schema {where}: not TOML: {exc}") from None

    def wrong(message: str) -> SchemaFileError:
        return SchemaFileError(f"schema {where}: {message}")

    for key in doc:
        if key not in KEYS:
            raise wrong(f"unknown key {key!r}; valid keys: {', '.join(KEYS)}")
    delimiter = _typed(doc, "delimiter", str, "a string", ",", wrong)
    if len(delimiter) != 1 or not delimiter.isascii() or delimiter in "\r\n":
        raise wrong(f"delimiter = {delimiter!r}: must be one ASCII character, not a line break")
    header = _typed(doc, "header", bool, "true or false", True, wrong)
    names = doc.get("names")
    if names is not None:
        if header:
            raise wrong("names: only for a file without a header line (header = false); a header names the columns")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise wrong("names: must be a list of the column names, in file order")
    elif not header:
        raise wrong("header = false needs names = [...]: every column's name, in file order")
    label = _typed(doc, "label", str, "the label column's name", None, wrong)
    threshold = doc.get("label_threshold")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)):
        raise wrong(f"label_threshold = {threshold!r}: must be a number")
    log_transform = _typed(doc, "log_transform", bool, "true or false", True, wrong)
    columns = doc.get("columns")
    if not isinstance(columns, dict) or not columns:
        raise wrong('columns: missing; add a [columns] table, one line per column: name = "categorical"')
    if label in columns:
        raise wrong(f"columns.{label}: {label!r} is the label, and a column is read one way only")
    kinds: dict[str, str] = {label: "label"}
    multi: dict[str | int, str] = {}
    for name, spec in columns.items():
        kind, separator = _column(name, spec, wrong)
        if kind == "multi-valued":
            if len(separator) != 1 or not separator.isascii() or separator in "\r\n" or separator == delimiter:
                raise wrong(
                    f"columns.{name}: separator = {separator!r}: must be one ASCII character other than the "
                    f"delimiter {delimiter!r}"
                )
            multi[name] = separator
        kinds[name] = kind
    if all(k in ("label", "numeric") for k in kinds.values()):
        raise wrong("columns: no categorical or multi-valued column; a model needs at least one feature")
    schema = ColumnSchema(
        label,
        [c for c, k in kinds.items() if k == "numeric"],
        [c for c, k in kinds.items() if k == "categorical"],
        sep=delimiter,
        header=header,
        log_transform=log_transform,
        names=names,
        label_threshold=None if threshold is None else float(threshold),
        multi_valued=multi or None,
    )
    return SchemaFile(where, text, schema, kinds)


_Wrong = Callable[[str], SchemaFileError]


def _typed(doc: Mapping[str, Any], key: str, kind: type, what: str, default: Any, wrong: _Wrong) -> Any:
    """``doc[key]`` if it is a ``kind`` (``default`` when absent; None: required)."""
    if key not in doc:
        if default is None:
            raise wrong(f"{key}: missing; it must be {what}")
        return default
    value = doc[key]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise wrong(f"{key} = {value!r}: must be {what}")
    return value


def _column(name: str, spec: Any, wrong: _Wrong) -> tuple[str, str]:
    """A ``[columns]`` entry's kind and separator ("" unless multi-valued)."""
    where = f"columns.{name}"
    if isinstance(spec, dict):
        for key in spec:
            if key not in COLUMN_KEYS:
                raise wrong(f"{where}: unknown key {key!r}; valid keys: {', '.join(COLUMN_KEYS)}")
        kind, separator = spec.get("kind"), spec.get("separator")
    else:
        kind, separator = spec, None
    if kind not in KINDS:
        shown = "missing" if kind is None else repr(kind)
        raise wrong(f"{where}: kind {shown}; valid kinds: {', '.join(KINDS)}")
    if kind == "multi-valued":
        if not isinstance(separator, str):
            raise wrong(
                f'{where}: a multi-valued column needs its separator: {{ kind = "multi-valued", separator = "|" }}'
            )
        return kind, separator
    if separator is not None:
        raise wrong(f"{where}: separator is only for a multi-valued column, and this one is {kind}")
    return kind, ""
