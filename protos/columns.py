"""Predict requests: raw feature columns, their wire form (``protos/infer.proto``), and
building them from Python values.

A ``Column`` holds the raw values of one feature as flat arrays: ``string`` (the values'
bytes back to back in one ``uint8`` array plus an int32 length per value), ``int64``, or
``float64`` (NaN: missing). On the wire each array is one little-endian ``bytes``
field, decoded with ``np.frombuffer`` (no copy, no Python object per value).

Example:
    >>> req = encode_request({"user": "u1"}, [{"item": 3, "price": 2.5}, {"item": 4, "price": float("nan")}])
    >>> n, context, candidates = decode_request(req)
    >>> n, context["user"].type, candidates["item"].values.tolist(), candidates["price"].type
    (2, 'string', [3, 4], 'float64')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from protos import infer_pb2 as pb

__all__ = ["Column", "InvalidRequest", "ValueType", "columns_of", "decode_request", "encode_request", "request_of"]

ValueType = Literal["string", "int64", "float64"]

_WIRE_TYPES: dict[int, ValueType] = {
    pb.VALUE_TYPE_STRING: "string",
    pb.VALUE_TYPE_INT64: "int64",
    pb.VALUE_TYPE_FLOAT64: "float64",
}
_TYPE_CODES = {v: k for k, v in _WIRE_TYPES.items()}
_MASK64 = (1 << 64) - 1


class InvalidRequest(ValueError):
    """A request the predictor refuses (INVALID_ARGUMENT on the wire); the message names the field."""


@dataclass(frozen=True)
class Column:
    """The raw values of one feature (see the module docstring); arrays may be read-only views.

    ``string``: ``values`` uint8 (every value's bytes back to back), ``lengths`` int32
    ``[n]``; ``int64`` and ``float64``: ``values`` ``[n]``, ``lengths`` None.
    """

    type: ValueType
    values: npt.NDArray[Any]
    lengths: npt.NDArray[np.int32] | None = None

    def __len__(self) -> int:
        return int(self.lengths.shape[0] if self.lengths is not None else self.values.shape[0])

    def ranges(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(starts, ends)`` int64 byte ranges of a string column's values in ``values``."""
        if self.lengths is None:
            raise TypeError(f"{self.type} columns have no byte ranges (only strings do)")
        ends = np.cumsum(self.lengths, dtype=np.int64)
        return ends - self.lengths, ends

    @classmethod
    def of(cls, values: Any, field: str = "values") -> Column:
        """A column from Python or numpy values: ``str``/``bytes`` -> string (str as UTF-8),
        integers -> int64 (unsigned 64-bit ids keep their bits), floats (and None, as NaN,
        among numbers) -> float64. One scalar is a column of one value.

        Raises ``TypeError`` naming ``field`` for mixed or other types (bools included).

        >>> Column.of(["ab", b"c"]).lengths.tolist(), Column.of(7).values.tolist(), Column.of([1, None]).type
        ([2, 1], [7], 'float64')
        """
        if isinstance(values, Column):
            return values
        if isinstance(values, (str, bytes, int, float, np.generic)):
            values = [values]
        if isinstance(values, np.ndarray) and values.dtype.kind in "iuf":
            if values.dtype.kind == "f":
                return cls("float64", np.ascontiguousarray(values.reshape(-1), dtype=np.float64))
            return cls("int64", np.ascontiguousarray(values.reshape(-1)).astype(np.uint64, copy=False).view(np.int64))
        items = values.tolist() if isinstance(values, np.ndarray) else list(values)
        kinds = {_kind(v) for v in items}
        if kinds <= {"string"} and items:
            raw = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in items]
            data = np.frombuffer(b"".join(raw), dtype=np.uint8)
            return cls("string", data, np.fromiter(map(len, raw), dtype=np.int32, count=len(raw)))
        if kinds <= {"int"}:
            return cls("int64", np.array([int(v) & _MASK64 for v in items], dtype=np.uint64).view(np.int64))
        if kinds <= {"int", "float", "none"}:
            return cls("float64", np.array([np.nan if v is None else float(v) for v in items], dtype=np.float64))
        raise TypeError(
            f"{field}: values of types {sorted(kinds)}; a column holds only strings/bytes, "
            "only integers, or only numbers (None: missing)"
        )


def _kind(v: Any) -> str:
    if isinstance(v, (str, bytes, bytearray, np.str_, np.bytes_)):
        return "string"
    if isinstance(v, (bool, np.bool_)):
        return "bool"
    if isinstance(v, (int, np.integer)):
        return "int"
    if isinstance(v, (float, np.floating)):
        return "float"
    return "none" if v is None else type(v).__name__


def _to_wire(name: str, column: Column) -> pb.Column:
    msg = pb.Column(name=name, type=_TYPE_CODES[column.type])  # type: ignore[arg-type]
    if column.type == "string":
        assert column.lengths is not None
        msg.values = np.ascontiguousarray(column.values, dtype=np.uint8).tobytes()
        msg.lengths = np.ascontiguousarray(column.lengths, dtype="<i4").tobytes()
    else:
        msg.values = np.ascontiguousarray(column.values, dtype="<i8" if column.type == "int64" else "<f8").tobytes()
    return msg


def columns_of(
    context: Mapping[str, Any] | None, candidates: Sequence[Mapping[str, Any]] | Mapping[str, Any]
) -> tuple[int, dict[str, Column], dict[str, Column]]:
    """``(num_candidates, context, candidates)`` as ``Column``s, from Python values.

    ``context``: one value per feature (or a ``Column`` of one). ``candidates``: either
    rows, one dict per candidate with the same features each, or columns, a dict of
    equally long sequences/arrays (or ``Column``s). Raises ``TypeError`` for values no
    column can hold and ``ValueError`` for rows without the same features or columns of
    different lengths (the predictor checks everything again).
    """
    if isinstance(candidates, Mapping):
        columns = {name: Column.of(v, f"candidates[{name!r}]") for name, v in candidates.items()}
        if not columns:
            raise ValueError("candidates: no columns; pass rows ([{}] for one candidate with context features only)")
        n = len(next(iter(columns.values())))
    else:
        rows = list(candidates)
        n = len(rows)
        names = list(rows[0]) if rows else []
        for i, row in enumerate(rows):
            if set(row) != set(names):
                raise ValueError(
                    f"candidates[{i}]: features {sorted(row)}, expected those of candidates[0]: {sorted(names)}"
                )
        columns = {name: Column.of([row[name] for row in rows], f"candidates[{name!r}]") for name in names}
    for name, c in columns.items():
        if len(c) != n:
            raise ValueError(f"candidates[{name!r}]: {len(c)} values, expected {n} (one per candidate)")
    shared = {name: Column.of(v, f"context[{name!r}]") for name, v in (context or {}).items()}
    return n, shared, columns


def encode_request(
    context: Mapping[str, Any] | None, candidates: Sequence[Mapping[str, Any]] | Mapping[str, Any]
) -> pb.PredictRequest:
    """A ``PredictRequest`` from Python values (see ``columns_of``).

    >>> encode_request({}, {"item": np.arange(3)}).num_candidates
    3
    """
    return request_of(*columns_of(context, candidates))


def request_of(
    num_candidates: int, context: Mapping[str, Column], candidates: Mapping[str, Column]
) -> pb.PredictRequest:
    """A ``PredictRequest`` of ready columns, as given (the predictor checks names, types and counts).

    >>> request_of(2, {}, {"item": Column.of([3, 4])}).candidates[0].values == np.array([3, 4], "<i8").tobytes()
    True
    """
    return pb.PredictRequest(
        num_candidates=num_candidates,
        context=[_to_wire(name, c) for name, c in context.items()],
        candidates=[_to_wire(name, c) for name, c in candidates.items()],
    )


def _from_wire(msg: pb.Column, field: str) -> Column:
    value_type = _WIRE_TYPES.get(msg.type)
    if value_type is None:
        raise InvalidRequest(f"{field}.type: {msg.type}, expected VALUE_TYPE_STRING, _INT64 or _FLOAT64")
    if value_type != "string":
        if msg.lengths:
            raise InvalidRequest(
                f"{field}.lengths: set, but only string columns have lengths (this one is {value_type})"
            )
        if len(msg.values) % 8:
            raise InvalidRequest(f"{field}.values: {len(msg.values)} bytes, not a multiple of 8 ({value_type})")
        return Column(value_type, np.frombuffer(msg.values, dtype="<i8" if value_type == "int64" else "<f8"))
    if len(msg.lengths) % 4:
        raise InvalidRequest(f"{field}.lengths: {len(msg.lengths)} bytes, not a multiple of 4 (int32 per value)")
    lengths = np.frombuffer(msg.lengths, dtype="<i4")
    if lengths.shape[0] and int(lengths.min()) < 0:
        raise InvalidRequest(f"{field}.lengths: a negative length ({int(lengths.min())})")
    total = int(lengths.sum(dtype=np.int64))
    if total != len(msg.values):
        raise InvalidRequest(f"{field}.lengths: add up to {total} bytes, values has {len(msg.values)}")
    return Column("string", np.frombuffer(msg.values, dtype=np.uint8), lengths)


def decode_request(request: pb.PredictRequest) -> tuple[int, dict[str, Column], dict[str, Column]]:
    """``(num_candidates, context, candidates)`` of a wire request, columns by feature name.

    Checks the byte layout of every column and that no feature appears twice; the
    predictor checks names, types and counts against its model. Raises
    ``InvalidRequest`` naming the field. The arrays are read-only views of the request.
    """
    out: tuple[dict[str, Column], dict[str, Column]] = ({}, {})
    for part, columns, target in (("context", request.context, out[0]), ("candidates", request.candidates, out[1])):
        for msg in columns:
            field = f"{part}[{msg.name!r}]"
            if msg.name in out[0] or msg.name in out[1]:
                raise InvalidRequest(f"{field}: feature given twice (each goes in context or candidates, once)")
            target[msg.name] = _from_wire(msg, field)
    return int(request.num_candidates), out[0], out[1]
