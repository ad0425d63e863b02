"""Key hashing and routing: fixed test vectors (the cross-language contract) plus properties.

The vectors below were computed once with ``protos.keys`` and are also checked against
published reference values (splitmix64's output stream, go-jump's vectors, FNV-1a's
test strings) and against small independent reference implementations in this file.
Any other implementation of the contract must reproduce every vector here.
"""

from __future__ import annotations

import numpy as np
import pytest

from protos.keys import hash_feature, hash_features, jump_hash, misrouted, mix64, shard_of

M64 = (1 << 64) - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# --- Independent references ------------------------------------------------------------


def ref_mix64(x: int) -> int:
    """splitmix64 finalizer (Steele, Lea & Flood 2014), written from the paper."""
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def ref_jump(key: int, num_buckets: int) -> int:
    """Jump consistent hash, transcribed from Lamping & Veach (2014), figure 1."""
    key &= M64
    b, j = -1, 0
    while j < num_buckets:
        b = j
        key = (key * 2862933555777941757 + 1) % 2**64
        j = int(float(b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def ref_fnv1a64(data: bytes, basis: int = 0xCBF29CE484222325) -> int:
    h = basis
    for byte in data:
        h ^= byte
        h = (h * 0x100000001B3) % 2**64
    return h


def signed(x: int) -> int:
    return x - 2**64 if x >= 2**63 else x


def ref_hash_feature(value: str | bytes | int, seed: int) -> int:
    s = ref_mix64(seed)
    if isinstance(value, str):
        value = value.encode("utf-8")
    if isinstance(value, bytes):
        return signed(ref_mix64(ref_fnv1a64(value, 0xCBF29CE484222325 ^ s)))
    return signed(ref_mix64((value & M64) ^ s))


def random_int64(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(INT64_MIN, INT64_MAX, size=n, dtype=np.int64, endpoint=True)


# --- Fixed test vectors ----------------------------------------------------------------

MIX64_VECTORS = {
    0: 0x0,
    1: 0x5692161D100B05E5,
    2: 0xDBD238973A2B148A,
    42: 0xA759EA27D4727622,
    0x0123456789ABCDEF: 0xB2C058E4EBB5112C,
    2**32: 0xD820B7E910B0F93F,
    2**63 - 1: 0x5A682AFE7965DEBD,
    2**63: 0x25C26EA579CEA98A,
    2**64 - 1: 0xB4D055FCF2CBBD7B,
}

JUMP_VECTORS = [  # (key, num_buckets, bucket)
    (0, 1, 0),
    (0, 1000, 0),
    (1, 10, 6),
    (42, 57, 43),
    (0xDEAD10CC, 1, 0),
    (0xDEAD10CC, 666, 361),
    (256, 1024, 520),
    (2**64 - 1, 2, 1),
    (2**64 - 1, 1000, 313),
    (2**63, 100000, 74317),
    (0x0123456789ABCDEF, 3, 0),
]

SHARD_KEYS = [0, 1, -1, 2, 42, 123456789, -987654321, 2**32, INT64_MAX, INT64_MIN]
SHARD_VECTORS = {
    1: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    2: [0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
    3: [0, 0, 0, 2, 0, 0, 2, 1, 2, 1],
    10: [0, 9, 3, 7, 9, 0, 3, 1, 9, 1],
    1000: [0, 120, 222, 141, 82, 776, 325, 180, 720, 901],
}

HASH_FEATURE_VECTORS = [  # (value, key with seed 0, key with seed 42)
    ("", -780787492076525413, 8855249650999043578),
    ("a", 198367012849983736, 4149747840706453162),
    ("user:123", 7694200511170060516, -3412721238057117513),
    ("héllo", 1793390062926416830, -2525463896162511042),
    ("5", -6288479523374872413, -2185874397579126295),
    (b"", -780787492076525413, 8855249650999043578),
    (b"\x00\xff", -6409767321874185093, -8833539348748276158),
    (0, 0, -7500032730674233179),
    (5, -5278393320434088484, -9168439938793950844),
    (-1, -5417735806833148549, -1535609214311828265),
    (INT64_MAX, 6514504133438201533, 4561471606355651852),
    (INT64_MIN, 2720858781877447050, -1983492362231663262),
]


@pytest.mark.parametrize("x, expected", MIX64_VECTORS.items())
def test_mix64_vectors(x: int, expected: int) -> None:
    assert mix64(x) == expected
    assert ref_mix64(x) == expected
    assert mix64(np.array([x], dtype=np.uint64)).tolist() == [expected]


def test_mix64_matches_published_splitmix64_stream() -> None:
    # splitmix64 seeded with 0 (Vigna's splitmix64.c): state += golden gamma, output mix64(state).
    state, out = 0, []
    for _ in range(3):
        state = (state + 0x9E3779B97F4A7C15) & M64
        out.append(mix64(state))
    assert out == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_mix64_int_and_array_forms_agree_on_signed_patterns() -> None:
    keys = random_int64(1000, seed=1)
    arr = mix64(keys)
    assert arr.dtype == np.uint64
    assert arr.tolist() == [mix64(int(k)) for k in keys]
    assert mix64(-1) == mix64(2**64 - 1)
    assert keys.tolist() == random_int64(1000, seed=1).tolist(), "mix64 must not modify its input"


@pytest.mark.parametrize("key, n, expected", JUMP_VECTORS)
def test_jump_hash_vectors(key: int, n: int, expected: int) -> None:
    assert jump_hash(key, n) == expected
    assert ref_jump(key, n) == expected


@pytest.mark.parametrize("n", sorted(SHARD_VECTORS))
def test_shard_of_vectors(n: int) -> None:
    out = shard_of(np.array(SHARD_KEYS, dtype=np.int64), n)
    assert out.dtype == np.int32
    assert out.tolist() == SHARD_VECTORS[n]
    assert [ref_jump(ref_mix64(k), n) for k in SHARD_KEYS] == SHARD_VECTORS[n]


@pytest.mark.parametrize("n", [2, 3, 7, 64])
def test_shard_of_random_keys_match_the_reference(n: int) -> None:
    keys = random_int64(2000, seed=n)  # negative keys included: their bits are the unsigned id
    assert shard_of(keys, n).tolist() == [ref_jump(ref_mix64(int(k)), n) for k in keys]


def test_shard_of_docstring_example() -> None:
    assert shard_of(np.array([1, 2, 3], dtype=np.int64), 4).tolist() == [0, 3, 0]


@pytest.mark.parametrize("value, seed0, seed42", HASH_FEATURE_VECTORS)
def test_hash_feature_vectors(value: str | bytes | int, seed0: int, seed42: int) -> None:
    assert hash_feature(value, 0) == seed0
    assert hash_feature(value, 42) == seed42
    assert ref_hash_feature(value, 0) == seed0
    assert ref_hash_feature(value, 42) == seed42


@pytest.mark.parametrize(
    "data, fnv",
    [(b"", 0xCBF29CE484222325), (b"a", 0xAF63DC4C8601EC8C), (b"foobar", 0x85944171F73967E8)],
)
def test_hash_feature_seed0_is_published_fnv1a64_then_mix64(data: bytes, fnv: int) -> None:
    # mix64(0) == 0, so seed 0 leaves the standard FNV-1a offset basis untouched.
    assert ref_fnv1a64(data) == fnv
    assert hash_feature(data, 0) == signed(mix64(fnv))


# --- Agreement with the references on random keys --------------------------------------


def test_module_agrees_with_references_on_random_keys() -> None:
    keys = [int(k) for k in random_int64(1000, seed=2)]
    rng = np.random.default_rng(3)
    buckets = rng.integers(1, 5000, size=1000).tolist()
    seeds = rng.integers(0, 2**63, size=1000).tolist()
    for k, n, s in zip(keys, buckets, seeds):
        assert mix64(k) == ref_mix64(k), k
        assert jump_hash(k, n) == ref_jump(k, n), (k, n)
        assert hash_feature(k, s) == ref_hash_feature(k, s), (k, s)
        raw = k.to_bytes(8, "little", signed=True)[: n % 9]
        assert hash_feature(raw, s) == ref_hash_feature(raw, s), (raw, s)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 64, 1000, 100_003])
def test_vectorised_shard_of_equals_scalar(n: int) -> None:
    keys = np.concatenate([random_int64(500, seed=n), np.array([0, 1, -1, INT64_MIN, INT64_MAX, -2], dtype=np.int64)])
    assert (keys < 0).any()
    expected = [jump_hash(mix64(int(k)), n) for k in keys]
    assert shard_of(keys, n).tolist() == expected


def test_shard_of_accepts_lists_uint64_and_empty() -> None:
    keys = random_int64(200, seed=4)
    expected = shard_of(keys, 7).tolist()
    assert shard_of(keys.tolist(), 7).tolist() == expected
    assert shard_of(keys.view(np.uint64), 7).tolist() == expected  # same bit patterns
    empty = shard_of(np.array([], dtype=np.int64), 7)
    assert empty.dtype == np.int32 and empty.shape == (0,)


def test_jump_hash_growing_moves_keys_only_to_the_new_shard() -> None:
    keys = random_int64(20_000, seed=5)
    prev = shard_of(keys, 1)
    for n in range(2, 65):
        cur = shard_of(keys, n)
        moved = cur != prev
        assert (cur[moved] == n - 1).all(), f"growing {n - 1} -> {n} moved a key to an old shard"
        # Only about 1/n of the keys move (binomial, 20k keys: a generous bound).
        assert abs(moved.mean() - 1 / n) < 0.25 / n + 0.005, (n, moved.mean())
        prev = cur


def test_shard_of_balance_n8() -> None:
    for keys in (np.arange(100_000, dtype=np.int64), random_int64(100_000, seed=6)):
        counts = np.bincount(shard_of(keys, 8), minlength=8)
        assert counts.sum() == 100_000 and len(counts) == 8
        assert np.abs(counts / 12_500 - 1).max() < 0.03, counts


@pytest.mark.parametrize("n", [0, -1])
def test_shard_of_rejects_nonpositive_num_shards(n: int) -> None:
    with pytest.raises(ValueError, match="num_shards"):
        shard_of(np.array([1, 2], dtype=np.int64), n)
    with pytest.raises(ValueError, match="num_buckets"):
        jump_hash(1, n)


# --- hash_feature / hash_features ----------------------------------------------------------


def test_hash_features_agrees_with_hash_feature_on_ints() -> None:
    values = np.concatenate([random_int64(1000, seed=7), np.array([0, 1, -1, INT64_MIN, INT64_MAX], dtype=np.int64)])
    for seed in (0, 42, 2**63 + 5, -1):
        out = hash_features(values, seed)
        assert out.dtype == np.int64
        assert out.tolist() == [hash_feature(int(v), seed) for v in values]
    assert hash_features(values.view(np.uint64), 42).tolist() == hash_features(values, 42).tolist()


def test_hash_feature_type_rules() -> None:
    assert hash_feature(5, 0) != hash_feature("5", 0)
    assert hash_feature("héllo", 3) == hash_feature("héllo".encode(), 3)
    assert hash_feature(b"ab", 3) == hash_feature(bytearray(b"ab"), 3) == hash_feature(memoryview(b"ab"), 3)
    assert hash_feature(np.int64(-7), 3) == hash_feature(-7, 3) == hash_feature(2**64 - 7, 3)
    assert hash_feature("x", -1) == hash_feature("x", 2**64 - 1)  # seeds are 64-bit patterns
    assert hash_feature("x", 0) != hash_feature("x", 1)
    for v in ("", "x", b"\x00", 0, 1, -1, INT64_MIN):
        assert INT64_MIN <= hash_feature(v, 9) <= INT64_MAX


@pytest.mark.parametrize("value", [1.0, np.float64(2.0), True, False, np.bool_(True), None, [1], (1,)])
def test_hash_feature_rejects_unsupported_types(value: object) -> None:
    with pytest.raises(TypeError, match="hash_feature"):
        hash_feature(value, 0)  # type: ignore[arg-type]


def test_hash_features_rejects_float_arrays() -> None:
    with pytest.raises(TypeError):
        hash_features(np.array([1.2, 1.7]), 0)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000])
def test_misrouted_counts_the_keys_shard_of_sends_elsewhere(n: int) -> None:
    keys = np.random.default_rng(n).integers(-(2**63), 2**63 - 1, size=5000, dtype=np.int64)
    owners = shard_of(keys, n)
    for shard in {0, n // 2, n - 1}:
        wrong = np.flatnonzero(owners != shard)
        assert misrouted(keys, n, shard) == (wrong.size, int(wrong[0]) if wrong.size else -1)
        mine = np.frombuffer(keys[owners == shard].tobytes(), "<i8")  # read-only, as decoded from the wire
        assert misrouted(mine, n, shard) == (0, -1)
    assert misrouted(np.zeros(0, np.int64), n, 0) == (0, -1)
    with pytest.raises(ValueError, match=rf"shard={n}: not in \[0, num_shards={n}\)"):
        misrouted(keys, n, n)
