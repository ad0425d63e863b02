"""A grow whose new shard's disk fills up: `ps-admin scale` says so in one line at once,
instead of waiting for its deadline; nothing acknowledged is lost; the cluster stays where
it was; once the shard has space again the same command finishes the move.

The "disk" is the new shard's ``RLIMIT_FSIZE`` (a write past it fails with EFBIG, as a full
disk fails with ENOSPC); the restarted shard has none.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client import ClientConfig, PSClient
from deploy import local
from protos.keys import shard_of
from ps.store import RowFormat, Storage
from tests.integration.durability_util import terminate
from tests.integration.shards import RunningShard, start_shard, stop_shard
from tests.integration.test_admin import ok, ps_admin

KEYS = (np.arange(20_000, dtype=np.int64) - 10_000) * 7919
DIM = 32
FAST = ClientConfig(backoff_initial_s=0.005, backoff_max_s=0.05, deadline_s=60.0, tune_malloc=False)
LIMIT = 512 * 1024  # the new shard's files: enough to start, far from the ~1 MB of rows it takes in


def shard_args(root: Path) -> tuple[str, ...]:
    return (f"--data-dir={root}/data-{{shard}}", "--durability=every-push", "--reshard-settle-s=1")


@pytest.fixture
def shards() -> Iterator[dict[int, RunningShard]]:
    running: dict[int, RunningShard] = {}
    yield running
    for shard in running.values():
        if shard.proc.poll() is None:
            shard.proc.kill()
            shard.proc.wait()


def test_a_full_disk_on_the_new_shard_fails_the_scale_fast_and_loses_nothing(
    tmp_path: Path, shards: dict[int, RunningShard]
) -> None:
    for i in range(2):
        shards[i] = start_shard(i, 2, tmp_path, *shard_args(tmp_path))
    old = [shards[i].address for i in range(2)]
    with PSClient(old, FAST, client_id="disk-full") as ps:
        ps.create_table("t", DIM, optimizer="adagrad", lr=0.1, seed=3)
        ps.lookup("t", KEYS)
        grads = np.random.default_rng(0).standard_normal((KEYS.size, DIM)).astype(np.float32)
        ps.push("t", KEYS, grads)
        before = ps.lookup("t", KEYS)
    shards[2] = local.start_shard(2, 3, tmp_path, *shard_args(tmp_path), file_size_limit_bytes=LIMIT)
    new = [*old, shards[2].address]

    began = time.monotonic()
    full = ps_admin("scale", "--addresses", ",".join(old), "--to", ",".join(new), "--timeout-s", "100", cwd=tmp_path)
    took = time.monotonic() - began
    assert full.returncode == 1, full.stdout + full.stderr
    assert "Traceback" not in full.stderr
    last = full.stderr.strip().splitlines()[-1]  # the lines before it say how the copies went
    assert last.startswith("ps-admin scale: ") and "disk refused" in last and shards[2].address in last, last
    assert "the cluster stays at epoch 0: 2 shards" in last, last
    assert took < 60, f"ps-admin scale waited {took:.0f}s for a copy that cannot be written"

    # Nothing acknowledged is lost, and the cluster still routes by its two shards.
    with PSClient(old, FAST, client_id="after") as ps:
        np.testing.assert_array_equal(ps.lookup("t", KEYS), before)
        assert ps.epoch == 0 and ps.num_shards == 2

    # The disk has space again and the shard restarts on its address (RocksDB stays read-only
    # after a failed write until it is opened again): the same command finishes the move.
    address = shards[2].address
    assert shards[2].proc.poll() is None, "the shard whose disk failed did not stay up to be asked"
    terminate(shards[2])
    shards[2] = start_shard(2, 3, tmp_path, *shard_args(tmp_path), listen=address)
    ok(ps_admin("scale", "--addresses", ",".join(old), "--to", ",".join(new), "--timeout-s", "300", cwd=tmp_path))
    with PSClient(new, FAST, client_id="grown") as ps:
        np.testing.assert_array_equal(ps.lookup("t", KEYS), before)
        assert ps.num_shards == 3
    for shard in shards.values():
        stop_shard(shard)
    with Storage(tmp_path / "data-2", shard=-1, num_shards=0, read_only=True) as st:
        keys = np.concatenate([part.keys for part in st.table("t", RowFormat(DIM, DIM)).scan()])
    np.testing.assert_array_equal(np.sort(keys), np.sort(KEYS[shard_of(KEYS, 3) == 2]))
