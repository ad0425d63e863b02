"""16-bit row storage: the rounding in ``ps.store.precision`` and tables that store 16-bit rows.

The twin used for parity is written out here from the documented rule (update in
float32 with ``ps.table.optimizers``, then round with ``precision.round_into`` drawn from
(seed, key, version)), not taken from the table's code path.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from ps.store import RowFormat, Rows, Storage, precision
from ps.table import OptimizerKind, OptimizerParams, Table, TableSpec, optimizers
from ps.table.initializers import initial_rows

KINDS = [precision.BFLOAT16, precision.FLOAT16]


def round_many(kind: str, value: float, versions: int, key: int = 7) -> npt.NDArray[np.float32]:
    """``value`` rounded once per version 0..versions-1, decoded."""
    x = np.full((versions, 1), value, np.float32)
    out = np.zeros((versions, 1), precision.array_dtype(kind))
    counts = precision.Rounding()
    keys = np.full(versions, key, np.int64)
    precision.round_into(kind, x, out, keys, np.arange(versions, dtype=np.uint32), seed=1, first=0, counts=counts)
    return precision.decode(kind, out).ravel()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [1.0 + 2**-13, -3.3e-3, 1234.567, 6.1e-6])
def test_stochastic_rounding_is_unbiased(kind: str, value: float) -> None:
    n = 40_000
    got = round_many(kind, value, n).astype(np.float64)
    x = float(np.float32(value))
    lo, hi = got.min(), got.max()
    assert set(np.unique(got)) <= {lo, hi} and lo <= x <= hi, "not one of the two neighbours"
    # The share rounded up is a binomial draw: its mean error is within 5 sigma of zero.
    p = (x - lo) / (hi - lo) if hi > lo else 0.0
    sigma = (hi - lo) * np.sqrt(max(p * (1 - p), 1e-12) / n)
    assert abs(got.mean() - x) <= 5 * sigma + 1e-12 * abs(x), (got.mean() - x, sigma)


@pytest.mark.parametrize("kind", KINDS)
def test_stochastic_rounding_is_a_function_of_seed_key_and_version(kind: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 16)).astype(np.float32)
    keys = rng.integers(-(2**63), 2**63 - 1, 500, dtype=np.int64)
    versions = rng.integers(0, 2**32, 500, dtype=np.uint32)

    def rounded(seed: int, ver: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint16]:
        out = np.zeros(x.shape, precision.array_dtype(kind))
        precision.round_into(kind, x, out, keys, ver, seed=seed, first=0, counts=precision.Rounding())
        return out.view(np.uint16)

    a = rounded(3, versions)
    assert np.array_equal(a, rounded(3, versions))
    assert not np.array_equal(a, rounded(4, versions))
    assert not np.array_equal(a, rounded(3, versions + np.uint32(1)))


@pytest.mark.parametrize("kind", KINDS)
def test_every_stored_value_rounds_to_itself(kind: str) -> None:
    bits = np.arange(0, 1 << 16, dtype=np.uint16)
    stored = bits.view(precision.array_dtype(kind)).reshape(-1, 1)
    x = precision.decode(kind, stored)
    finite = np.isfinite(x).ravel()
    stored, x = stored[finite], x[finite]
    out = np.zeros(stored.shape, precision.array_dtype(kind))
    n = stored.shape[0]
    counts = precision.Rounding()
    precision.round_into(kind, x, out, np.zeros(n, np.int64), np.zeros(n, np.uint32), seed=0, first=0, counts=counts)
    same = (out.view(np.uint16) == stored.view(np.uint16)) | (x == 0)  # -0.0 may keep or drop its sign
    assert same.all(), f"{int((~same).sum())} values moved"
    assert np.array_equal(precision.decode(kind, precision.encode_nearest(kind, x)), x)


def test_float16_overflow_is_clamped_and_counted() -> None:
    x = np.array([[7e4, -1e9, 65504.0, 3.0e38, 1e-9]], np.float32)
    out = np.zeros(x.shape, np.float16)
    counts = precision.Rounding()
    precision.round_into(
        precision.FLOAT16, x, out, np.array([1]), np.array([0], np.uint32), seed=0, first=0, counts=counts
    )
    assert out.tolist() == [[65504.0, -65504.0, 65504.0, 65504.0, 0.0]]
    assert (counts.clamped, counts.flushed) == (3, 1)
    nearest = precision.Rounding()
    assert precision.encode_nearest(precision.FLOAT16, x, nearest).tolist() == out.tolist()
    assert nearest.clamped == 3


def test_bfloat16_beyond_its_largest_value_is_clamped() -> None:
    x = np.array([[np.finfo(np.float32).max, -np.finfo(np.float32).max]], np.float32)
    counts = precision.Rounding()
    near = precision.decode(precision.BFLOAT16, precision.encode_nearest(precision.BFLOAT16, x, counts))
    assert np.isfinite(near).all() and counts.clamped == 2


def test_float32_records_keep_their_layout_and_16_bit_records_carry_the_version() -> None:
    keys = np.array([3, 4])
    rows = Rows(
        keys,
        np.array([[1.0, 2.0], [3.0, 4.0]], np.float32),
        np.array([[5.0], [6.0]], np.float32),
        np.array([7, 8], np.uint32),
        np.array([9, 10], np.uint32),
    )
    words = np.array([[1, 2, 5], [3, 4, 6]], np.float32)
    old = np.concatenate([words.view(np.uint32), [[7, 9], [8, 10]]], axis=1).astype("<u4")
    assert rows.packed(RowFormat(2, 1)).tobytes() == old.tobytes()

    fmt = RowFormat(2, 1, precision.BFLOAT16, precision.BFLOAT16)
    values, state = np.array([[1, 2], [3, 4]], np.uint16), np.array([[5], [6]], np.uint16)
    r16 = Rows(keys, values, state, rows.last_access, rows.frequency, np.array([11, 12], np.uint32))
    assert fmt.record_bytes == 2 * 2 + 2 + 4 + 4 + 4
    back = Rows.unpack(keys, r16.packed(fmt).tobytes(), fmt)
    for column in ("values", "state", "version", "last_access", "frequency"):
        assert np.array_equal(getattr(back, column), getattr(r16, column)), column


# -- tables that store 16-bit rows --------------------------------------------------------


class Twin:
    """The documented rule, row by row: float32 update, then stochastic rounding."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.fmt = spec.row_format
        self.rows: dict[int, tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], int]] = {}

    def _row(self, key: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], int]:
        if key not in self.rows:
            spec, fmt = self.spec, self.fmt
            values = initial_rows(spec.initializer, spec.seed, np.array([key]), spec.dim)
            state = np.empty((1, fmt.state_width), np.float32)
            optimizers.init_state(spec.optimizer, state, np.array([0]))
            near = precision.encode_nearest
            self.rows[key] = (
                precision.decode(fmt.values, near(fmt.values, values)),
                precision.decode(fmt.state, near(fmt.state, state)),
                0,
            )
        return self.rows[key]

    def push(self, keys: npt.NDArray[np.int64], grads: npt.NDArray[np.float32]) -> None:
        unique, inverse = np.unique(keys, return_inverse=True)
        summed = np.zeros((unique.shape[0], self.spec.dim), np.float32)
        np.add.at(summed, inverse, grads)
        fmt = self.fmt
        for key, grad in zip(unique.tolist(), summed, strict=True):
            values, state, version = (a.copy() if isinstance(a, np.ndarray) else a for a in self._row(key))
            optimizers.apply(self.spec.optimizer, values, state, np.array([0]), grad[None, :].copy())
            v = np.array([version + 1], np.uint32)
            out_v = np.zeros(values.shape, precision.array_dtype(fmt.values))
            out_s = np.zeros(state.shape, precision.array_dtype(fmt.state))
            k = np.array([key])
            counts = precision.Rounding()
            precision.round_into(fmt.values, values, out_v, k, v, seed=self.spec.seed, first=0, counts=counts)
            precision.round_into(fmt.state, state, out_s, k, v, seed=self.spec.seed, first=fmt.dim, counts=counts)
            self.rows[key] = (precision.decode(fmt.values, out_v), precision.decode(fmt.state, out_s), version + 1)

    def values(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        return np.concatenate([self._row(k)[0] for k in keys.tolist()])

    def state(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        return np.concatenate([self._row(k)[1] for k in keys.tolist()])


def stored_state(table: Table, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
    found, rows = table.peek_rows(keys)
    assert found.all()
    order = np.argsort(rows.keys)[np.searchsorted(np.sort(rows.keys), keys)]
    return precision.decode(table.spec.state_dtype, rows.state[order])


ADAGRAD = OptimizerParams(OptimizerKind.ADAGRAD, lr=0.05)
ADAM = OptimizerParams(OptimizerKind.ADAM, lr=0.01)


@pytest.mark.parametrize(
    ("values", "state", "optimizer"),
    [
        ("bfloat16", "float32", ADAGRAD),
        ("bfloat16", "bfloat16", ADAGRAD),
        ("float16", "float32", ADAM),
        ("float32", "bfloat16", ADAM),
    ],
)
def test_a_16_bit_table_equals_a_twin_that_rounds_the_same_way(
    values: str, state: str, optimizer: OptimizerParams
) -> None:
    spec = TableSpec("t", 6, optimizer=optimizer, seed=11, storage_dtype=values, state_dtype=state)
    table, twin = Table(spec), Twin(spec)
    rng = np.random.default_rng(1)
    pool = rng.integers(-(2**63), 2**63 - 1, 40, dtype=np.int64)
    for _ in range(30):
        keys = rng.choice(pool, 25)  # with duplicates
        grads = rng.standard_normal((25, 6)).astype(np.float32)
        table.lookup(keys)
        table.push(keys, grads)
        twin.push(keys, grads)
    got = table.lookup(pool)
    assert np.array_equal(got.view(np.uint32), twin.values(pool).view(np.uint32))
    assert np.array_equal(stored_state(table, pool).view(np.uint32), twin.state(pool).view(np.uint32))
    assert table._ram.arena.values.dtype == precision.array_dtype(values)


def test_updates_smaller_than_half_a_step_still_move_16_bit_rows() -> None:
    from ps.table import InitializerKind, InitializerParams

    spec = TableSpec(
        "t",
        8,
        initializer=InitializerParams(InitializerKind.CONSTANT, value=1.0),
        optimizer=OptimizerParams(OptimizerKind.SGD, lr=1.0),
        storage_dtype="bfloat16",
    )
    table = Table(spec)
    keys = np.arange(256)
    step = 2.0**-10  # bfloat16 values near 1 are 2**-7 apart: nearest rounding would never move
    for _ in range(400):
        table.push(keys, np.full((256, 8), -step, np.float32))
    got = table.lookup(keys).astype(np.float64)
    assert abs(got.mean() - (1.0 + 400 * step)) < 0.01, got.mean()


def test_float16_rows_clamp_instead_of_overflowing() -> None:
    spec = TableSpec("t", 4, optimizer=OptimizerParams(OptimizerKind.SGD, lr=1.0), storage_dtype="float16")
    table = Table(spec)
    table.push(np.array([1, 2]), np.array([[-1e5] * 4, [1e5] * 4], np.float32))
    got = table.lookup(np.array([1, 2]))
    assert got.tolist() == [[65504.0] * 4, [-65504.0] * 4]
    assert table.rounding.clamped == 8


def test_stats_report_the_stored_types_their_bytes_and_the_clamps() -> None:
    from ps.service.report import shard_stats
    from ps.shard import Shard

    shard = Shard(0, 1)
    shard.create_table(TableSpec("t", 4, optimizer=OptimizerParams(OptimizerKind.SGD, lr=1.0), storage_dtype="float16"))
    shard.create_table(TableSpec("u", 4, optimizer=ADAGRAD))
    shard.table("t").push(np.array([1]), np.full((1, 4), -1e6, np.float32))
    t, u = shard_stats(shard).tables
    assert (t.storage_dtype, t.state_dtype, t.record_bytes, t.values_clamped) == (2, 1, 4 * 2 + 12, 4)
    assert (u.storage_dtype, u.record_bytes, u.values_clamped, u.disk_bytes) == (1, 4 * 4 * 2 + 8, 0, 0)
    assert t.bytes_per_resident_row < u.bytes_per_resident_row


def test_initial_rows_read_as_stored_whether_stored_or_not() -> None:
    from ps.table import Lifecycle

    spec = TableSpec("t", 16, seed=5, storage_dtype="bfloat16", lifecycle=Lifecycle(admit_after=3))
    keys = np.array([10, 20, 30])
    want = precision.decode(
        "bfloat16", precision.encode_nearest("bfloat16", initial_rows(spec.initializer, 5, keys, 16))
    )
    table = Table(spec)
    first = table.lookup(keys)  # not admitted yet: read, not stored
    assert len(table) == 0
    table.lookup(keys), table.lookup(keys)
    assert len(table) == 3
    assert np.array_equal(first, want) and np.array_equal(table.lookup(keys), want)


def test_16_bit_rows_spill_and_come_back_bit_for_bit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = TableSpec("t", 8, optimizer=ADAGRAD, seed=2, storage_dtype="bfloat16", state_dtype="bfloat16")
    keys = np.arange(500, dtype=np.int64) * 7919
    rng = np.random.default_rng(3)
    with Storage(tmp_path, shard=0, num_shards=1) as st:
        st.save_spec("t", b"")
        table = Table(spec, rows=st.table("t", spec.row_format), storage=st)
        table.push(keys, rng.standard_normal((500, 8)).astype(np.float32))
        _, before = table.peek_rows(keys)
        assert table.evict(500) == 500 and len(table) == 0
        grads = rng.standard_normal((500, 8)).astype(np.float32)
        twin = Table(spec)
        twin.install_rows(before)
        table.push(keys, grads)  # faulted in: values, state and version as they left
        twin.push(keys, grads)
        assert np.array_equal(table.lookup(keys).view(np.uint32), twin.lookup(keys).view(np.uint32))


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shards", [1, 2])
def test_16_bit_wire_lookups_read_exactly_what_float32_ones_do(stored: str, shards: int) -> None:
    """A 16-bit table's rows travel as their own bits (gathered straight into the reply);
    other combinations are rounded to the wire type as before."""
    from client import ClientConfig, PSClient
    from ps.shard import Shard
    from tests.fakes import InProcessTransport

    transport = InProcessTransport([Shard(i, shards) for i in range(shards)])
    addresses = [f"inproc:{i}" for i in range(shards)]
    rng = np.random.default_rng(4)
    keys = rng.integers(0, 2**40, 3000)
    keys = np.concatenate([keys, keys[:100]])  # repeats: the client scatters them
    with PSClient(addresses, transport=transport) as ps:
        ps.create_table("t", 8, optimizer="adagrad", storage_dtype=stored)
        ps.push("t", keys, rng.standard_normal((keys.shape[0], 8)).astype(np.float32))
        exact = ps.lookup("t", keys)
        for wire_type in ("bfloat16", "float16"):
            with PSClient(addresses, ClientConfig(transport_dtype=wire_type), transport=transport) as narrow:  # type: ignore[arg-type]
                got = narrow.lookup("t", keys)
            want = precision.decode(wire_type, precision.encode_nearest(wire_type, exact))
            if wire_type == stored:
                assert np.array_equal(want, exact)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (stored, wire_type)


# -- 8-bit rows on serving shards -----------------------------------------------------------


def test_8_bit_rows_decode_within_half_a_step_of_their_values() -> None:
    rng = np.random.default_rng(6)
    rows = (rng.standard_normal((2000, 64)) * rng.choice([1e-4, 0.05, 3.0], (2000, 1))).astype(np.float32)
    rows[0] = 0.25  # a constant row is exact
    codes, params = precision.quantize(rows)
    back = precision.dequantize(codes, params)
    err = np.abs(back.astype(np.float64) - rows)
    bound = params[:, :1].astype(np.float64) / 2 + 4 * np.finfo(np.float32).eps * np.abs(rows).max(
        axis=1, keepdims=True
    )
    assert (err <= bound).all(), float((err - bound).max())
    assert np.array_equal(back[0], rows[0]) and codes.dtype == np.uint8


def test_an_8_bit_serving_table_holds_quantized_rows_and_no_optimizer_state() -> None:
    from ps.errors import InvalidRequest
    from ps.shard import Shard

    spec = TableSpec("t", 16, optimizer=ADAGRAD, seed=3, storage_dtype="int8")
    fmt = spec.row_format
    assert (fmt.state_width, fmt.versioned, fmt.record_bytes) == (2, False, 16 + 8 + 8)
    table = Table(spec)
    keys = np.arange(100)
    values = np.random.default_rng(1).standard_normal((100, 16)).astype(np.float32)
    table.assign(keys, values)  # as a follower applies its training shard's rows
    want = precision.dequantize(*precision.quantize(values))
    assert np.array_equal(table.lookup(keys, create=False).view(np.uint32), want.view(np.uint32))
    bf16 = precision.encode_nearest("bfloat16", values)  # rows that travel as bfloat16 bits
    table.assign(keys, bf16)
    want = precision.dequantize(*precision.quantize(precision.decode("bfloat16", bf16)))
    assert np.array_equal(table.lookup(keys, create=False), want)
    unknown = initial_rows(spec.initializer, 3, np.array([500]), 16)
    got = table.lookup(np.array([500]))  # a new row reads as its initial row, quantized
    assert np.array_equal(got, precision.dequantize(*precision.quantize(unknown)))
    assert table.bytes_per_row < Table(TableSpec("u", 16, optimizer=ADAGRAD)).bytes_per_row / 3
    with pytest.raises(InvalidRequest, match="int8 is for serving shards"):
        Shard(0, 1).create_table(spec)


def test_a_trainer_scores_with_rows_exactly_as_serving_shards_return_them() -> None:
    """``as_served`` (what ``eval_serve_dtype`` reads) is the serving shard's own conversion."""
    from protos.rowtypes import as_served
    from worker.config import TrainerConfig

    rows = np.random.default_rng(8).standard_normal((300, 16)).astype(np.float32)
    spec = TableSpec("t", 16, storage_dtype="int8")
    table = Table(spec)
    table.assign(np.arange(300), rows)
    assert np.array_equal(as_served("int8", rows).view(np.uint32), table.lookup(np.arange(300)).view(np.uint32))
    for kind in ("bfloat16", "float16"):
        half = Table(TableSpec("h", 16, storage_dtype=kind))
        half.assign(np.arange(300), rows)
        assert np.array_equal(as_served(kind, rows), half.lookup(np.arange(300)))
    with pytest.raises(ValueError, match="eval_serve_dtype='int4'"):
        TrainerConfig(eval_serve_dtype="int4")
