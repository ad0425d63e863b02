"""The protobuf wire format's pieces, for the hand-rolled codecs of ``protos.wire``.

Varints, tags and length-delimited fields, written and read exactly as protobuf (upb)
does: field numbers in [1, 2**29 - 1], tags of at most 5 bytes, varints of at most 10,
100 levels of nesting, integers truncated to their field's width; unknown fields of
every wire type and groups skipped. Every read error is a ``WireFormatError`` naming the
field.

Example:
    >>> read_varint(varint(300), 0, 2, "n")
    (300, 2)
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = [
    "MAX_DEPTH",
    "WireFormatError",
    "check_range",
    "fields",
    "int32",
    "int_field",
    "len_field",
    "read_length",
    "read_varint",
    "str_field",
    "submessage_depth",
    "text",
    "uint32",
    "varint",
]

U64_MASK = (1 << 64) - 1
MAX_FIELD_NO = (1 << 29) - 1
# protobuf's default recursion limit: a message may nest this many sub-messages and
# groups (unknown ones included) below it; deeper input is rejected.
MAX_DEPTH = 100


class WireFormatError(ValueError):
    """A field's bytes cannot be decoded; the message names the field."""


_ONE_BYTE = tuple(bytes([v]) for v in range(0x80))


def varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]  # tags, dtypes, short names: most varints written
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def check_range(name: str, value: int, bits: int) -> None:
    if not 0 <= value < 1 << bits:
        raise ValueError(f"{name}={value}: out of range for a uint{bits} field")


def len_field(field_no: int, payload_len: int) -> bytes:
    return varint(field_no << 3 | 2) + varint(payload_len)


def str_field(field_no: int, value: str | bytes) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else value
    return len_field(field_no, len(raw)) + raw if raw else b""


def int_field(field_no: int, value: int) -> bytes:
    return varint(field_no << 3) + varint(value) if value else b""


def read_varint(buf: bytes, pos: int, end: int, field: str) -> tuple[int, int]:
    """A varint of at most 10 bytes; bits above 64 are dropped, as protobuf does."""
    value, pos = read_varint_unmasked(buf, pos, end, field)
    return value & U64_MASK, pos


def read_varint_unmasked(buf: bytes, pos: int, end: int, field: str) -> tuple[int, int]:
    if pos < end and buf[pos] < 0x80:
        return buf[pos], pos + 1  # one byte: most varints read
    result, shift = 0, 0
    while True:
        if pos >= end or shift > 63:
            raise WireFormatError(f"{field}: truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def read_length(buf: bytes, pos: int, end: int, field: str, field_no: int) -> tuple[int, int]:
    """The length of a LEN field: a varint whose value fits in 31 bits, as protobuf
    requires (one whose value overflows 64 bits must not wrap to a small length)."""
    length, pos = read_varint_unmasked(buf, pos, end, field)
    if length >= 1 << 31:
        raise WireFormatError(f"{field}: field {field_no} has an impossible length ({length})")
    return length, pos


def read_tag(buf: bytes, pos: int, end: int, field: str) -> tuple[int, int, int]:
    """``(field_no, wire_type, pos after the tag)``. A tag is a varint of at most 5 bytes
    whose field number is in [1, 2**29 - 1]; protobuf rejects anything else."""
    value, shift = 0, 0
    while True:
        if pos >= end or shift > 28:
            raise WireFormatError(f"{field}: truncated or overlong tag")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
    field_no = value >> 3
    if not 1 <= field_no <= MAX_FIELD_NO:
        raise WireFormatError(f"{field}: field number {field_no} not in [1, 2**29 - 1]")
    return field_no, value & 7, pos


def skip_scalar(buf: bytes, pos: int, end: int, field_no: int, wire_type: int, field: str) -> int:
    """Position after the value of a varint, fixed64, LEN or fixed32 field at ``pos``."""
    if wire_type == 0:
        return read_varint(buf, pos, end, field)[1]
    if wire_type == 2:
        length, pos = read_length(buf, pos, end, field, field_no)
        if length > end - pos:
            raise WireFormatError(f"{field}: field {field_no} runs past the end of the message")
        return pos + length
    if wire_type in (1, 5):
        pos += 8 if wire_type == 1 else 4
        if pos > end:
            raise WireFormatError(f"{field}: truncated fixed-width field {field_no}")
        return pos
    if wire_type == 4:
        raise WireFormatError(f"{field}: end-group tag of field {field_no} without a start-group tag")
    raise WireFormatError(f"{field}: invalid wire type {wire_type} for field {field_no}")


def skip_group(buf: bytes, pos: int, end: int, group_no: int, depth: int, field: str) -> int:
    """Position after the group of field ``group_no`` whose start tag ends at ``pos``: its
    fields are skipped (nested groups too) up to the matching end-group tag. ``depth``:
    nesting levels left below the message the group is in (each group takes one)."""
    open_groups = [group_no]
    while open_groups:
        if len(open_groups) > depth:
            raise WireFormatError(f"{field}: groups and messages nested deeper than {MAX_DEPTH} levels")
        if pos >= end:
            raise WireFormatError(f"{field}: group {open_groups[-1]} has no end-group tag")
        field_no, wire_type, pos = read_tag(buf, pos, end, field)
        if wire_type == 3:
            open_groups.append(field_no)
        elif wire_type == 4:
            if field_no != open_groups[-1]:
                raise WireFormatError(f"{field}: end-group tag of field {field_no} closes group {open_groups[-1]}")
            open_groups.pop()
        else:
            pos = skip_scalar(buf, pos, end, field_no, wire_type, field)
    return pos


def fields(buf: bytes, start: int, end: int, field: str, depth: int) -> Iterator[tuple[int, int, int, int]]:
    """Yield ``(field_no, wire_type, a, b)`` of the varint and LEN fields of the message in
    ``buf[start:end]``: varints as ``(value, 0)``, LEN as ``(start, end)``. Fixed-width
    fields and groups are skipped. ``depth``: nesting levels left below this message
    (protobuf's recursion limit counts sub-messages and groups alike)."""
    pos = start
    while pos < end:
        field_no, wire_type, pos = read_tag(buf, pos, end, field)
        if wire_type == 0:
            value, pos = read_varint(buf, pos, end, field)
            yield field_no, 0, value, 0
        elif wire_type == 2:
            length, pos = read_length(buf, pos, end, field, field_no)
            if length > end - pos:
                raise WireFormatError(f"{field}: field {field_no} runs past the end of the message")
            yield field_no, 2, pos, pos + length
            pos += length
        elif wire_type == 3:
            pos = skip_group(buf, pos, end, field_no, depth, field)
        else:
            pos = skip_scalar(buf, pos, end, field_no, wire_type, field)


def submessage_depth(depth: int, field: str) -> int:
    """Nesting levels left inside a sub-message of a message with ``depth`` left."""
    if depth - 1 < 0:
        raise WireFormatError(f"{field}: groups and messages nested deeper than {MAX_DEPTH} levels")
    return depth - 1


def uint32(value: int) -> int:
    """A varint read into a uint32 field: protobuf keeps the low 32 bits."""
    return value & 0xFFFFFFFF


def int32(value: int) -> int:
    """A varint read into an int32 or enum field: the low 32 bits, two's complement."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


def text(buf: bytes, start: int, end: int, field: str) -> str:
    try:
        return buf[start:end].decode("utf-8")
    except UnicodeDecodeError:
        raise WireFormatError(f"{field}: not valid UTF-8") from None
