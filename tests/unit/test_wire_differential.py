"""The hand-written decoders in ``protos.wire`` against protobuf itself, on generated input.

``decode_push_request`` and ``decode_lookup_response`` must accept exactly the bytes
that ``pb.PushRequest.FromString`` / ``pb.LookupResponse.FromString`` accept, and read
the same values from them. The generator builds messages field by field: known fields
with their own and with other wire types, unknown fields of every wire type, groups
(empty, nested, mismatched, unterminated), field numbers around 2**29, overlong tags
and varints, invalid wire types, and truncations anywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from protos import ps_pb2 as pb
from protos.wire import (
    FLOAT32,
    LookupResponseWriter,
    WireFormatError,
    decode_lookup_response,
    decode_push_request,
    encode_lookup_request,
    encode_push_request,
)

MAX_FIELD_NO = 2**29 - 1
FIELD_NUMBERS = [
    1,
    2,
    3,
    4,
    5,
    6,
    7,
    15,
    16,
    2047,
    2048,
    2**21,
    MAX_FIELD_NO - 1,
    MAX_FIELD_NO,
    MAX_FIELD_NO + 1,
    2**30,
    2**32 - 1,
    2**32,
]


def varint(value: int, pad: int = 0) -> bytes:
    """``value`` as a varint, with ``pad`` extra (non-canonical) continuation bytes."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            break
    if pad:
        out[-1] |= 0x80
        out += b"\x80" * (pad - 1) + b"\x00"
    return bytes(out)


def tag(field_no: int, wire_type: int, pad: int = 0) -> bytes:
    return varint(field_no << 3 | wire_type, pad)


# A field's payload strategy by wire type (the tag is added by the caller).
def varint_payload() -> st.SearchStrategy[bytes]:
    values = st.sampled_from([0, 1, 127, 128, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**63, 2**64 - 1]) | st.integers(
        0, 2**64 - 1
    )
    return st.builds(varint, values, st.sampled_from([0, 0, 0, 1, 4, 9]))


def len_payload(content: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return content.map(lambda c: varint(len(c)) + c)


TEXT = st.text(max_size=6).map(str.encode) | st.binary(max_size=6)  # valid UTF-8, or maybe not
SCALARS: dict[int, Callable[[], st.SearchStrategy[bytes]]] = {
    0: varint_payload,
    1: lambda: st.binary(min_size=8, max_size=8),
    2: lambda: len_payload(st.binary(max_size=10)),
    5: lambda: st.binary(min_size=4, max_size=4),
}

# Known fields: number -> (wire type, payload strategy); entries' payload is a PushEntry.
ENTRY_FIELDS: dict[int, tuple[int, Callable[[], st.SearchStrategy[bytes]]]] = {
    1: (2, lambda: len_payload(TEXT)),
    2: (2, lambda: len_payload(st.binary(max_size=16))),
    3: (2, lambda: len_payload(st.binary(max_size=16))),
    4: (0, varint_payload),
}
RESULT_FIELDS = {1: ENTRY_FIELDS[1], 2: ENTRY_FIELDS[2], 3: (0, varint_payload), 4: (0, varint_payload)}


@st.composite
def group(draw: st.DrawFn, depth: int) -> bytes:
    """A start-group tag, fields (nested groups too), then an end-group tag that usually
    matches, sometimes is of another field number, sometimes is missing."""
    number = draw(st.sampled_from(FIELD_NUMBERS[:12]))
    body = b"".join(draw(st.lists(unknown_field(depth - 1), max_size=3))) if depth > 0 else b""
    end = draw(st.sampled_from(["match", "match", "match", "other", "missing"]))
    close = {"match": tag(number, 4), "other": tag(number + 1, 4), "missing": b""}[end]
    return tag(number, 3) + body + close


@st.composite
def unknown_field(draw: st.DrawFn, depth: int = 2) -> bytes:
    kind = draw(st.sampled_from(["scalar", "scalar", "scalar", "group", "bad"]))
    if kind == "group":
        return draw(group(depth))
    if kind == "bad":  # invalid wire types and stray end-group tags
        return tag(draw(st.sampled_from(FIELD_NUMBERS[:8])), draw(st.sampled_from([4, 6, 7])))
    wire_type = draw(st.sampled_from(sorted(SCALARS)))
    number = draw(st.sampled_from(FIELD_NUMBERS) | st.integers(1, 2**32))
    pad = draw(st.sampled_from([0, 0, 0, 1, 2, 3]))  # 5 bytes at most is a valid tag
    return tag(number, wire_type, pad) + draw(SCALARS[wire_type]())


@st.composite
def message(draw: st.DrawFn, known: dict[int, tuple[int, Callable[[], st.SearchStrategy[bytes]]]]) -> bytes:
    parts = []
    for _ in range(draw(st.integers(0, 5))):
        choice = draw(st.sampled_from(["known", "known", "known", "wrong type", "unknown"]))
        if choice == "unknown":
            parts.append(draw(unknown_field()))
            continue
        number = draw(st.sampled_from(sorted(known)))
        wire_type, payload = known[number]
        if choice == "wrong type":  # a known number with another wire type is an unknown field
            wire_type = draw(st.sampled_from([w for w in (0, 1, 2, 5) if w != wire_type] + [3]))
            if wire_type == 3:
                parts.append(tag(number, 3) + tag(number, 4))
                continue
            payload = SCALARS[wire_type]
        parts.append(tag(number, wire_type, draw(st.sampled_from([0, 0, 1]))) + draw(payload()))
    return b"".join(parts)


PUSH_FIELDS = {
    1: (2, lambda: len_payload(message(ENTRY_FIELDS))),
    2: (0, varint_payload),
    3: (2, lambda: len_payload(TEXT)),
    4: (0, varint_payload),
    5: (0, varint_payload),
}
LOOKUP_FIELDS = {1: (2, lambda: len_payload(message(RESULT_FIELDS)))}


@st.composite
def maybe_truncated(draw: st.DrawFn, strategy: st.SearchStrategy[bytes]) -> bytes:
    data = draw(strategy)
    if data and draw(st.integers(0, 4)) == 0:
        data = data[: draw(st.integers(0, len(data) - 1))]
    return data + draw(st.sampled_from([b"", b"", b"", b"\x80", b"\x08\xff"]))  # a truncated tag or varint


# -- comparing outcomes ----------------------------------------------------------------------


def pb_push(data: bytes) -> object:
    try:
        m = pb.PushRequest.FromString(data)
    except DecodeError:
        return "rejected"
    shard = m.shard if m.HasField("shard") else None
    return [(e.table, e.keys, e.grads, e.dtype) for e in m.entries], m.num_shards, m.client_id, m.seq, shard


def wire_push(data: bytes) -> object:
    try:
        v = decode_push_request(data)
    except WireFormatError:
        return "rejected"
    return (
        [(e.table, bytes(e.keys), bytes(e.grads), e.dtype) for e in v.entries],
        v.num_shards,
        v.client_id,
        v.seq,
        v.shard,
    )


def pb_lookup(data: bytes) -> object:
    try:
        m = pb.LookupResponse.FromString(data)
    except DecodeError:
        return "rejected"
    return [(r.table, r.rows, r.dtype, r.dim) for r in m.results]


def wire_lookup(data: bytes) -> object:
    try:
        results = decode_lookup_response(data)
    except WireFormatError:
        return "rejected"
    return [(r.table, bytes(r.rows), r.dtype, r.dim) for r in results]


FUZZ = settings(
    max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@FUZZ
@given(data=maybe_truncated(message(PUSH_FIELDS)))
@example(data=tag(MAX_FIELD_NO + 1, 0) + b"\x01")
@example(data=tag(7, 3) + tag(7, 4))
@example(data=tag(2, 0, pad=4) + b"\x05")
@example(data=tag(2, 0, pad=5) + b"\x05")
def test_push_decoder_accepts_exactly_what_protobuf_accepts(data: bytes) -> None:
    assert wire_push(data) == pb_push(data), data.hex()


@FUZZ
@given(data=maybe_truncated(message(LOOKUP_FIELDS)))
def test_lookup_decoder_accepts_exactly_what_protobuf_accepts(data: bytes) -> None:
    assert wire_lookup(data) == pb_lookup(data), data.hex()


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=48))
def test_decoders_agree_with_protobuf_on_random_bytes(data: bytes) -> None:
    assert wire_push(data) == pb_push(data), data.hex()
    assert wire_lookup(data) == pb_lookup(data), data.hex()


# -- the cases fuzzing found, spelled out ----------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "accepted"),
    [
        (tag(MAX_FIELD_NO, 0) + b"\x01", True),  # the largest field number
        (tag(MAX_FIELD_NO + 1, 0) + b"\x01", False),  # one above it
        (tag(2**32 - 1, 2) + b"\x00", False),
        (tag(7, 3) + tag(7, 4), True),  # an empty group
        (tag(7, 3) + tag(8, 4), False),  # closed by another field's end tag
        (tag(7, 3), False),  # never closed
        (tag(7, 4), False),  # closes nothing
        (tag(7, 3) + tag(9, 3) + tag(9, 0) + b"\x01" + tag(9, 4) + tag(7, 4), True),  # nested
        (tag(1, 3) + tag(1, 4), True),  # a known message field as a group: unknown, skipped
        (tag(7, 6), False),
        (tag(7, 7), False),
        (tag(2, 0, pad=4) + b"\x05", True),  # a 5-byte tag
        (tag(2, 0, pad=5) + b"\x05", False),  # a 6-byte tag
        (tag(4, 0) + b"\xff" * 9 + b"\x01", True),  # a 10-byte varint
        (tag(4, 0) + b"\xff" * 9 + b"\x7f", True),  # bits above 64 are dropped
        (tag(4, 0) + b"\xff" * 10 + b"\x01", False),  # an 11-byte varint
        (tag(4, 0) + b"\xff", False),  # a truncated varint
    ],
)
def test_edge_cases_match_protobuf(data: bytes, accepted: bool) -> None:
    assert (pb_push(data) != "rejected") is accepted
    assert wire_push(data) == pb_push(data)


@pytest.mark.parametrize("extra", [0, 1])
def test_nesting_limit_matches_protobuf(extra: int) -> None:
    """100 levels of groups below the message, 99 inside an entry (which is one level)."""

    def nest(levels: int) -> bytes:
        return tag(7, 3) * levels + tag(7, 4) * levels

    top = nest(100 + extra)
    inside = tag(1, 2) + varint(len(nest(99 + extra))) + nest(99 + extra)
    for data in (top, inside):
        assert (pb_push(data) == "rejected") is bool(extra)
        assert wire_push(data) == pb_push(data)
    assert wire_lookup(top) == pb_lookup(top)


@pytest.mark.parametrize(
    ("value", "as_uint32", "as_int32"), [(2**32 + 3, 3, 3), (2**64 - 1, 2**32 - 1, -1), (2**31, 2**31, -(2**31))]
)
def test_integer_fields_are_truncated_to_their_width(value: int, as_uint32: int, as_int32: int) -> None:
    entry = tag(4, 0) + varint(value)
    data = tag(1, 2) + varint(len(entry)) + entry + tag(2, 0) + varint(value) + tag(5, 0) + varint(value)
    view = decode_push_request(data)
    assert (view.num_shards, view.shard, view.entries[0].dtype) == (as_uint32, as_uint32, as_int32)
    assert wire_push(data) == pb_push(data)
    result = tag(3, 0) + varint(value) + tag(4, 0) + varint(value)
    response = tag(1, 2) + varint(len(result)) + result
    assert wire_lookup(response) == pb_lookup(response) == [("", b"", as_int32, as_uint32)]


@pytest.mark.parametrize(
    "kwargs",
    [{"num_shards": 2**32}, {"num_shards": -1}, {"seq": 2**64}, {"seq": -1}, {"shard": 2**32}, {"shard": -1}],
)
def test_push_encoder_refuses_what_protobuf_refuses(kwargs: dict[str, int]) -> None:
    args = {"num_shards": 1, "client_id": "c", "seq": 1, "shard": None} | kwargs
    with pytest.raises(ValueError):
        pb.PushRequest(**{k: v for k, v in args.items() if v is not None})
    with pytest.raises(ValueError, match="out of range"):
        encode_push_request([], args["num_shards"], "c", args["seq"], args["shard"])  # type: ignore[arg-type]


def test_lookup_writer_refuses_what_protobuf_refuses() -> None:
    with pytest.raises(ValueError):
        pb.LookupResult(dim=2**32)
    with pytest.raises(ValueError, match="out of range"):
        LookupResponseWriter([("t", 0, 2**32, FLOAT32)])


# -- the lookup request encoder, and the decoder's path for the layout shards write --------------


entry_st = st.tuples(st.text(max_size=5), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6))


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(entry_st, max_size=4),
    dtype=st.sampled_from([0, 1, 2, 3]),
    num_shards=st.sampled_from([0, 1, 2, 2**32 - 1]),
    shard=st.sampled_from([None, 0, 1, 2**32 - 1]),
)
def test_lookup_request_encoder_writes_what_protobuf_writes(
    entries: list[tuple[str, list[int]]], dtype: int, num_shards: int, shard: int | None
) -> None:
    arrays = [(t, np.array(k, dtype=np.int64)) for t, k in entries]
    expected = pb.LookupRequest(
        entries=[pb.LookupEntry(table=t, keys=k.astype("<i8").tobytes(), dtype=dtype) for t, k in arrays],  # type: ignore[arg-type]
        num_shards=num_shards,
        shard=shard,
    ).SerializeToString()
    assert encode_lookup_request(arrays, dtype, num_shards, shard) == expected


@pytest.mark.parametrize("kwargs", [{"num_shards": 2**32}, {"num_shards": -1}, {"shard": 2**32}, {"shard": -1}])
def test_lookup_request_encoder_refuses_what_protobuf_refuses(kwargs: dict[str, int]) -> None:
    args = {"num_shards": 1, "shard": 0} | kwargs
    with pytest.raises(ValueError):
        pb.LookupRequest(**args)
    with pytest.raises(ValueError, match="out of range"):
        encode_lookup_request([("t", np.arange(2))], FLOAT32, args["num_shards"], args["shard"])
    with pytest.raises(WireFormatError, match="unknown dtype 9"):
        encode_lookup_request([("t", np.arange(2))], 9, 1)


@settings(max_examples=300, deadline=None)
@given(
    results=st.lists(st.tuples(st.text(max_size=4), st.integers(0, 3), st.integers(0, 3)), max_size=3),
    cuts=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=3),
    truncate=st.integers(0, 400),
)
def test_written_responses_damaged_anywhere_decode_as_protobuf_decodes_them(
    results: list[tuple[str, int, int]], cuts: list[tuple[int, int]], truncate: int
) -> None:
    """The layout the shards write takes a shortcut through the decoder; these bytes, with
    a few changed and the end cut off, must still read exactly as protobuf reads them."""
    writer = LookupResponseWriter([(t, n, dim, FLOAT32) for t, n, dim in results])
    for i, (_, n, dim) in enumerate(results):
        writer.rows(i)[:] = np.arange(n * dim, dtype=np.float32).reshape(n, dim)
    data = bytearray(writer.finish())
    assert wire_lookup(bytes(data)) == pb_lookup(bytes(data))
    for at, value in cuts:
        if data:
            data[at % len(data)] = value
    damaged = bytes(data[: len(data) - truncate % (len(data) + 1)])
    assert wire_lookup(damaged) == pb_lookup(damaged), damaged.hex()
