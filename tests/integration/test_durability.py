"""Durability guarantees on real shard processes: killed mid-stream, restarted on the
same data dir, data dir shared by mistake (disk full: ``test_disk_full.py``).

The push accounting is bit-exact: each push adds exactly +1 to the rows it touches
(see ``durability_util``), so after a restart a row tells how many pushes it holds.
A push the client saw acknowledged must be there (none lost), and resending any
``(client_id, seq)`` after the restart must never apply it a second time.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt

from client import PSClient
from tests.integration.durability_util import (
    DIM,
    NUM_KEYS,
    TABLE,
    Pusher,
    counts_of,
    run_to_exit,
)
from tests.integration.shards import RunningShard, start_shard, stop_shard

Push = tuple[str, int]


def start(procs: list[RunningShard], root: Path, *args: str) -> RunningShard:
    shard = start_shard(0, 1, root, *args)
    procs.append(shard)
    return shard


def kill(shard: RunningShard) -> None:
    shard.proc.kill()
    shard.proc.wait()


def create_counting_table(address: str) -> None:
    with PSClient([address]) as ps:
        ps.create_table(TABLE, DIM, optimizer="sgd", initializer="zeros", lr=1.0)


def row_counts(address: str) -> npt.NDArray[np.float32]:
    """Value of each of the ``NUM_KEYS`` rows (all columns of a row are equal by construction)."""
    with PSClient([address]) as ps:
        rows = ps.lookup(TABLE, np.arange(NUM_KEYS))
    assert (rows == rows[:, :1]).all(), f"a row's columns differ, so some push was half applied:\n{rows}"
    return rows[:, 0].copy()


def assert_exact(actual: npt.NDArray[np.float32], expected: npt.NDArray[np.float32], what: str) -> None:
    lost = int(np.clip(expected - actual, 0, None).sum())
    extra = int(np.clip(actual - expected, 0, None).sum())
    bad = np.flatnonzero(actual != expected)
    assert lost == 0 and extra == 0, (
        f"{what}: {lost} row updates lost, {extra} applied twice (or never sent); "
        f"keys {bad[:10].tolist()}: got {actual[bad[:10]].tolist()}, expected {expected[bad[:10]].tolist()}"
    )


def resend_acknowledged(pusher: Pusher, pushes: list[Push], what: str) -> None:
    """Every push in ``pushes`` was applied before: a resend must say so."""
    again = [p for p in pushes if pusher.push(*p)]
    assert not again, (
        f"{what}: {len(again)} of {len(pushes)} applied pushes were applied again on resend "
        f"(the shard forgot it had applied them): {again}"
    )


# -- 1. every-push: SIGKILL mid-stream ----------------------------------------------------


@dataclass
class Stream:
    """One client pushing seq 1, 2, 3, ... one at a time until the shard dies."""

    client: str
    next_seq: int = 1
    acked: list[int] = field(default_factory=list)
    in_flight: int | None = None
    failure: str = ""
    anomalies: list[str] = field(default_factory=list)

    def run(self, pusher: Pusher, stop: threading.Event) -> None:
        while not stop.is_set():
            seq = self.next_seq
            self.next_seq += 1
            try:
                applied = pusher.push(self.client, seq)
            except grpc.RpcError as exc:
                # Sent (maybe applied, maybe not) or never sent: either way unacknowledged.
                self.in_flight, self.failure = seq, f"{exc.code()}: {exc.details()}"
                return
            if applied:
                self.acked.append(seq)
            else:
                self.anomalies.append(f"{self.client} seq {seq}: applied=False on its first send")


def test_sigkill_during_every_push_stream_loses_and_repeats_nothing(tmp_path: Path, procs: list[RunningShard]) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    data = tmp_path / "data"
    args = (f"--data-dir={data}", "--durability=every-push")
    shard = start(procs, tmp_path, *args)
    create_counting_table(shard.address)
    streams = [Stream(f"w{i}") for i in range(3)]
    applied: list[Push] = []  # every push known to be applied exactly once so far

    for round_no in range(3):
        where = f"seed {seed}, round {round_no}"
        stop = threading.Event()
        pushers = [Pusher(shard.address) for _ in streams]
        threads = [threading.Thread(target=s.run, args=(p, stop), daemon=True) for s, p in zip(streams, pushers)]
        start_acked = sum(len(s.acked) for s in streams)
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while sum(len(s.acked) for s in streams) < start_acked + 30 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            kill(shard)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            for p in pushers:
                p.close()
        assert not any(t.is_alive() for t in threads), f"{where}: a pushing thread hung after the kill"
        for s in streams:
            assert not s.anomalies, f"{where}: {s.anomalies}"
            assert s.in_flight is not None, f"{where}: {s.client} was never interrupted by the kill"
        acked_now = sum(len(s.acked) for s in streams) - start_acked
        assert acked_now >= 30, f"{where}: only {acked_now} pushes acknowledged before the kill"

        shard = start(procs, tmp_path, *args)
        resolved = {(s.client, q) for s in streams for q in s.acked} | set(applied)
        before = row_counts(shard.address)
        in_flight: list[Push] = [(s.client, s.in_flight) for s in streams if s.in_flight is not None]
        # (a) nothing acknowledged is lost ...
        missing = int(np.clip(counts_of(sorted(resolved)) - before, 0, None).sum())
        assert missing == 0, f"{where}: acknowledged pushes lost by SIGKILL in every-push mode: {missing} row updates"
        with Pusher(shard.address) as pusher:
            # (b) acknowledged pushes are remembered by the restarted shard ...
            resend_acknowledged(pusher, [(s.client, q) for s in streams for q in s.acked[-3:]], where)
            # ... and the in-flight ones apply now exactly when they had not reached disk.
            persisted = [p for p in in_flight if not pusher.push(*p)]
            # (a) ... and the restarted rows hold every acknowledged push plus exactly
            # the in-flight pushes the shard's ledger says it had applied: nothing
            # doubled, and rows and ledger agree.
            expected = counts_of(sorted(resolved) + persisted)
            assert_exact(
                before, expected, f"{where}: rows after restart vs acknowledged + persisted in-flight {persisted}"
            )
            applied = sorted(resolved | set(in_flight))
            assert_exact(row_counts(shard.address), counts_of(applied), f"{where}: rows after resending in-flight")
            resend_acknowledged(pusher, in_flight, f"{where}: in-flight pushes resent twice")
        for s in streams:
            s.acked, s.in_flight, s.failure = [*s.acked, *([s.in_flight] if s.in_flight else [])], None, ""
    stop_shard(shard)


def test_sigkill_keeps_every_row_a_lookup_showed_in_every_push_mode(tmp_path: Path, procs: list[RunningShard]) -> None:
    # A row a lookup created was served (to workers, and to followers, whose table reads
    # zeros for a key without a row): in every-push mode it is on disk before that.
    data = tmp_path / "data"
    shard = start(procs, tmp_path, f"--data-dir={data}", "--durability=every-push")
    keys = np.arange(5000, dtype=np.int64) * 7919
    with PSClient([shard.address]) as ps:
        ps.create_table("seen", 8)  # random initial rows; serving_default zeros
        shown = np.concatenate([ps.lookup("seen", part) for part in np.array_split(keys, 5)])
        ps.push("seen", keys[:10], np.ones((10, 8), np.float32))
        shown[:10] = ps.lookup("seen", keys[:10])
    assert np.count_nonzero(shown.any(axis=1)) == keys.shape[0]
    kill(shard)

    serving = start(procs, tmp_path / "serve", "--mode=serve", f"--data-dir={data}")
    with PSClient([serving.address]) as ps:
        kept = ps.lookup("seen", keys)
    stop_shard(serving)
    lost = int(np.count_nonzero(~kept.any(axis=1)))
    assert lost == 0, f"{lost} of {keys.shape[0]} rows shown by lookups read as zeros after kill -9"
    np.testing.assert_array_equal(kept, shown)


# -- 2. interval:S: loss bounded by the interval ------------------------------------------


def test_interval_mode_keeps_everything_before_the_last_flush(tmp_path: Path, procs: list[RunningShard]) -> None:
    args = (f"--data-dir={tmp_path / 'data'}", "--durability=interval:1")
    shard = start(procs, tmp_path, *args)
    create_counting_table(shard.address)
    clients = [f"c{i}" for i in range(3)]
    phase_a: list[Push] = [(c, q) for q in range(1, 9) for c in clients]
    phase_b: list[Push] = [(c, q) for q in range(9, 17) for c in clients]
    with Pusher(shard.address) as pusher:
        refused = [p for p in phase_a if not pusher.push(*p)]
        assert not refused, f"fresh pushes reported as duplicates: {refused}"
    pushed_a = time.time()
    time.sleep(1.5)
    with PSClient([shard.address]) as ps:
        deadline = time.monotonic() + 20
        while ps.admin.stats()[0]["last_durable_unix_s"] < pushed_a:
            assert time.monotonic() < deadline, "interval:1: no flush started within 21 s of the last push"
            time.sleep(0.05)
    with Pusher(shard.address) as pusher:
        refused = [p for p in phase_b if not pusher.push(*p)]
        assert not refused, f"fresh pushes reported as duplicates: {refused}"
    kill(shard)

    shard = start(procs, tmp_path, *args)
    before = row_counts(shard.address)
    floor, ceiling = counts_of(phase_a), counts_of(phase_a + phase_b)
    assert (before >= floor).all(), (
        f"interval:1 lost pushes acknowledged before the last flush: "
        f"{int(np.clip(floor - before, 0, None).sum())} row updates missing"
    )
    assert (before <= ceiling).all(), f"rows above every push ever sent: {before} > {ceiling}"
    with Pusher(shard.address) as pusher:
        resend_acknowledged(pusher, phase_a[-6:], "interval:1, pushes flushed before the kill")
        persisted = [p for p in phase_b if not pusher.push(*p)]
        # The rows on disk are a consistent cut, exactly the pushes their ledger lists:
        # this table is small (one write batch per flush) and nothing is spilled.
        assert_exact(before, counts_of(phase_a + persisted), f"interval:1 restart vs flushed + ledgered {persisted}")
        assert_exact(row_counts(shard.address), ceiling, "interval:1 after resending every later push")
        resend_acknowledged(pusher, phase_b, "interval:1, later pushes resent twice")
    stop_shard(shard)


# -- 3. one process per data dir, and only its own shard's ----------------------------------


def test_data_dir_is_locked_and_keeps_its_shard_identity(tmp_path: Path, procs: list[RunningShard]) -> None:
    data = tmp_path / "data"
    shard = start(procs, tmp_path, f"--data-dir={data}")
    create_counting_table(shard.address)

    began = time.monotonic()
    code, out = run_to_exit(tmp_path, "--shard=0", "--num-shards=1", f"--data-dir={data}")
    took = time.monotonic() - began
    assert code not in (0, -9), f"second process on a data dir in use exited {code}:\n{out[-2000:]}"
    assert "in use" in out and str(shard.proc.pid) in out, (
        f"no 'in use by pid {shard.proc.pid}' message:\n{out[-2000:]}"
    )
    assert took < 30, f"second process took {took:.1f}s to give up"
    assert row_counts(shard.address).sum() == 0, "the first shard stopped serving"
    stop_shard(shard)

    code, out = run_to_exit(tmp_path, "--shard=1", "--num-shards=2", f"--data-dir={data}")
    assert code not in (0, -9), f"shard 1 of 2 on shard 0 of 1's data dir exited {code}:\n{out[-2000:]}"
    assert "holds shard 0 of 1" in out, f"message does not name the stored identity:\n{out[-2000:]}"

    shard = start(procs, tmp_path, f"--data-dir={data}")  # the rightful owner still starts
    stop_shard(shard)


# -- 4. disk full: see test_disk_full.py (every durability mode, space returning, rescue dumps)


# -- 5. a restarted shard serves its spilled rows bit-exactly ---------------------------------


def test_restart_serves_spilled_rows_bit_exactly(tmp_path: Path, procs: list[RunningShard]) -> None:
    args = (f"--data-dir={tmp_path / 'data'}", "--memory-budget-bytes=65536")
    shard = start(procs, tmp_path, *args)
    rng = np.random.default_rng(5)
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, size=4000, dtype=np.int64))
    with PSClient([shard.address]) as ps:
        ps.create_table("big", 8, optimizer="adagrad", lr=0.1, seed=3)
        for chunk in np.array_split(keys, 8):
            ps.lookup("big", chunk)
            ps.push("big", chunk, rng.standard_normal((chunk.shape[0], 8)).astype(np.float32))
        before = ps.lookup("big", keys)
        table = ps.admin.stats()[0]["tables"][0]
    assert table["spilled_rows"] > 0 and table["resident_rows"] < keys.shape[0], f"nothing spilled: {table}"
    stop_shard(shard)

    shard = start(procs, tmp_path, *args)
    with PSClient([shard.address]) as ps:
        after = ps.lookup("big", keys)
        table = ps.admin.stats()[0]["tables"][0]
    mismatched = int((before.view(np.uint32) != after.view(np.uint32)).any(axis=1).sum())
    assert mismatched == 0, f"{mismatched} of {keys.shape[0]} rows differ after restart"
    assert table["rows_created"] == 0, f"{table['rows_created']} rows were re-initialised after restart: {table}"
    stop_shard(shard)


def test_row_counts_read_back_from_disk_say_they_are_estimates(tmp_path: Path, procs: list[RunningShard]) -> None:
    from tests.integration.test_admin import ps_admin

    args = (f"--data-dir={tmp_path / 'data'}", "--durability=every-push")
    shard = start(procs, tmp_path, *args)
    with PSClient([shard.address]) as ps:
        ps.create_table("t", 4, optimizer="sgd")
        ps.push("t", np.arange(500), np.ones((500, 4), np.float32))
        assert ps.admin.stats()[0]["tables"][0]["rows_estimated"] is False  # counted as made: exact
    assert "~" not in ps_admin("stats", "--addresses", shard.address, cwd=tmp_path).stdout
    stop_shard(shard)

    shard = start(procs, tmp_path, *args)
    with PSClient([shard.address]) as ps:
        assert ps.admin.stats()[0]["tables"][0]["rows_estimated"] is True
    printed = ps_admin("stats", "--addresses", shard.address, cwd=tmp_path).stdout
    header, row = (
        next(line for line in printed.splitlines() if cond(line))
        for cond in (lambda line: line.startswith("shard"), lambda line: line.startswith("0/1") and " t " in line)
    )
    assert row.split()[header.split().index("rows")].startswith("~") and "RocksDB's estimate" in printed, printed
    stop_shard(shard)
