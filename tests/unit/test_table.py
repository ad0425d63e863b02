"""ps.table.Table: rows, counters, pushes, removal, export, growth and thread-safety.

Expected values come from ``initial_rows`` (the documented initializer) and from the
SGD / Adagrad formulas written out here, never from the table itself.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import numpy.typing as npt
import pytest

from ps.errors import InvalidRequest
from ps.table import InitializerParams, OptimizerKind, OptimizerParams, Table, TableSpec
from ps.table.initializers import initial_rows

F32 = npt.NDArray[np.float32]
DIM = 5  # not a power of two


def sgd_spec(lr: float = 0.1, dim: int = DIM, seed: int = 3) -> TableSpec:
    return TableSpec("t", dim, optimizer=OptimizerParams(OptimizerKind.SGD, lr=lr), seed=seed)


def keys_of(*ks: int) -> npt.NDArray[np.int64]:
    return np.array(ks, dtype=np.int64)


def initial(spec: TableSpec, keys: npt.ArrayLike) -> F32:
    return initial_rows(spec.initializer, spec.seed, keys, spec.dim)


def sgd_step(rows: F32, lr: float, grads: F32) -> F32:
    """``rows - lr*grads`` with one rounding (the kernel fuses the multiply-add).

    ``float32 * float32`` is exact in float64, and so is the sum for these magnitudes, so
    rounding the float64 result once to float32 is exactly the fused operation.
    """
    lr32 = np.float64(np.float32(lr))
    return (rows.astype(np.float64) - lr32 * grads.astype(np.float64)).astype(np.float32)


def snapshot(t: Table) -> dict[int, tuple[list[float], list[float]]]:
    rows = t.export()
    return {int(k): (v.tolist(), s.tolist()) for k, v, s in zip(rows.keys, rows.values, rows.state)}


# -- lookup -------------------------------------------------------------------------


def test_lookup_creates_initial_rows_and_counts() -> None:
    spec = TableSpec("t", DIM, initializer=InitializerParams(low=-1.0, high=2.0), seed=12345)
    t = Table(spec)
    keys = keys_of(10, -7, 10, 2**63 - 1, -(2**63), 0, -7)
    rows = t.lookup(keys)

    assert rows.dtype == np.float32 and rows.shape == (7, DIM)
    np.testing.assert_array_equal(rows, initial(spec, keys))
    assert len(t) == 5
    assert (t.counters.lookups, t.counters.rows_created, t.counters.pushes) == (7, 5, 0)

    again = t.lookup(keys_of(0, 10, 99))
    np.testing.assert_array_equal(again, initial(spec, keys_of(0, 10, 99)))
    assert len(t) == 6
    assert (t.counters.lookups, t.counters.rows_created) == (10, 6)


def test_lookup_writes_into_out() -> None:
    spec = sgd_spec()
    t = Table(spec)
    out = np.full((3, DIM), 7.0, dtype=np.float32)
    returned = t.lookup(keys_of(1, 2, 3), out=out)
    assert returned is out
    np.testing.assert_array_equal(out, initial(spec, keys_of(1, 2, 3)))


def test_lookup_without_create_reads_zeros_and_stores_nothing() -> None:
    spec = sgd_spec()
    t = Table(spec)
    t.lookup(keys_of(1, 2))
    before = snapshot(t)

    rows = t.lookup(keys_of(2, 50, 1, 51), create=False)

    np.testing.assert_array_equal(rows[[0, 2]], initial(spec, keys_of(2, 1)))
    np.testing.assert_array_equal(rows[[1, 3]], np.zeros((2, DIM), np.float32))
    assert len(t) == 2
    assert snapshot(t) == before
    assert t.counters.rows_created == 2
    assert t.counters.lookups == 6


def test_empty_lookup_and_push() -> None:
    t = Table(sgd_spec())
    assert t.lookup(keys_of()).shape == (0, DIM)
    assert t.push(keys_of(), np.zeros((0, DIM), np.float32)) == 0
    assert len(t) == 0


# -- push ---------------------------------------------------------------------------


def test_push_applies_sgd_exactly() -> None:
    spec = sgd_spec(lr=0.1)
    t = Table(spec)
    keys = keys_of(4, 8, 15)
    start = t.lookup(keys)
    grads = ((np.arange(3 * DIM).reshape(3, DIM) - 7) / 8).astype(np.float32)

    assert t.push(keys, grads) == 3

    expected = sgd_step(start, 0.1, grads)
    np.testing.assert_array_equal(t.lookup(keys), expected)
    assert t.counters.pushes == 3
    # A second push starts from the updated rows.
    t.push(keys[::-1], grads)
    np.testing.assert_array_equal(t.lookup(keys), sgd_step(expected, 0.1, grads[::-1]))


def test_push_sums_gradients_of_duplicate_keys() -> None:
    spec = sgd_spec(lr=0.5)
    t = Table(spec)
    keys = keys_of(5, 6, 5, 5)
    g = np.array([[1.0] * DIM, [2.0] * DIM, [0.25] * DIM, [4.0] * DIM], dtype=np.float32)
    start = t.lookup(keys_of(5, 6))

    assert t.push(keys, g) == 2  # distinct rows

    summed = np.stack([g[0] + g[2] + g[3], g[1]])
    np.testing.assert_array_equal(t.lookup(keys_of(5, 6)), sgd_step(start, 0.5, summed))
    assert t.counters.pushes == 2
    assert len(t) == 2


def test_push_creates_missing_rows_before_applying() -> None:
    spec = sgd_spec(lr=0.25)
    t = Table(spec)
    keys = keys_of(100, 200)
    g = np.ones((2, DIM), np.float32)

    assert t.push(keys, g) == 2

    assert len(t) == 2 and t.counters.rows_created == 2
    np.testing.assert_array_equal(t.lookup(keys), sgd_step(initial(spec, keys), 0.25, g))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_push_rejects_non_finite_gradients_and_changes_nothing(bad: float) -> None:
    t = Table(sgd_spec())
    t.lookup(keys_of(1, 2))
    before, counters = snapshot(t), (t.counters.pushes, t.counters.rows_created)
    g = np.zeros((3, DIM), np.float32)
    g[2, 3] = bad

    with pytest.raises(InvalidRequest, match=r"grads\[2\]\[3\]"):
        t.push(keys_of(1, 2, 3), g)  # key 3 is new: it must not be created either

    assert snapshot(t) == before
    assert len(t) == 2
    assert (t.counters.pushes, t.counters.rows_created) == counters


@pytest.mark.parametrize("shape", [(2, DIM), (3, DIM + 1), (3,), (3, DIM, 1)])
def test_push_rejects_wrong_shape_and_changes_nothing(shape: tuple[int, ...]) -> None:
    t = Table(sgd_spec())
    t.lookup(keys_of(1))
    before = snapshot(t)

    with pytest.raises(InvalidRequest, match=r"grads shape .*expected \(3, 5\)"):
        t.push(keys_of(1, 2, 3), np.ones(shape, np.float32))

    assert snapshot(t) == before
    assert len(t) == 1


# -- remove and slot reuse ------------------------------------------------------------


def test_remove_frees_rows_and_readd_gives_initial_row() -> None:
    spec = TableSpec(
        "t", DIM, optimizer=OptimizerParams(OptimizerKind.ADAGRAD, lr=0.5, initial_accumulator_value=0.25), seed=9
    )
    t = Table(spec)
    keys = keys_of(1, 2, 3)
    t.push(keys, np.ones((3, DIM), np.float32))
    assert not np.array_equal(t.lookup(keys), initial(spec, keys))

    assert t.remove(keys_of(2, 3, 77, 3)) == 2  # absent keys and repeats are ignored

    assert len(t) == 1
    assert sorted(t.export().keys.tolist()) == [1]
    # Re-created from scratch: the same initial row and a fresh optimizer state.
    np.testing.assert_array_equal(t.lookup(keys_of(2, 3)), initial(spec, keys_of(2, 3)))
    exported = t.export()
    state = {int(k): s for k, s in zip(exported.keys, exported.state)}
    np.testing.assert_array_equal(state[2], np.full(DIM, 0.25, np.float32))
    np.testing.assert_array_equal(state[3], np.full(DIM, 0.25, np.float32))
    assert len(t) == 3


def test_remove_readd_cycles_reuse_slots_and_memory_is_stable() -> None:
    spec = sgd_spec()
    t = Table(spec)  # 1024 buckets: 700 live keys fit, 1400 would force growth
    n = 700
    t.lookup(np.arange(n, dtype=np.int64))
    sizes = []
    for cycle in range(1, 11):
        old = np.arange((cycle - 1) * n, cycle * n, dtype=np.int64)
        new = np.arange(cycle * n, (cycle + 1) * n, dtype=np.int64)
        assert t.remove(old) == n
        rows = t.lookup(new)
        np.testing.assert_array_equal(rows, initial(spec, new))
        assert len(t) == n
        sizes.append(t.memory_bytes())
    # The first remove allocates the free list once; after that nothing grows.
    assert len(set(sizes)) == 1, sizes
    assert sorted(t.export().keys.tolist()) == list(range(10 * n, 11 * n))


# -- export ---------------------------------------------------------------------------


def test_export_returns_exactly_the_stored_rows_and_adagrad_state() -> None:
    spec = TableSpec("t", 3, optimizer=OptimizerParams(OptimizerKind.ADAGRAD, lr=0.1), seed=1)
    t = Table(spec)
    g1 = np.array([[0.5, -1.5, 2.0], [1.0, 0.25, -3.0]], np.float32)
    g2 = np.array([[1.5, 0.5, -0.75]], np.float32)
    t.push(keys_of(10, 20), g1)
    t.push(keys_of(10), g2)
    t.lookup(keys_of(30))  # created by a lookup: state is the initial accumulator (0)

    rows = t.export()

    rows = rows[np.argsort(rows.keys)]
    keys, values, state = rows.keys, rows.values, rows.state
    assert keys.tolist() == [10, 20, 30]
    # Every part of a row comes along: pushes do not count as uses, the lookup did.
    assert rows.frequency.tolist() == [0, 0, 1] and (rows.last_access > 0).all()
    assert values.dtype == np.float32 and state.dtype == np.float32
    # These squares and sums are exact in float32.
    expected_state = np.stack([g1[0] ** 2 + g2[0] ** 2, g1[1] ** 2, np.zeros(3, np.float32)])
    np.testing.assert_array_equal(state, expected_state)
    np.testing.assert_array_equal(values, t.lookup(keys))
    np.testing.assert_array_equal(values[2], initial(spec, keys_of(30))[0])

    # Copies: writing to them does not reach the table.
    values[:] = 0
    state[:] = 0
    assert float(np.abs(t.export().state).sum()) > 0
    np.testing.assert_array_equal(t.lookup(keys_of(30)), initial(spec, keys_of(30)))


def test_export_of_sgd_table_has_empty_state() -> None:
    t = Table(sgd_spec())
    t.lookup(keys_of(1, 2))
    rows = t.export()
    assert sorted(rows.keys.tolist()) == [1, 2]
    assert rows.values.shape == (2, DIM) and rows.state.shape == (2, 0)


# -- growth ---------------------------------------------------------------------------


def test_growth_through_many_doublings_keeps_every_row() -> None:
    spec = sgd_spec(lr=0.5)
    t = Table(spec, initial_capacity=4)
    rng = np.random.default_rng(0)
    all_keys = np.unique(rng.integers(-(2**63), 2**63 - 1, size=6000, dtype=np.int64))
    expected = {int(k): r for k, r in zip(all_keys, initial(spec, all_keys))}
    memory = [t.memory_bytes()]

    # Batches of very different sizes; each crosses zero, one or many doublings.
    start = 0
    for size in [1, 2, 3, 10, 50, 200, 1000, 3000, all_keys.size]:
        batch = all_keys[start : start + size]
        start += batch.size
        if not batch.size:
            break
        pushed = batch[::3]
        g = np.full((pushed.size, spec.dim), 2.0, np.float32)
        t.push(pushed, g)  # creates the pushed rows, may grow mid-batch
        for k in pushed.tolist():
            expected[k] = expected[k] - np.float32(1.0)
        t.lookup(batch)  # creates the rest
        memory.append(t.memory_bytes())

    assert len(t) == all_keys.size
    rows = t.export()
    keys, values = rows.keys, rows.values
    assert np.unique(keys).size == keys.size == all_keys.size
    np.testing.assert_array_equal(values, np.stack([expected[int(k)] for k in keys]))
    np.testing.assert_array_equal(t.lookup(all_keys), np.stack([expected[int(k)] for k in all_keys]))
    assert memory == sorted(memory) and memory[-1] > 100 * memory[0]


# -- threads --------------------------------------------------------------------------


def test_concurrent_pushes_and_lookups_match_a_sequential_run() -> None:
    spec = TableSpec(
        "t",
        DIM,
        initializer=InitializerParams(low=-1.0, high=1.0),
        optimizer=OptimizerParams(OptimizerKind.SGD, lr=1.0),
        seed=77,
    )
    t = Table(spec, initial_capacity=4)  # lookups force growth while pushes run
    hot = np.arange(10, dtype=np.int64)
    threads_n, pushes_n = 4, 50
    start = threading.Barrier(2 * threads_n)
    errors: list[BaseException] = []

    def pusher() -> None:
        try:
            start.wait()
            for _ in range(pushes_n):
                t.push(hot, np.ones((hot.size, DIM), np.float32))
        except BaseException as exc:  # surfaced by the main thread below
            errors.append(exc)

    looked_up: list[tuple[npt.NDArray[np.int64], F32]] = []

    def looker(i: int) -> None:
        try:
            start.wait()
            for j in range(pushes_n):
                # Windows of new keys overlapping between threads and iterations.
                keys = np.arange(1000 + 37 * j + 11 * i, 1000 + 37 * j + 11 * i + 60, dtype=np.int64)
                looked_up.append((keys, t.lookup(keys)))
        except BaseException as exc:
            errors.append(exc)

    # Daemon threads and one overall deadline: a corrupted index that loops forever fails
    # the test instead of hanging the run.
    workers = [threading.Thread(target=pusher, daemon=True) for _ in range(threads_n)]
    workers += [threading.Thread(target=looker, args=(i,), daemon=True) for i in range(threads_n)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 30
    for w in workers:
        w.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(w.is_alive() for w in workers), "threads still running after 30 s"
    assert not errors, errors

    # Sequential reference: 200 subtractions of 1.0 in float32, one at a time.
    expected = initial(spec, hot)
    for _ in range(threads_n * pushes_n):
        expected = expected - np.float32(1.0)
    np.testing.assert_array_equal(t.lookup(hot, create=False), expected)

    cold = np.unique(np.concatenate([k for k, _ in looked_up]))
    for keys, rows in looked_up:
        np.testing.assert_array_equal(rows, initial(spec, keys))
    keys = t.export().keys
    assert keys.size == np.unique(keys).size == len(t) == hot.size + cold.size
    assert sorted(keys.tolist()) == sorted(hot.tolist() + cold.tolist())
    assert t.counters.pushes == threads_n * pushes_n * hot.size
    assert t.counters.rows_created == len(t)
