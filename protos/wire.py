"""Keys and rows <-> raw little-endian ``bytes`` fields, without copies where possible.

Keys are int64, rows are ``[n, dim]`` arrays travelling as float32 (default), float16
or bfloat16. Decoding float32 and keys is zero-copy: the returned arrays are read-only
views of the message's ``bytes`` and keep it alive. Every decode validates lengths and
raises ``WireFormatError`` naming the field, e.g.
``entries[0].keys: 12 bytes is not a multiple of 8``.

``as_keys`` is the one check of keys given as arrays, on both ends (the client before
it sends them, the shard's tables and key index before they use them): a 1-D array of
integers, or ``InvalidKeys`` naming the field.

Example:
    >>> keys = decode_keys(encode_keys(np.array([7, -1])), "keys")
    >>> keys.tolist()
    [7, -1]
    >>> decode_rows(encode_rows(np.ones((2, 3), np.float32), FLOAT16), 2, 3, FLOAT16, "rows").sum()
    np.float32(6.0)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos.buffers import alloc_bytes, tune_malloc
from protos.pbwire import (
    MAX_DEPTH,
    WireFormatError,
    check_range,
    fields,
    int32,
    int_field,
    len_field,
    read_length,
    read_varint,
    str_field,
    submessage_depth,
    text,
    uint32,
    varint,
)

__all__ = [
    "BFLOAT16",
    "FLOAT16",
    "FLOAT32",
    "InvalidKeys",
    "LookupResponseWriter",
    "LookupResultView",
    "PushEntryParts",
    "PushEntryView",
    "PushRequestView",
    "MAP_EPOCH_METADATA",
    "MOVING",
    "WRONG_SHARD_METADATA",
    "WireFormatError",
    "alloc_bytes",
    "as_keys",
    "decode_keys",
    "decode_lookup_reply",
    "decode_lookup_response",
    "decode_push_request",
    "bfloat16_rows_into",
    "decode_rows",
    "encode_lookup_request",
    "dtype_itemsize",
    "dtype_name",
    "encode_keys",
    "encode_push_request",
    "encode_rows",
    "rows_to_dtype",
    "tune_malloc",
]

FLOAT32: int = pb.FLOAT32
FLOAT16: int = pb.FLOAT16
BFLOAT16: int = pb.BFLOAT16

WRONG_SHARD_METADATA = "ps-wrong-shard"
"""Trailing metadata key of a FAILED_PRECONDITION refusing keys the shard does not own;
its value is the index of the shard that owns the key the message names, so a client
tells this refusal from the others without parsing the message."""

MAP_EPOCH_METADATA = "ps-map-epoch"
"""Trailing metadata key of such a refusal: the epoch of the cluster map the shard routes
by; a client at an older epoch fetches that map (``GetMap``) and routes again."""

MOVING = ("ps-moving", "1")
"""Trailing metadata of an UNAVAILABLE refusing a request because some of its keys are being
handed over in a live reshard (a write to keys whose old owner is frozen, or a request routed
by the new map before its new owner switched). Nothing of the request was applied, so a
client sends it again shortly, and the refusal uses up none of its attempts: a ``ps-admin``
call (one attempt) waits out the hand-over as a trainer does."""

_ITEMSIZE: dict[int, int] = {pb.DTYPE_UNSPECIFIED: 4, pb.FLOAT32: 4, pb.FLOAT16: 2, pb.BFLOAT16: 2}
_F32 = np.dtype("<f4")
_F16 = np.dtype("<f2")
_U16 = np.dtype("<u2")
_I64 = np.dtype("<i8")

PushEntryParts = (
    tuple[str, npt.NDArray[np.int64], npt.NDArray[np.float32], int]
    | tuple[str, npt.NDArray[np.int64], npt.NDArray[np.float32], int, int]
)
"""One entry of ``encode_push_request``: ``(table, keys, grads, dtype)``, or with the entry's ``seq`` last."""


class InvalidKeys(WireFormatError, TypeError):
    """Keys that are not a 1-D array of integers, or key bytes whose length is not a
    multiple of 8; the message names the field. A ``ValueError`` (and a ``TypeError``,
    what a wrong dtype raised before there was one check of keys)."""


def dtype_itemsize(dtype: int, field: str = "dtype") -> int:
    """Bytes per value of a wire ``DType``; raises ``WireFormatError`` for unknown values."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise WireFormatError(f"{field}: unknown dtype {dtype}, expected one of FLOAT32, FLOAT16, BFLOAT16") from None


def dtype_name(dtype: int) -> str:
    """``"FLOAT32"`` etc. for a wire ``DType`` (unspecified reads as FLOAT32)."""
    return pb.DType.Name(dtype or pb.FLOAT32)


def as_keys(keys: npt.ArrayLike, field: str = "keys") -> npt.NDArray[np.int64]:
    """``keys`` as a 1-D C-contiguous int64 array: ``keys`` itself when it already is one
    (no copy), else a converted copy. Any integer dtype is accepted (uint64 keeps its
    bits: keys are unsigned ids); so is an empty array of any dtype (``[]`` is float64).

    Raises ``InvalidKeys`` naming ``field`` for an array that is not 1-D, or not of
    integers (a float key would be truncated onto another key's row). Thread-safe;
    never modifies ``keys``.

    Example:
        >>> as_keys(np.array([3, 1], dtype=np.uint8)).tolist()
        [3, 1]
        >>> as_keys([1.5], "entries[0].keys")
        Traceback (most recent call last):
        ...
        protos.wire.InvalidKeys: entries[0].keys dtype float64, expected integers
    """
    if type(keys) is np.ndarray and keys.dtype == _I64 and keys.ndim == 1 and keys.flags.c_contiguous:
        return keys  # the common case, on every request: no conversion, no copy
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise InvalidKeys(f"{field} shape {arr.shape}, expected 1-D")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidKeys(f"{field} dtype {arr.dtype}, expected integers")
    return np.ascontiguousarray(arr, dtype=_I64)


def encode_keys(keys: npt.ArrayLike) -> bytes:
    """Little-endian int64 bytes of a 1-D integer array (one copy); ``InvalidKeys`` as ``as_keys``."""
    return as_keys(keys).tobytes()


def decode_keys(buf: bytes | memoryview, field: str) -> npt.NDArray[np.int64]:
    """Read-only int64 view of ``buf``; raises ``InvalidKeys`` naming ``field``."""
    if len(buf) % 8:
        raise InvalidKeys(f"{field}: {len(buf)} bytes is not a multiple of 8 (int64 keys)")
    return np.frombuffer(buf, dtype=_I64)


def _float32_to_bfloat16(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    # Round to nearest even on the upper 16 bits; NaN stays NaN (quiet bit forced).
    from protos import rowkernels  # numba: loaded with the first 16-bit row

    x = np.ascontiguousarray(rows, dtype=_F32)
    out = np.empty(x.shape, _U16)
    rowkernels.bfloat16_nearest(x.reshape(-1).view(np.uint32), out.reshape(-1))
    return out


def rows_to_dtype(rows: npt.NDArray[np.float32], dtype: int) -> npt.NDArray[np.generic]:
    """``rows`` converted to the numpy array type that carries wire ``dtype`` (uint16 for bfloat16)."""
    dtype_itemsize(dtype)
    if dtype in (pb.FLOAT32, pb.DTYPE_UNSPECIFIED):
        return np.asarray(rows, dtype=_F32)
    if dtype == pb.FLOAT16:
        return np.asarray(rows, dtype=_F16)
    return _float32_to_bfloat16(np.asarray(rows, dtype=_F32))


def encode_rows(rows: npt.ArrayLike, dtype: int = FLOAT32) -> bytes:
    """Bytes of a ``[n, dim]`` float array in wire ``dtype`` (one copy, plus a conversion for 16-bit types)."""
    arr = np.asarray(rows)
    if arr.ndim != 2:
        raise ValueError(f"rows: shape {arr.shape}, expected [n, dim]")
    dtype_itemsize(dtype)
    if dtype in (pb.FLOAT32, pb.DTYPE_UNSPECIFIED):
        return np.ascontiguousarray(arr, dtype=_F32).tobytes()
    if dtype == pb.FLOAT16:
        return np.ascontiguousarray(arr, dtype=_F16).tobytes()
    return _float32_to_bfloat16(arr.astype(_F32, copy=False)).tobytes()


def bfloat16_rows_into(buf: bytes | memoryview, out: npt.NDArray[np.float32], field: str) -> None:
    """Widen the bfloat16 rows in ``buf`` into ``out`` (C-contiguous float32 ``[n, dim]``)
    in one pass; ``WireFormatError`` naming ``field`` when the length does not match."""
    if len(buf) != out.size * 2:
        raise WireFormatError(
            f"{field}: {len(buf)} bytes, expected {out.size * 2} ({list(out.shape)} x 2 bytes BFLOAT16)"
        )
    bits = np.frombuffer(buf, dtype=_U16)
    if out.flags.c_contiguous:
        from protos import rowkernels  # numba: loaded with the first 16-bit row

        rowkernels.widen_bfloat16(bits, out.reshape(-1).view(np.uint32))
    else:  # reshape would copy: the rows would land in the copy
        np.left_shift(bits.reshape(out.shape), 16, out=out.view(np.uint32), dtype=np.uint32)


def decode_rows(buf: bytes | memoryview, n: int, dim: int, dtype: int, field: str) -> npt.NDArray[np.float32]:
    """``[n, dim]`` float32 rows from ``buf`` in wire ``dtype``.

    float32 is a read-only zero-copy view; 16-bit types are converted into a new array.
    Raises ``WireFormatError`` naming ``field`` when the length does not match.
    """
    size = dtype_itemsize(dtype, f"{field} dtype")
    expected = n * dim * size
    if len(buf) != expected:
        raise WireFormatError(
            f"{field}: {len(buf)} bytes, expected {expected} ({n} keys x dim {dim} x {size} bytes {dtype_name(dtype)})"
        )
    if dtype in (pb.FLOAT32, pb.DTYPE_UNSPECIFIED):
        return np.frombuffer(buf, dtype=_F32).reshape(n, dim)
    if dtype == pb.FLOAT16:
        return np.frombuffer(buf, dtype=_F16).astype(np.float32).reshape(n, dim)
    out = np.empty((n, dim), np.float32)
    bfloat16_rows_into(buf, out, field)
    return out


# --- Hand-rolled codecs for the two messages that carry rows -------------------------
#
# LookupResponse and PushRequest carry megabytes of rows. Going through protobuf
# objects costs two to three extra copies of that payload (build the message, read
# the field back, serialize), which is as much time as the transport itself. These
# functions read and write exactly the protobuf encoding of those messages (fields
# in number order, zero values omitted, as protobuf serializes them) so that rows go
# straight between numpy arrays and the gRPC buffer. Any protobuf implementation
# reads what they write, and they accept exactly the inputs protobuf (upb) accepts:
# any field order, unknown fields of every wire type and groups skipped, field
# numbers in [1, 2**29 - 1], tags of at most 5 bytes, varints of at most 10, 100
# levels of nesting, integers truncated to their field's width.
# tests/unit/test_wire.py checks both directions against protobuf, and
# tests/unit/test_wire_differential.py fuzzes the decoders against it.


@dataclass(frozen=True)
class LookupResultView:
    """One decoded ``LookupResult``; ``rows`` is a read-only view into the message bytes."""

    table: str
    rows: memoryview
    dtype: int
    dim: int


class LookupResponseWriter:
    """Builds a ``LookupResponse`` in one buffer that the rows are gathered into.

    Give it, per result, ``(table, num_keys, dim, dtype)``; fill ``rows(i)`` (a writable
    ``[num_keys, dim]`` array of the wire dtype) for every result, then send
    ``finish()``. Not thread-safe; one writer per response.

    Example:
        >>> w = LookupResponseWriter([("t", 2, 3, FLOAT32)])
        >>> w.rows(0)[:] = 1.0
        >>> pb.LookupResponse.FromString(w.finish()).results[0].dim
        3
    """

    def __init__(self, results: Sequence[tuple[str, int, int, int]], publication: str = "") -> None:
        """``publication``: ``LookupResponse.publication``, written after the results."""
        framed: list[tuple[bytes, int, bytes]] = []
        trailer = str_field(2, publication) if publication else b""
        total = len(trailer)
        for table, n, dim, dtype in results:
            name, itemsize, tail = _result_frame(table, dim, dtype)
            size = n * dim * itemsize
            head = name + (_ROWS_TAG + varint(size) if size else b"")
            body = len(head) + size + len(tail)
            head = _RESULT_TAG + varint(body) + head
            framed.append((head, size, tail))
            total += len(head) + size + len(tail)
        self._data, buf = alloc_bytes(total)
        raw = buf.data  # the frames are written through a memoryview: cheaper than array slices
        self._rows: list[npt.NDArray[np.uint8]] = []
        self._shapes: list[tuple[int, int, int]] = []
        pos = 0
        for (head, size, tail), (_, n, dim, dtype) in zip(framed, results):
            raw[pos : pos + len(head)] = head
            pos += len(head)
            self._rows.append(buf[pos : pos + size])
            self._shapes.append((n, dim, dtype))
            pos += size
            raw[pos : pos + len(tail)] = tail
            pos += len(tail)
        raw[pos : pos + len(trailer)] = trailer

    def rows(self, i: int) -> npt.NDArray[np.generic]:
        """Writable ``[num_keys, dim]`` array for result ``i`` in its wire dtype (uint16 for bfloat16)."""
        n, dim, dtype = self._shapes[i]
        np_dtype: np.dtype[np.generic] = _F16 if dtype == pb.FLOAT16 else _U16 if dtype == pb.BFLOAT16 else _F32
        out: npt.NDArray[np.generic] = self._rows[i].view(np_dtype).reshape(n, dim)
        return out

    def finish(self) -> bytes:
        """The encoded message; the writer must not be used afterwards."""
        self._rows.clear()
        return self._data


def encode_lookup_request(
    entries: Sequence[tuple[str, npt.NDArray[np.int64]]],
    dtype: int,
    num_shards: int,
    shard: int | None = None,
    *,
    epoch: int = 0,
) -> bytes:
    """``LookupRequest`` bytes for ``(table, keys)`` entries (int64 keys), rows asked in ``dtype``.

    What protobuf writes for the same message, without building one: a lookup of a few
    thousand keys spent as long building and serializing protobuf objects as on its keys.
    Raises ``ValueError`` for an integer outside its field's range (as protobuf does),
    ``WireFormatError`` for an unknown ``dtype``.
    """
    check_range("num_shards", num_shards, 32)
    dtype_itemsize(dtype)
    tail = int_field(3, dtype)
    pieces: list[bytes] = []
    for table, keys in entries:
        raw = np.ascontiguousarray(keys, dtype=_I64).tobytes()
        head = _table_field(table) + (len_field(2, len(raw)) if raw else b"")
        pieces += [len_field(1, len(head) + len(raw) + len(tail)) + head, raw, tail]
    pieces.append(int_field(2, num_shards))
    if shard is not None:  # explicit presence: written even when 0
        check_range("shard", shard, 32)
        pieces.append(varint(3 << 3) + varint(shard))
    check_range("epoch", epoch, 64)
    pieces.append(int_field(4, epoch))
    return b"".join(pieces)


_RESULT_TAG = varint(1 << 3 | 2)  # LookupResponse.results
_ROWS_TAG = varint(2 << 3 | 2)  # LookupResult.rows


@functools.lru_cache(maxsize=1024)
def _result_frame(table: str, dim: int, dtype: int) -> tuple[bytes, int, bytes]:
    """``(table field, itemsize, dtype and dim fields)`` of a ``LookupResult``: a shard
    answers the same few tables on every call. Raises for a ``dim`` or ``dtype`` out of range."""
    check_range("dim", dim, 32)
    return str_field(1, table), dtype_itemsize(dtype), int_field(3, dtype) + int_field(4, dim)


@functools.lru_cache(maxsize=1024)
def _table_field(table: str) -> bytes:
    """Field 1 (``table``) of an entry: a client names the same few tables on every call."""
    return str_field(1, table)


def decode_lookup_response(data: bytes) -> list[LookupResultView]:
    """Parse ``LookupResponse`` bytes without copying the rows.

    Accepts exactly the encodings protobuf accepts (any field order, unknown fields and
    groups skipped, the last of a repeated scalar winning, integers truncated to the
    field's width); raises ``WireFormatError`` where protobuf raises ``DecodeError``.
    """
    return decode_lookup_reply(data)[0]


def decode_lookup_reply(data: bytes) -> tuple[list[LookupResultView], str]:
    """``decode_lookup_response`` and the response's ``publication`` ("" when unset)."""
    try:
        fast = _decode_lookup_as_written(data)
    except WireFormatError:
        fast = None  # the general reader names what is wrong
    return fast if fast is not None else _decode_lookup_response(data)


def _decode_lookup_as_written(data: bytes) -> tuple[list[LookupResultView], str] | None:
    """``decode_lookup_reply`` for the layout ``LookupResponseWriter`` writes (each field
    once, in number order), without a generator per message; None for any other layout."""
    view, end, pos = memoryview(data), len(data), 0
    results: list[LookupResultView] = []
    publication = ""
    while pos < end:
        if data[pos] == 0x12 and not publication:  # the publication, after the results
            length, pos = read_length(data, pos + 1, end, "publication", 2)
            if pos + length != end:
                return None
            publication, pos = text(data, pos, end, "publication"), end
            break
        if data[pos] != 0x0A:
            return None
        length, pos = read_length(data, pos + 1, end, "LookupResponse", 1)
        stop = pos + length
        if stop > end:
            return None
        table, rows, dtype, dim = "", view[0:0], 0, 0
        if pos < stop and data[pos] == 0x0A:
            length, pos = read_length(data, pos + 1, stop, "table", 1)
            table, pos = text(data, pos, pos + length, "table"), pos + length
        if pos < stop and data[pos] == 0x12:
            length, pos = read_length(data, pos + 1, stop, "rows", 2)
            rows, pos = view[pos : pos + length], pos + length
        if pos < stop and data[pos] == 0x18:
            value, pos = read_varint(data, pos + 1, stop, "dtype")
            dtype = int32(value)
        if pos < stop and data[pos] == 0x20:
            value, pos = read_varint(data, pos + 1, stop, "dim")
            dim = uint32(value)
        if pos != stop:
            return None
        results.append(LookupResultView(table, rows, dtype, dim))
    return results, publication


def _decode_lookup_response(data: bytes) -> tuple[list[LookupResultView], str]:
    view = memoryview(data)
    results: list[LookupResultView] = []
    publication = ""
    for field_no, wire_type, a, b in fields(data, 0, len(data), "LookupResponse", MAX_DEPTH):
        if field_no == 2 and wire_type == 2:
            publication = text(data, a, b, "publication")
        if field_no != 1 or wire_type != 2:
            continue
        name = f"results[{len(results)}]"
        table, rows, dtype, dim = "", view[0:0], 0, 0
        for f, wt, x, y in fields(data, a, b, name, submessage_depth(MAX_DEPTH, name)):
            if f == 1 and wt == 2:
                table = text(data, x, y, f"{name}.table")
            elif f == 2 and wt == 2:
                rows = view[x:y]
            elif f == 3 and wt == 0:
                dtype = int32(x)
            elif f == 4 and wt == 0:
                dim = uint32(x)
        results.append(LookupResultView(table, rows, dtype, dim))
    return results, publication


@dataclass(frozen=True)
class PushEntryView:
    """One decoded ``PushEntry``; ``keys`` and ``grads`` are views into the message bytes."""

    table: str
    keys: memoryview
    grads: memoryview
    dtype: int
    seq: int = 0  # 0: the request's


@dataclass(frozen=True)
class PushRequestView:
    """A decoded ``PushRequest``."""

    entries: list[PushEntryView]
    num_shards: int
    client_id: str
    seq: int
    shard: int | None
    epoch: int = 0
    planned_epoch: int | None = None
    planned_shard: int | None = None


def decode_push_request(data: bytes) -> PushRequestView:
    """Parse ``PushRequest`` bytes without copying keys or gradients.

    Accepts exactly what protobuf accepts, as ``decode_lookup_response`` does.
    """
    view = memoryview(data)
    entries: list[PushEntryView] = []
    num_shards, client_id, seq, epoch = 0, "", 0, 0
    shard: int | None = None
    planned_epoch: int | None = None
    planned_shard: int | None = None
    for field_no, wire_type, a, b in fields(data, 0, len(data), "PushRequest", MAX_DEPTH):
        if field_no == 1 and wire_type == 2:
            name = f"entries[{len(entries)}]"
            table, keys, grads, dtype, entry_seq = "", view[0:0], view[0:0], 0, 0
            for f, wt, x, y in fields(data, a, b, name, submessage_depth(MAX_DEPTH, name)):
                if f == 1 and wt == 2:
                    table = text(data, x, y, f"{name}.table")
                elif f == 2 and wt == 2:
                    keys = view[x:y]
                elif f == 3 and wt == 2:
                    grads = view[x:y]
                elif f == 4 and wt == 0:
                    dtype = int32(x)
                elif f == 5 and wt == 0:
                    entry_seq = x
            entries.append(PushEntryView(table, keys, grads, dtype, entry_seq))
        elif field_no == 2 and wire_type == 0:
            num_shards = uint32(a)
        elif field_no == 3 and wire_type == 2:
            client_id = text(data, a, b, "client_id")
        elif field_no == 4 and wire_type == 0:
            seq = a
        elif field_no == 5 and wire_type == 0:
            shard = uint32(a)
        elif field_no == 6 and wire_type == 0:
            epoch = a
        elif field_no == 7 and wire_type == 0:
            planned_epoch = a
        elif field_no == 8 and wire_type == 0:
            planned_shard = uint32(a)
    return PushRequestView(entries, num_shards, client_id, seq, shard, epoch, planned_epoch, planned_shard)


def encode_push_request(
    entries: Sequence[PushEntryParts],
    num_shards: int,
    client_id: str,
    seq: int,
    shard: int | None = None,
    *,
    epoch: int = 0,
    planned: tuple[int, int] | None = None,
) -> bytes:
    """``PushRequest`` bytes from ``(table, keys, grads, dtype)`` entries, or
    ``(table, keys, grads, dtype, seq)`` with the entry's own seq; one copy of the payload.
    ``epoch``: of the cluster map it is routed by; ``planned``: ``(epoch, shard)`` it was
    first planned for, when routed again after a reshard.

    ``grads`` are float32 ``[n, dim]`` and are converted to ``dtype`` on the way.
    Raises ``ValueError`` for an integer outside its field's range (as protobuf does).
    """
    check_range("num_shards", num_shards, 32)
    check_range("seq", seq, 64)
    if shard is not None:
        check_range("shard", shard, 32)
    pieces: list[bytes | npt.NDArray[np.generic]] = []
    for i, entry in enumerate(entries):
        table, keys, grads, dtype = entry[:4]
        entry_seq = entry[4] if len(entry) > 4 else 0
        dtype_itemsize(dtype, f"entries[{i}].dtype")
        check_range(f"entries[{i}].seq", entry_seq, 64)
        k = np.ascontiguousarray(keys, dtype=_I64)
        if dtype in (pb.FLOAT32, pb.DTYPE_UNSPECIFIED):
            g: npt.NDArray[np.generic] = np.ascontiguousarray(grads, dtype=_F32)
        elif dtype == pb.FLOAT16:
            g = np.ascontiguousarray(grads, dtype=_F16)
        else:
            g = _float32_to_bfloat16(np.asarray(grads, dtype=_F32))
        head = str_field(1, table) + (len_field(2, k.nbytes) if k.nbytes else b"")
        mid = len_field(3, g.nbytes) if g.nbytes else b""
        tail = int_field(4, dtype) + int_field(5, entry_seq)
        body = len(head) + k.nbytes + len(mid) + g.nbytes + len(tail)
        pieces += [len_field(1, body) + head, k, mid, g, tail]
    trailer = int_field(2, num_shards) + str_field(3, client_id) + int_field(4, seq)
    if shard is not None:  # explicit presence: written even when 0
        trailer += varint(5 << 3) + varint(shard)
    check_range("epoch", epoch, 64)
    trailer += int_field(6, epoch)
    if planned is not None:
        check_range("planned_epoch", planned[0], 64)
        check_range("planned_shard", planned[1], 32)
        trailer += varint(7 << 3) + varint(planned[0]) + varint(8 << 3) + varint(planned[1])
    pieces.append(trailer)
    total = sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in pieces)
    data, buf = alloc_bytes(total)
    pos = 0
    for p in pieces:
        raw = p.reshape(-1).view(np.uint8) if isinstance(p, np.ndarray) else np.frombuffer(p, dtype=np.uint8)
        buf[pos : pos + raw.shape[0]] = raw
        pos += raw.shape[0]
    return data
