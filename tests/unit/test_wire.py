"""The hand-rolled LookupResponse/PushRequest codecs, checked byte for byte against
protobuf in both directions (keys and rows alone: test_wire_arrays.py)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import ps_pb2 as pb
from protos.wire import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    LookupResponseWriter,
    WireFormatError,
    alloc_bytes,
    decode_keys,
    decode_lookup_response,
    decode_push_request,
    decode_rows,
    encode_keys,
    encode_push_request,
    encode_rows,
    rows_to_dtype,
)
from tests.unit.test_wire_arrays import ALL_DTYPES, INT64_MAX, INT64_MIN, shares

# --- LookupResponse --------------------------------------------------------------------------

Result = tuple[str, int, int, int]


def pb_lookup_response(results: Sequence[Result], data: Sequence[np.ndarray]) -> bytes:
    return pb.LookupResponse(
        results=[
            pb.LookupResult(table=t, rows=encode_rows(d, dtype), dtype=dtype, dim=dim)
            for (t, _, dim, dtype), d in zip(results, data)
        ]
    ).SerializeToString()


def written(results: Sequence[Result], data: Sequence[np.ndarray]) -> bytes:
    w = LookupResponseWriter(results)
    for i, ((_, n, dim, dtype), d) in enumerate(zip(results, data)):
        view = w.rows(i)
        assert view.shape == (n, dim)
        assert view.dtype == {FLOAT16: np.float16, BFLOAT16: np.uint16}.get(dtype, np.float32)
        view[...] = rows_to_dtype(d, dtype)
    return w.finish()


def random_rows(results: Sequence[Result], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, dim)).astype(np.float32) for _, n, dim, _ in results]


LOOKUP_CASES: list[list[Result]] = [
    [],
    [("t", 2, 3, FLOAT32)],
    [("", 2, 3, FLOAT32)],
    [("empty", 0, 8, FLOAT32)],
    [("", 0, 0, pb.DTYPE_UNSPECIFIED)],
    [("u", 4, 2, pb.DTYPE_UNSPECIFIED)],
    [("user", 3, 4, FLOAT16), ("item", 0, 4, BFLOAT16), ("", 5, 1, BFLOAT16), ("ü/tbl:1", 1, 7, FLOAT32)],
    [("big", 300, 64, FLOAT32), ("big16", 200, 50, FLOAT16)],  # multi-byte length varints
]


@pytest.mark.parametrize("results", LOOKUP_CASES)
def test_lookup_writer_matches_protobuf_bytes(results: list[Result]) -> None:
    data = random_rows(results, seed=len(results))
    encoded = written(results, data)
    assert isinstance(encoded, bytes)
    assert encoded == pb_lookup_response(results, data)


def test_lookup_writer_docstring_and_unknown_dtype() -> None:
    w = LookupResponseWriter([("t", 2, 3, FLOAT32)])
    w.rows(0)[:] = 1.0
    msg = pb.LookupResponse.FromString(w.finish())
    assert msg.results[0].dim == 3 and msg.results[0].rows == np.ones((2, 3), np.float32).tobytes()
    with pytest.raises(WireFormatError, match="unknown dtype 7"):
        LookupResponseWriter([("t", 1, 1, 7)])


result_st = st.tuples(st.text(max_size=6), st.integers(0, 5), st.integers(0, 5), st.sampled_from(ALL_DTYPES))


@settings(max_examples=150, deadline=None)
@given(results=st.lists(result_st, max_size=4), seed=st.integers(0, 1000))
def test_lookup_writer_matches_protobuf_property(results: list[Result], seed: int) -> None:
    data = random_rows(results, seed)
    encoded = written(results, data)
    assert encoded == pb_lookup_response(results, data)
    decoded = decode_lookup_response(encoded)
    assert [(r.table, r.dtype, r.dim) for r in decoded] == [(t, d, dim) for t, _, dim, d in results]
    for r, (_, n, dim, dtype), d in zip(decoded, results, data):
        assert bytes(r.rows) == encode_rows(d, dtype)
        np.testing.assert_array_equal(
            decode_rows(r.rows, n, dim, r.dtype, "rows"), decode_rows(encode_rows(d, dtype), n, dim, dtype, "rows")
        )


def assert_lookup_agrees_with_protobuf(data: bytes) -> None:
    msg = pb.LookupResponse.FromString(data)  # the hand-built bytes must be valid protobuf
    got = decode_lookup_response(data)
    assert [(r.table, bytes(r.rows), r.dtype, r.dim) for r in got] == [
        (r.table, r.rows, r.dtype, r.dim) for r in msg.results
    ]


def test_decode_lookup_response_is_zero_copy() -> None:
    results = [("a", 3, 2, FLOAT32), ("b", 2, 2, BFLOAT16)]
    data = pb_lookup_response(results, random_rows(results, 0))
    decoded = decode_lookup_response(data)
    for r in decoded:
        assert r.rows.readonly and shares(r.rows, data)
    rows = decode_rows(decoded[0].rows, 3, 2, decoded[0].dtype, "rows")
    assert shares(rows, data)


def unknown_fields() -> list[bytes]:
    return [
        b"\x78\x96\x01",  # field 15, varint 150
        b"\x49" + bytes(range(8)),  # field 9, fixed64
        b"\x55\x01\x02\x03\x04",  # field 10, fixed32
        b"\x5a\x03abc",  # field 11, LEN
        b"\x80\x01\x05",  # field 16 (two-byte tag), varint
    ]


def lookup_result_pieces(table: str, rows: bytes, dtype: int, dim: int) -> list[bytes]:
    """Each field of a LookupResult serialized on its own; any concatenation is a valid encoding."""
    return [
        pb.LookupResult(table=table).SerializeToString(),
        pb.LookupResult(rows=rows).SerializeToString(),
        pb.LookupResult(dtype=dtype).SerializeToString(),
        pb.LookupResult(dim=dim).SerializeToString(),
    ]


def len_field(field_no: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2), built by hand."""
    return varint(field_no << 3 | 2) + varint(len(payload)) + payload


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_decode_lookup_response_fields_reordered_and_unknown() -> None:
    rows = np.arange(6, dtype=np.float32).tobytes()
    pieces = lookup_result_pieces("tbl", rows, FLOAT32, 3)
    body = (
        pieces[3] + unknown_fields()[0] + pieces[2] + unknown_fields()[3] + pieces[1] + unknown_fields()[1] + pieces[0]
    )
    data = unknown_fields()[4] + len_field(1, body) + unknown_fields()[2] + len_field(1, b"") + unknown_fields()[3]
    assert_lookup_agrees_with_protobuf(data)
    got = decode_lookup_response(data)
    assert [(r.table, bytes(r.rows), r.dtype, r.dim) for r in got] == [("tbl", rows, FLOAT32, 3), ("", b"", 0, 0)]
    # A repeated scalar field: the last value wins, as in protobuf.
    twice = len_field(
        1, pb.LookupResult(table="a", dim=1).SerializeToString() + pb.LookupResult(table="b", dim=2).SerializeToString()
    )
    assert_lookup_agrees_with_protobuf(twice)
    assert (decode_lookup_response(twice)[0].table, decode_lookup_response(twice)[0].dim) == ("b", 2)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_decode_lookup_response_any_field_order_property(data: st.DataObject) -> None:
    top: list[bytes] = []
    for _ in range(data.draw(st.integers(0, 3))):
        table = data.draw(st.text(max_size=5))
        rows = data.draw(st.binary(max_size=24))
        dtype = data.draw(st.sampled_from(ALL_DTYPES))
        dim = data.draw(st.integers(0, 2**32 - 1))
        pieces = lookup_result_pieces(table, rows, dtype, dim) + data.draw(
            st.lists(st.sampled_from(unknown_fields()), max_size=3)
        )
        top.append(len_field(1, b"".join(data.draw(st.permutations(pieces)))))
    top += data.draw(st.lists(st.sampled_from(unknown_fields()), max_size=3))
    assert_lookup_agrees_with_protobuf(b"".join(data.draw(st.permutations(top))))


def test_decode_lookup_response_error_names_result_index_after_unknown_field() -> None:
    bad_result = len_field(1, b"\x0a\x01\xff")  # table = invalid UTF-8
    with pytest.raises(WireFormatError, match=r"^results\[0\]\.table"):
        decode_lookup_response(b"\x10\x05" + bad_result)


def test_decode_lookup_response_errors() -> None:
    with pytest.raises(WireFormatError, match=r"^results\[1\]\.table: not valid UTF-8"):
        decode_lookup_response(len_field(1, b"") + len_field(1, b"\x0a\x01\xff"))
    with pytest.raises(WireFormatError, match="^LookupResponse: field 1 runs past the end"):
        decode_lookup_response(b"\x0a\x05\x0a\x01")
    with pytest.raises(WireFormatError, match="^LookupResponse: truncated or overlong varint"):
        decode_lookup_response(b"\x0a")
    with pytest.raises(WireFormatError, match="^LookupResponse: truncated or overlong varint"):
        decode_lookup_response(b"\x08" + b"\xff" * 11)
    with pytest.raises(WireFormatError, match="field number 0"):
        decode_lookup_response(b"\x00\x00")
    with pytest.raises(WireFormatError, match=r"^results\[0\]: truncated fixed-width field"):
        decode_lookup_response(len_field(1, b"\x49\x00\x00"))
    with pytest.raises(WireFormatError, match="invalid wire type 6"):
        decode_lookup_response(b"\x0e")
    assert decode_lookup_response(b"\x0b\x0c") == []  # an empty group of field 1: skipped, as protobuf does
    assert decode_lookup_response(b"") == []


# --- PushRequest --------------------------------------------------------------------------

Entry = tuple[str, np.ndarray, np.ndarray, int]


def pb_push_request(entries: Sequence[Entry], num_shards: int, client_id: str, seq: int, shard: int | None) -> bytes:
    msg = pb.PushRequest(
        entries=[
            pb.PushEntry(table=t, keys=encode_keys(k), grads=encode_rows(g, dtype), dtype=dtype)
            for t, k, g, dtype in entries
        ],
        num_shards=num_shards,
        client_id=client_id,
        seq=seq,
    )
    if shard is not None:
        msg.shard = shard
    return msg.SerializeToString()


entry_params = st.tuples(
    st.text(max_size=6), st.integers(0, 6), st.integers(0, 4), st.sampled_from(ALL_DTYPES), st.integers(0, 2**32)
)
push_args = st.fixed_dictionaries(
    {
        "entries": st.lists(entry_params, max_size=4),
        "num_shards": st.sampled_from([0, 1, 3, 200, 2**32 - 1]),
        "client_id": st.text(max_size=10),
        "seq": st.sampled_from([0, 1, 2**31, 2**64 - 1]) | st.integers(0, 2**64 - 1),
        "shard": st.sampled_from([None, 0, 5, 2**32 - 1]),
    }
)


def make_entries(params: Sequence[tuple[str, int, int, int, int]]) -> list[Entry]:
    out = []
    for table, n, dim, dtype, seed in params:
        rng = np.random.default_rng(seed)
        keys = rng.integers(INT64_MIN, INT64_MAX, size=n, dtype=np.int64, endpoint=True)
        out.append((table, keys, rng.standard_normal((n, dim)).astype(np.float32), dtype))
    return out


def check_push_round_trip(entries: list[Entry], num_shards: int, client_id: str, seq: int, shard: int | None) -> None:
    data = encode_push_request(entries, num_shards, client_id, seq, shard)
    assert isinstance(data, bytes)
    assert data == pb_push_request(entries, num_shards, client_id, seq, shard)
    view = decode_push_request(data)
    assert (view.num_shards, view.client_id, view.seq, view.shard) == (num_shards, client_id, seq, shard)
    assert len(view.entries) == len(entries)
    for e, (table, keys, grads, dtype) in zip(view.entries, entries):
        assert (e.table, e.dtype) == (table, dtype)
        assert decode_keys(e.keys, "keys").tolist() == keys.tolist()
        assert bytes(e.grads) == encode_rows(grads, dtype)
        n, dim = grads.shape
        np.testing.assert_array_equal(
            decode_rows(e.grads, n, dim, e.dtype, "grads"), decode_rows(encode_rows(grads, dtype), n, dim, dtype, "g")
        )


@pytest.mark.parametrize("shard", [None, 0, 5])
def test_push_request_matches_protobuf(shard: int | None) -> None:
    entries = make_entries(
        [
            ("user", 5, 4, FLOAT32, 1),
            ("", 0, 4, FLOAT16, 2),
            ("item", 3, 2, BFLOAT16, 3),
            ("x", 2, 3, pb.DTYPE_UNSPECIFIED, 4),
            ("big", 400, 16, FLOAT32, 5),
        ]
    )
    check_push_round_trip(entries, 4, "worker-0", 17, shard)
    check_push_round_trip([], 0, "", 0, shard)


def test_push_request_shard_presence() -> None:
    assert decode_push_request(encode_push_request([], 2, "c", 1)).shard is None
    assert decode_push_request(encode_push_request([], 2, "c", 1, shard=0)).shard == 0
    assert encode_push_request([], 0, "", 0, shard=0) == b"\x28\x00"
    assert pb.PushRequest.FromString(encode_push_request([], 0, "", 0, shard=0)).HasField("shard")
    assert not pb.PushRequest.FromString(encode_push_request([], 0, "", 0)).HasField("shard")


@settings(max_examples=150, deadline=None)
@given(args=push_args)
def test_push_request_matches_protobuf_property(args: dict) -> None:
    check_push_round_trip(make_entries(args.pop("entries")), **args)


def test_decode_push_request_is_zero_copy_and_tolerates_reordering() -> None:
    keys = np.array([1, -2, INT64_MAX], dtype=np.int64)
    grads = np.arange(6, dtype=np.float32).reshape(3, 2)
    entry = pb.PushEntry(table="t", keys=encode_keys(keys), grads=encode_rows(grads), dtype=FLOAT32)
    pieces = [
        pb.PushEntry(dtype=FLOAT32).SerializeToString(),
        unknown_fields()[1],
        pb.PushEntry(grads=entry.grads).SerializeToString(),
        pb.PushEntry(keys=entry.keys).SerializeToString(),
        unknown_fields()[0],
        pb.PushEntry(table="t").SerializeToString(),
    ]
    data = (
        pb.PushRequest(shard=3, seq=9).SerializeToString()
        + unknown_fields()[3]
        + len_field(1, b"".join(pieces))
        + pb.PushRequest(client_id="me", num_shards=4).SerializeToString()
        + unknown_fields()[2]
    )
    msg = pb.PushRequest.FromString(data)
    e0 = msg.entries[0]  # unknown fields are kept by protobuf, so compare field by field
    assert (e0.table, e0.keys, e0.grads, e0.dtype) == (entry.table, entry.keys, entry.grads, entry.dtype)
    assert (msg.shard, msg.seq, msg.client_id, msg.num_shards) == (3, 9, "me", 4)
    view = decode_push_request(data)
    assert (view.shard, view.seq, view.client_id, view.num_shards) == (3, 9, "me", 4)
    (e,) = view.entries
    assert (e.table, e.dtype) == ("t", FLOAT32)
    assert e.keys.readonly and shares(e.keys, data) and shares(e.grads, data)
    assert decode_keys(e.keys, "keys").tolist() == keys.tolist()
    np.testing.assert_array_equal(decode_rows(e.grads, 3, 2, FLOAT32, "grads"), grads)


def test_decode_push_request_errors_name_the_field() -> None:
    with pytest.raises(WireFormatError, match=r"^entries\[1\]\.table: not valid UTF-8"):
        decode_push_request(len_field(1, b"") + len_field(1, b"\x0a\x02\xc3\x28"))
    with pytest.raises(WireFormatError, match=r"^client_id: not valid UTF-8"):
        decode_push_request(b"\x1a\x01\x80")
    with pytest.raises(WireFormatError, match=r"^entries\[0\]: field 2 runs past the end"):
        decode_push_request(len_field(1, b"\x12\x09" + b"\x00" * 8))
    with pytest.raises(WireFormatError, match=r"^PushRequest: truncated or overlong varint"):
        decode_push_request(b"\x20\x80")


def test_truncated_messages_raise_wire_format_error_exactly_when_protobuf_does() -> None:
    entries = make_entries([("user", 3, 2, FLOAT16, 7), ("i", 2, 3, FLOAT32, 8)])
    push = encode_push_request(entries, 2, "client", 300, shard=1)
    results = [("user", 3, 2, FLOAT16), ("i", 2, 3, BFLOAT16)]
    lookup = written(results, random_rows(results, 9))
    for data, decode, parse in (
        (push, decode_push_request, pb.PushRequest.FromString),
        (lookup, decode_lookup_response, pb.LookupResponse.FromString),
    ):
        for cut in range(len(data)):
            prefix = data[:cut]
            try:
                parse(prefix)
                pb_ok = True
            except Exception:
                pb_ok = False
            try:
                decode(prefix)
                ok = True
            except WireFormatError:
                ok = False
            assert ok == pb_ok, (decode.__name__, cut)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=64))
def test_decode_garbage_raises_only_wire_format_error(data: bytes) -> None:
    for decode in (decode_push_request, decode_lookup_response):
        try:
            decode(data)
        except WireFormatError:
            pass


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32), flips=st.integers(1, 4))
def test_decode_corrupted_messages_raise_only_wire_format_error(seed: int, flips: int) -> None:
    rnd = random.Random(seed)
    entries = make_entries([("ab", 2, 2, BFLOAT16, seed), ("", 1, 1, FLOAT32, 1)])
    results = [("ab", 2, 2, FLOAT16), ("c", 1, 3, FLOAT32)]
    for base, decode in (
        (encode_push_request(entries, 2, "id", 5, shard=1), decode_push_request),
        (written(results, random_rows(results, seed)), decode_lookup_response),
    ):
        data = bytearray(base)
        for _ in range(flips):
            data[rnd.randrange(len(data))] = rnd.randrange(256)
        try:
            decode(bytes(data))
        except WireFormatError:
            pass


# --- alloc_bytes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n",
    [
        0,
        1,
        2,
        3,
        1 << 20,
    ],
)
def test_alloc_bytes_content_is_what_was_written(n: int) -> None:
    data, view = alloc_bytes(n)
    assert type(data) is bytes and len(data) == n
    assert view.dtype == np.uint8 and view.shape == (n,) and view.flags.writeable
    pattern = (np.arange(n, dtype=np.uint64) * 7 + 1).astype(np.uint8)
    view[:] = pattern
    assert data == pattern.tobytes()


def test_alloc_bytes_returns_fresh_objects() -> None:
    a, va = alloc_bytes(16)
    b, vb = alloc_bytes(16)
    va[:] = 1
    vb[:] = 2
    assert a == b"\x01" * 16 and b == b"\x02" * 16
