"""``client.batching``: the compiled plan of a table's keys routes as the separate steps do."""

from __future__ import annotations

import numpy as np
import pytest

from client.batching import dedup, fill_rows, group, plan_keys
from protos.keys import shard_of


@pytest.mark.parametrize("num_shards", [1, 2, 7, 64])
@pytest.mark.parametrize("n", [0, 1, 2600, 20_000])
def test_the_compiled_plan_equals_dedup_then_grouping_by_shard(num_shards: int, n: int) -> None:
    # plan_keys fuses dedup, shard_of and the stable grouping into one compiled call; it
    # must route every key exactly as the separate steps (and every other client) do.
    keys = np.random.default_rng(n + num_shards).integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64)
    keys = np.concatenate([keys, keys[: n // 3]])  # duplicates
    unique, inverse, order, bounds, slots = plan_keys(keys, num_shards)
    want_unique, want_inverse = dedup(keys)
    want_order, want_bounds = group(shard_of(want_unique, num_shards), num_shards)
    assert unique.tolist() == want_unique.tolist()
    assert inverse.tolist() == want_inverse.tolist()
    assert order.tolist() == want_order.tolist()
    assert bounds.tolist() == want_bounds.tolist()
    assert (unique[inverse] == keys).all()
    for s in range(num_shards):
        assert (shard_of(unique[order[bounds[s] : bounds[s + 1]]], num_shards) == s).all()
    assert (order[slots] == inverse).all()  # each key's row sits at its slot of the routed order


@pytest.mark.parametrize("num_shards", [1, 3])
def test_answers_fill_every_position_that_asked_duplicates_included(num_shards: int) -> None:
    rng = np.random.default_rng(num_shards)
    keys = rng.integers(0, 50, 300, dtype=np.int64)  # many duplicates
    unique, _, order, bounds, slots = plan_keys(keys, num_shards)
    row_of = {int(k): np.full(4, float(k), np.float32) for k in unique}  # a row that names its key
    out = np.full((keys.shape[0], 4), -1.0, np.float32)
    for s in range(num_shards):  # one answer per shard: its unique keys' rows, in routed order
        answer = np.array([row_of[int(k)] for k in unique[order[bounds[s] : bounds[s + 1]]]], np.float32)
        fill_rows(out, answer.reshape(-1, 4), slots, int(bounds[s]))
    np.testing.assert_array_equal(out, np.repeat(keys.astype(np.float32)[:, None], 4, axis=1))
