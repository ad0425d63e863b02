"""Quickstart: start 2 shards, create a table, look rows up, push gradients, look again.

    python examples/quickstart.py

Everything runs on 127.0.0.1 and is stopped at the end.
"""

from __future__ import annotations

import numpy as np

from client import PSClient
from deploy import LocalCluster


def main() -> None:
    np.set_printoptions(precision=4, suppress=True, linewidth=100)
    with LocalCluster(num_shards=2) as cluster:
        print(f"started 2 shards: {', '.join(cluster.addresses)}")
        with PSClient(cluster.addresses) as ps:
            table = ps.create_table("user", dim=4, optimizer="adagrad", lr=0.1, seed=7)
            print(
                f"created table {table.name!r}: dim={table.dim} optimizer={table.optimizer} lr={table.optimizer_params['lr']}"
            )

            keys = np.array([101, 202, 303, 101])
            before = ps.lookup("user", keys)
            print(f"\nlookup keys {keys.tolist()} (new keys get their deterministic initial rows):\n{before}")

            grads = np.ones((4, 4), dtype=np.float32)
            result = ps.push("user", keys, grads)
            print(f"\npushed gradients of ones: {result.rows_updated} distinct rows updated (key 101 twice: summed)")

            after = ps.lookup("user", keys)
            print(f"\nlookup again; change per row (Adagrad, lr=0.1):\n{after - before}")

            for s in ps.admin.stats():
                t = s["tables"][0]
                print(f"shard {s['shard']}: {t['rows']} rows, {t['lookups']} keys looked up, {t['pushes']} rows pushed")
    print("\nstopped both shards")


if __name__ == "__main__":
    main()
