"""Runs ``tests.unit.tier_model``'s state machine against the tier, plus the regressions it found.

The machine tests are marked ``slow``: a plain run uses the short profile (well under a
minute), ``pytest -m slow`` the long one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

import ps.shard.budget
import ps.table.table
from ps.durability import Durability
from ps.shard import Shard
from ps.store import Storage
from ps.table import Lifecycle, TableSpec
from ps.table.lifecycle import TICKS_PER_S
from tests.profiles import long_run
from tests.unit.tier_model import LIFECYCLE_SPECS, LONG, MODES, SHORT, SPECS, Clock, Mode, TierMachine


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    for module in (ps.table.table, ps.shard.budget):
        monkeypatch.setattr(module, "now_tick", clock)
    return clock


@pytest.fixture
def profile(request: pytest.FixtureRequest) -> settings:
    return LONG if long_run(request.config) else SHORT


@pytest.fixture
def data_root(tmp_path: Path) -> Iterator[Path]:
    """Where the machine's data directories go: a tmpfs when there is one. Each example
    opens, checkpoints and deletes a few RocksDB directories; on a disk, the file system
    calls take longer than the test itself. One example uses well under a MiB."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 256 << 20:
        root = Path(tempfile.mkdtemp(prefix="ps-tier-model-", dir=shm))
        try:
            yield root
        finally:
            shutil.rmtree(root, ignore_errors=True)
    else:
        yield tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_tier_matches_model(mode: Mode, data_root: Path, clock: Clock, profile: settings) -> None:
    run_state_machine_as_test(lambda: TierMachine(mode, SPECS, data_root, clock), settings=profile)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [MODES[1], MODES[3]], ids=str)
def test_tier_with_rare_row_deletion_matches_model(
    mode: Mode, data_root: Path, clock: Clock, profile: settings
) -> None:
    # "tag" deletes, instead of spilling, rows looked up fewer than twice.
    run_state_machine_as_test(lambda: TierMachine(mode, LIFECYCLE_SPECS, data_root, clock), settings=profile)


def start_shard(data_dir: Path, spec: TableSpec) -> Shard:
    shard = Shard(0, 1, Storage(data_dir, shard=0, num_shards=1), Durability("checkpoint-only"))
    shard.create_table(spec)
    return shard


def test_lookup_counts_survive_a_clean_restart(data_root: Path) -> None:
    """Regression (found by the rare-row machine): flush, checkpoint and shutdown wrote
    dirty rows only, and a lookup does not make a row dirty, so after a clean restart a
    row looked up three times, in a table with ``evict_below_frequency=3``, counted one
    lookup and was deleted at its next eviction."""
    spec = TableSpec("t", 2, lifecycle=Lifecycle(evict_below_frequency=3))
    d, key = data_root / "data", np.array([7], np.int64)
    shard = start_shard(d, spec)
    try:
        table = shard.table("t")
        table.lookup(key)  # created, looked up once: dirty
        shard.flush()  # written; clean
        table.lookup(key)
        table.lookup(key)  # looked up three times; the row is still clean
    finally:
        shard.shutdown()
    shard = start_shard(d, spec)
    try:
        table = shard.table("t")
        table.push(key, np.ones((1, 2), np.float32))  # faults the row in; a push is not a lookup
        table.evict(1)
        assert table.counters.rows_evicted_rare == 0, (
            "a row looked up 3 times was deleted as looked up fewer than 3 times"
        )
        assert table.export().keys.tolist() == [7]
    finally:
        shard.shutdown()


def test_access_times_survive_a_clean_restart(data_root: Path, clock: Clock) -> None:
    """Regression, same cause: a row written at T0 and looked up again at T0 + 50 s was
    expired at T0 + 70 s with a 60 s TTL after a clean restart."""
    spec = TableSpec("t", 2, lifecycle=Lifecycle(ttl_seconds=60))
    d, key = data_root / "data", np.array([7], np.int64)
    clock.tick = t0 = 1 << 20
    shard = start_shard(d, spec)
    try:
        table = shard.table("t")
        table.lookup(key)
        shard.flush()  # written with last access T0; clean
        clock.tick = t0 + 50 * TICKS_PER_S
        table.lookup(key)  # used again; the row is still clean
    finally:
        shard.shutdown()
    shard = start_shard(d, spec)
    try:
        table = shard.table("t")
        assert table.expire(np.uint32(t0 + 70 * TICKS_PER_S)) == 0, "a row idle for 20 s expired with a 60 s TTL"
        assert table.export().keys.tolist() == [7]
    finally:
        shard.shutdown()
