"""Byte codecs of arrays: keys and rows <-> bytes, in every wire type (the messages that
carry them are in test_wire.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protos import ps_pb2 as pb
from protos.wire import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    WireFormatError,
    bfloat16_rows_into,
    decode_keys,
    decode_rows,
    dtype_itemsize,
    dtype_name,
    encode_keys,
    encode_rows,
    rows_to_dtype,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ALL_DTYPES = [pb.DTYPE_UNSPECIFIED, FLOAT32, FLOAT16, BFLOAT16]


def shares(a: object, data: bytes) -> bool:
    return bool(np.shares_memory(np.frombuffer(a, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8)))


def torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    return (
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        .to(torch.bfloat16)
        .view(torch.int16)
        .numpy()
        .view(np.uint16)
    )


# --- keys --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keys",
    [[], [0], [7, -1], [INT64_MIN, INT64_MAX, INT64_MIN + 1, INT64_MAX - 1, 0, -1, 1], list(range(-50, 50))],
)
def test_keys_round_trip(keys: list[int]) -> None:
    buf = encode_keys(np.array(keys, dtype=np.int64))
    assert isinstance(buf, bytes) and len(buf) == 8 * len(keys)
    out = decode_keys(buf, "keys")
    assert out.dtype == np.int64 and out.tolist() == keys
    assert not out.flags.writeable
    assert shares(out, buf) or not keys


def test_keys_are_little_endian_int64_bit_patterns() -> None:
    assert encode_keys(np.array([1, -1, INT64_MIN])) == (b"\x01" + b"\x00" * 7 + b"\xff" * 8 + b"\x00" * 7 + b"\x80")
    big = np.array([2**64 - 1, 2**63], dtype=np.uint64)
    assert decode_keys(encode_keys(big), "k").tolist() == [-1, INT64_MIN]
    assert encode_keys(np.array([3, 4], dtype=np.int32)) == encode_keys(np.array([3, 4], dtype=np.int64))
    assert encode_keys(np.array([], dtype=np.float32)) == b""


def test_encode_keys_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="1-D"):
        encode_keys(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="integer"):
        encode_keys(np.array([1.5]))


@pytest.mark.parametrize("length", [1, 7, 9, 12])
def test_decode_keys_wrong_length_names_field(length: int) -> None:
    with pytest.raises(WireFormatError, match=rf"^entries\[0\]\.keys: {length} bytes is not a multiple of 8"):
        decode_keys(b"\x00" * length, "entries[0].keys")


# --- rows --------------------------------------------------------------------------------


def test_float32_rows_round_trip_zero_copy() -> None:
    rows = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    buf = encode_rows(rows, FLOAT32)
    assert buf == rows.astype("<f4").tobytes()
    for dtype in (FLOAT32, pb.DTYPE_UNSPECIFIED):
        out = decode_rows(buf, 5, 3, dtype, "rows")
        assert out.dtype == np.float32 and out.shape == (5, 3)
        np.testing.assert_array_equal(out, rows)
        assert shares(out, buf)
        assert not out.flags.writeable
        with pytest.raises(ValueError):
            out[0, 0] = 1.0
    mv = memoryview(buf)[12:]  # a view into a bigger message is zero-copy too
    out = decode_rows(mv, 4, 3, FLOAT32, "rows")
    np.testing.assert_array_equal(out, rows[1:])
    assert shares(out, buf)


def test_float16_rows_round_trip() -> None:
    rows = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32) * 100
    buf = encode_rows(rows, FLOAT16)
    assert buf == rows.astype("<f2").tobytes()
    out = decode_rows(buf, 4, 6, FLOAT16, "rows")
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, rows.astype(np.float16).astype(np.float32))
    exact = np.array([[0.5, -2.0, 1024.0, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(decode_rows(encode_rows(exact, FLOAT16), 1, 4, FLOAT16, "r"), exact)


def test_bfloat16_rounding_matches_torch_on_random_bit_patterns() -> None:
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**32, size=(2000, 16), dtype=np.uint64).astype(np.uint32)
    rows = bits.view(np.float32)
    finite_or_inf = ~np.isnan(rows)
    ties = np.array(
        [[0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x00008000, 0x00018000, 0x7F7FFFFF, 0x7F7F8000]],
        dtype=np.uint32,
    )
    normal = rng.standard_normal((100, 8)).astype(np.float32)
    for data in (rows, ties.view(np.float32), normal):
        got = np.frombuffer(encode_rows(data, BFLOAT16), dtype="<u2").reshape(data.shape)
        mask = ~np.isnan(data)
        np.testing.assert_array_equal(got[mask], torch_bf16_bits(data)[mask])
        decoded = decode_rows(encode_rows(data, BFLOAT16), *data.shape, BFLOAT16, "r")
        expected = torch.from_numpy(np.ascontiguousarray(data)).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(decoded[mask], expected[mask])
        assert np.isnan(decoded[~mask]).all()
    assert finite_or_inf.sum() > 0.99 * rows.size
    # Ties go to even: 1.00390625 -> 1.0, 1.01171875 -> 1.015625; 0x7F7FFFFF (max float) -> inf.
    assert np.frombuffer(encode_rows(ties.view(np.float32), BFLOAT16), "<u2").tolist() == [
        0x3F80,
        0x3F82,
        0xBF80,
        0xBF82,
        0x0000,
        0x0002,
        0x7F80,
        0x7F80,
    ]


def test_bfloat16_nan_stays_nan_and_inf_stays_inf() -> None:
    specials = np.array(
        [[0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF, 0x7F800000, 0xFF800000]],
        dtype=np.uint32,
    ).view(np.float32)
    out = decode_rows(encode_rows(specials, BFLOAT16), 1, 9, BFLOAT16, "r")[0]
    assert np.isnan(out[:7]).all(), out
    assert out[7] == np.inf and out[8] == -np.inf
    assert np.signbit(out[[1, 3, 5]]).all() and not np.signbit(out[[0, 2, 4]]).any()


def test_bfloat16_rows_widen_into_any_float32_array_in_place() -> None:
    rows = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    buf = encode_rows(rows, BFLOAT16)
    want = decode_rows(buf, 3, 4, BFLOAT16, "r")
    whole = np.zeros((3, 4), np.float32)
    bfloat16_rows_into(buf, whole, "r")
    wider = np.zeros((3, 8), np.float32)
    bfloat16_rows_into(buf, wider[:, 2:6], "r")  # not contiguous: the rows must land in it all the same
    np.testing.assert_array_equal(whole, want)
    np.testing.assert_array_equal(wider[:, 2:6], want)
    assert not wider[:, :2].any() and not wider[:, 6:].any()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_rows_to_dtype_matches_encode_rows(dtype: int) -> None:
    rows = np.random.default_rng(3).standard_normal((3, 5)).astype(np.float32)
    arr = rows_to_dtype(rows, dtype)
    assert arr.shape == (3, 5)
    assert arr.dtype == {FLOAT16: np.float16, BFLOAT16: np.uint16}.get(dtype, np.float32)
    assert np.ascontiguousarray(arr).tobytes() == encode_rows(rows, dtype)
    assert len(encode_rows(rows, dtype)) == 15 * dtype_itemsize(dtype)


def test_empty_rows_round_trip() -> None:
    for dtype in ALL_DTYPES:
        assert encode_rows(np.zeros((0, 4), np.float32), dtype) == b""
        assert decode_rows(b"", 0, 4, dtype, "rows").shape == (0, 4)


def test_rows_errors_name_the_field() -> None:
    with pytest.raises(
        WireFormatError, match=r"^entries\[2\]\.grads: 20 bytes, expected 24 \(2 keys x dim 3 x 4 bytes FLOAT32\)"
    ):
        decode_rows(b"\x00" * 20, 2, 3, FLOAT32, "entries[2].grads")
    with pytest.raises(WireFormatError, match=r"^results\[0\]\.rows: 24 bytes, expected 12 .*BFLOAT16"):
        decode_rows(b"\x00" * 24, 2, 3, BFLOAT16, "results[0].rows")
    with pytest.raises(WireFormatError, match=r"^entries\[1\]\.grads dtype: unknown dtype 9"):
        decode_rows(b"", 0, 3, 9, "entries[1].grads")
    with pytest.raises(WireFormatError, match=r"^dtype: unknown dtype 4"):
        encode_rows(np.zeros((1, 1), np.float32), 4)
    with pytest.raises(ValueError, match=r"\[n, dim\]"):
        encode_rows(np.zeros(3, np.float32))
    assert issubclass(WireFormatError, ValueError)
    assert [dtype_name(d) for d in ALL_DTYPES] == ["FLOAT32", "FLOAT32", "FLOAT16", "BFLOAT16"]
