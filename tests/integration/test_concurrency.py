"""Many clients on many threads against real shards: per-table locking keeps rows exact."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from client import PSClient
from ps.table import InitializerParams
from ps.table.initializers import initial_rows


def test_concurrent_pushes_and_lookups_lose_nothing(addresses: list[str]) -> None:
    threads, pushes, dim = 4, 40, 8
    hot = np.arange(20, dtype=np.int64)  # every thread pushes to the same rows
    with PSClient(addresses) as setup:
        setup.create_table("shared", dim, optimizer="sgd", lr=1.0, seed=3)
        setup.create_table("other", dim, optimizer="sgd", lr=1.0, seed=4)

    def work(t: int) -> np.ndarray:
        # Each thread has its own client (own client_id, own channels) and also creates
        # new rows that overlap with the other threads' new rows.
        with PSClient(addresses) as ps:
            fresh = np.arange(1000 + 100 * t, 1300 + 100 * t, dtype=np.int64)
            for i in range(pushes):
                ps.push_many(
                    {
                        "shared": (hot, np.ones((20, dim), np.float32)),
                        "other": (fresh[i::pushes], np.full((len(fresh[i::pushes]), dim), 0.5, np.float32)),
                    }
                )
                ps.lookup_many({"shared": hot, "other": fresh})
            return ps.lookup("other", fresh)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))

    # Subtracting 1.0 gives the same float32 sequence whatever the interleaving.
    expected = initial_rows(InitializerParams(), 3, hot, dim)
    for _ in range(threads * pushes):
        expected = expected - np.float32(1.0)
    with PSClient(addresses) as ps:
        np.testing.assert_array_equal(ps.lookup("shared", hot), expected)
        # "other": key k was pushed once (0.5) by each thread whose range covers it.
        keys = np.arange(1000, 1600, dtype=np.int64)
        covering = np.array([sum(1000 + 100 * t <= k < 1300 + 100 * t for t in range(threads)) for k in keys])
        want = initial_rows(InitializerParams(), 4, keys, dim) - 0.5 * covering[:, None].astype(np.float32)
        np.testing.assert_allclose(ps.lookup("other", keys), want, rtol=0, atol=1e-6)
        stats = ps.admin.stats()
        assert sum(s["tables"][1]["rows"] for s in stats) == 20  # "shared" sorted after "other"
        assert sum(s["tables"][0]["rows"] for s in stats) == 600  # one row per key, never two
