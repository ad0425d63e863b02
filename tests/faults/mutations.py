"""Adversarial request bytes and metadata: random bytes, bit flips, protobuf wire-format abuse,
oversized frames, junk metadata.

Every function takes a ``numpy.random.Generator`` (or nothing) and returns bytes; none
knows what a request means (``tests/faults/oracles.py`` judges them).

Example:
    >>> rng = np.random.default_rng(0)
    >>> len(flip_bits(rng, b"abcd", 2)) == 4 and flip_bits(rng, b"abcd", 2) != b"abcd"
    True
    >>> varint(300)
    b'\\xac\\x02'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "METADATA_HARD_LIMIT_BYTES",
    "MetadataCase",
    "Mutation",
    "append_junk",
    "flip_bits",
    "metadata_cases",
    "nested_groups",
    "oversized",
    "random_bytes",
    "structural",
    "tag",
    "truncate",
    "varint",
]

Mutation = Callable[[np.random.Generator, bytes], bytes]
METADATA_HARD_LIMIT_BYTES = 16 << 10  # gRPC's default hard limit on received metadata
_METADATA_SOFT_LIMIT_BYTES = 8 << 10  # between the two, gRPC refuses a growing share of calls


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative ``value`` (any size: longer than 10 bytes is invalid)."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(field_no: int, wire_type: int) -> bytes:
    return varint(field_no << 3 | wire_type)


def random_bytes(rng: np.random.Generator, max_len: int = 4000) -> bytes:
    """Random bytes, mostly short (where parsers branch most), sometimes up to ``max_len``."""
    n = int(rng.choice([rng.integers(0, 16), rng.integers(0, 300), rng.integers(0, max_len + 1)]))
    return rng.bytes(n)


def flip_bits(rng: np.random.Generator, data: bytes, flips: int = 0) -> bytes:
    """``data`` with 1 to 4 (or ``flips``) random bits inverted; empty ``data`` gets one random byte."""
    if not data:
        return rng.bytes(1)
    out = bytearray(data)
    for _ in range(flips or int(rng.integers(1, 5))):
        bit = int(rng.integers(0, 8 * len(out)))
        out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def truncate(rng: np.random.Generator, data: bytes) -> bytes:
    """A strict prefix of ``data`` (cut inside a field more often than not)."""
    return data[: int(rng.integers(0, len(data)))] if data else b""


def append_junk(rng: np.random.Generator, data: bytes) -> bytes:
    return data + rng.bytes(int(rng.integers(1, 40)))


def nested_groups(depth: int, field_no: int = 15) -> bytes:
    """``depth`` nested groups of an unknown field: within protobuf's recursion limit (100) or past it."""
    return tag(field_no, 3) * depth + tag(field_no, 4) * depth


def oversized(size_bytes: int, field_no: int = 15) -> bytes:
    """A well-formed message (one unknown bytes field) of about ``size_bytes``: only its size is wrong."""
    return tag(field_no, 2) + varint(size_bytes) + bytes(size_bytes)


def _overlong_varint(rng: np.random.Generator, data: bytes) -> bytes:
    return data + tag(2, 0) + b"\xff" * 10 + b"\x01"  # 11 bytes: protobuf refuses


def _huge_length(rng: np.random.Generator, data: bytes) -> bytes:
    """A length field past the data: 2**31 and up, to 2**64 - 1 and a 10-byte varint over 64 bits."""
    lengths = [1 << 31, 1 << 32, 1 << 63, (1 << 64) - 1, 1 << 64]
    return data + tag(int(rng.choice([1, 15])), 2) + varint(lengths[int(rng.integers(0, len(lengths)))])


def _length_past_end(rng: np.random.Generator, data: bytes) -> bytes:
    payload = rng.bytes(int(rng.integers(0, 20)))
    return data + tag(1, 2) + varint(len(payload) + int(rng.integers(1, 1000))) + payload


def _bad_field_number(rng: np.random.Generator, data: bytes) -> bytes:
    return data + bytes(rng.choice([b"\x00", b"\x02\x00", varint((1 << 29) << 3), varint((1 << 32) << 3)]))


def _wrong_wire_type(rng: np.random.Generator, data: bytes) -> bytes:
    """The first field's tag with another wire type (6 and 7 do not exist; 4 ends a group never started)."""
    if not data:
        return bytes([0x0C])
    return bytes([(data[0] & ~7) | int(rng.choice([1, 3, 4, 5, 6, 7]))]) + data[1:]


def _deep_groups(rng: np.random.Generator, data: bytes) -> bytes:
    return data + nested_groups(int(rng.choice([50, 99, 101, 200, 5000])))


def _unterminated_group(rng: np.random.Generator, data: bytes) -> bytes:
    return data + tag(15, 3) + tag(2, 0) + b"\x01"


def _max_varints(rng: np.random.Generator, data: bytes) -> bytes:
    """Every varint field 1-8 set to 2**64 - 1 (well-formed; uint32 fields keep the low 32 bits)."""
    return data + b"".join(tag(f, 0) + varint((1 << 64) - 1) for f in range(1, 9))


STRUCTURAL: tuple[tuple[str, Mutation], ...] = (
    ("overlong-varint", _overlong_varint),
    ("huge-length", _huge_length),
    ("length-past-end", _length_past_end),
    ("bad-field-number", _bad_field_number),
    ("wrong-wire-type", _wrong_wire_type),
    ("deep-groups", _deep_groups),
    ("unterminated-group", _unterminated_group),
    ("max-varints", _max_varints),
)


def structural(rng: np.random.Generator, data: bytes) -> tuple[str, bytes]:
    """``(name, bytes)``: ``data`` abused at the protobuf wire level by one of ``STRUCTURAL``."""
    name, mutate = STRUCTURAL[int(rng.integers(0, len(STRUCTURAL)))]
    return name, mutate(rng, data)


@dataclass(frozen=True)
class MetadataCase:
    """Metadata sent with a request. ``refused``: the status the call must get whatever the
    request (None: the metadata does not matter, the request's own verdict holds); ``maybe``:
    gRPC may refuse it (sizes between its soft and hard limits)."""

    name: str
    metadata: tuple[tuple[str, str | bytes], ...]
    refused: str | None = None
    maybe: bool = False


_KEY_CHARS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789-_.", np.uint8)
_VALUE_CHARS = np.arange(0x20, 0x7F, dtype=np.uint8)  # printable ASCII, as gRPC allows in text values


def _key(rng: np.random.Generator, suffix: str = "") -> str:
    return "x-" + bytes(rng.choice(_KEY_CHARS, int(rng.integers(1, 24)))).decode() + suffix


def _text(rng: np.random.Generator, n: int) -> str:
    return bytes(rng.choice(_VALUE_CHARS, n)).decode()


def metadata_cases(rng: np.random.Generator) -> list[MetadataCase]:
    """One of each kind of junk metadata (fresh random content on each call).

    Bearer tokens are not checked yet: when they are, add "no token" and "wrong token"
    cases here with ``refused="UNAUTHENTICATED"`` (and give valid calls the right token).
    """
    size = lambda md: sum(len(k) + len(v) for k, v in md)  # noqa: E731
    cases = [
        MetadataCase("junk-text", tuple((_key(rng), _text(rng, int(rng.integers(0, 200)))) for _ in range(3))),
        MetadataCase("junk-binary", ((_key(rng, "-bin"), rng.bytes(int(rng.integers(0, 500)))),)),
        MetadataCase("many-entries", tuple((_key(rng), _text(rng, 8)) for _ in range(60))),
        MetadataCase("empty-values", ((_key(rng), ""), (_key(rng, "-bin"), b""))),
        MetadataCase("near-soft-limit", ((_key(rng), _text(rng, _METADATA_SOFT_LIMIT_BYTES - 1024)),)),
    ]
    between = ((_key(rng), _text(rng, int(rng.integers(_METADATA_SOFT_LIMIT_BYTES, METADATA_HARD_LIMIT_BYTES - 64)))),)
    cases.append(MetadataCase("between-limits", between, refused="RESOURCE_EXHAUSTED", maybe=True))
    over = ((_key(rng), _text(rng, METADATA_HARD_LIMIT_BYTES + int(rng.integers(0, 4096)))),)
    cases.append(MetadataCase("over-hard-limit", over, refused="RESOURCE_EXHAUSTED"))
    for case in cases:
        assert case.refused is not None or size(case.metadata) < _METADATA_SOFT_LIMIT_BYTES, case.name
    return cases
