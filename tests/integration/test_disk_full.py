"""No acknowledged push is lost to a full disk, in any durability mode (real shard
processes, real RocksDB).

The "disk" is the shard's ``RLIMIT_FSIZE``: past it, a write fails with EFBIG just as
it fails with ENOSPC on a full filesystem (RocksDB's write-ahead log hits it first).
"Freeing space" lifts the limit from the test process with ``prlimit`` while the
shard runs. The push accounting is bit-exact (every push adds +1 to each row it
touches), so a restarted shard's rows say exactly which pushes they hold.

Figures (acknowledged before the disk filled, in total, and found after the
restart) are printed with ``pytest -s``.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from grpc_health.v1 import health_pb2

from client import PSClient
from deploy.local import ShardProcess, ShardStartError
from protos import ps_pb2 as pb
from tests.integration.durability_util import Pusher, health_status, set_file_size_limit, spawn_shard, terminate
from tests.integration.shards import stop_shard

WRITES = "ps.v1.ParameterServer.Writes"
BACKGROUND = "ps.v1.ParameterServer.Background"
TABLE, DIM = "wide", 16
NUM_KEYS, KEYS_PER_PUSH = 8192, 512
LIMIT_BYTES = 1 << 20  # the "disk": no file of the shard may grow past 1 MiB
MODES = ["every-push", "interval:0.2", "checkpoint-only"]
Push = tuple[str, int]


def keys_of(client: str, seq: int) -> npt.NDArray[np.int64]:
    """The keys push ``(client, seq)`` touches: 512, or 64 for client "small"."""
    rng = np.random.default_rng([*client.encode(), seq])
    size = 64 if client == "small" else KEYS_PER_PUSH
    return np.sort(rng.choice(NUM_KEYS, size=size, replace=False)).astype(np.int64)


def counts_of(pushes: list[Push]) -> npt.NDArray[np.float32]:
    counts = np.zeros(NUM_KEYS, dtype=np.float32)
    for client, seq in pushes:
        counts[keys_of(client, seq)] += 1
    return counts


def row_counts(address: str) -> npt.NDArray[np.float32]:
    with PSClient([address]) as ps:
        rows = ps.lookup(TABLE, np.arange(NUM_KEYS))
    assert (rows == rows[:, :1]).all(), "a row's columns differ: some push was half applied"
    return rows[:, 0].copy()


def lost_and_extra(actual: npt.NDArray[np.float32], pushes: list[Push]) -> tuple[int, int]:
    expected = counts_of(pushes)
    return int(np.clip(expected - actual, 0, None).sum()), int(np.clip(actual - expected, 0, None).sum())


def stats(address: str) -> dict:  # type: ignore[type-arg]
    with PSClient([address]) as ps:
        return ps.admin.stats()[0]


def checkpoint(address: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/ps.v1.ParameterServer/Checkpoint", None, pb.CheckpointResponse.FromString)
        try:
            call(pb.CheckpointRequest().SerializeToString(), timeout=60)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def start(procs: list[ShardProcess], root: Path, *args: str, limit: int | None = None) -> ShardProcess:
    shard = spawn_shard(root, "shard", *args, fsize_limit_bytes=limit)
    procs.append(shard)
    return shard


def create_table(address: str) -> None:
    with PSClient([address]) as ps:
        ps.create_table(TABLE, DIM, optimizer="sgd", initializer="zeros", lr=1.0)


def push_all(address: str, pushes: list[Push]) -> None:
    with Pusher(address, table=TABLE, dim=DIM) as pusher:
        for p in pushes:
            assert pusher.push(*p, keys_of(*p)), f"fresh push {p} reported as a duplicate"


def push_until_refused(shard: ShardProcess, mode: str, client: str) -> tuple[list[Push], Push]:
    """Push until the shard refuses because its storage failed; returns the acknowledged
    pushes and the refused one (never applied)."""
    acked: list[Push] = []
    with Pusher(shard.address, table=TABLE, dim=DIM) as pusher:
        for seq in range(1, 2000):
            if mode == "checkpoint-only" and seq == 5:
                # Nothing is written in this mode until a checkpoint, a spill or the stop.
                assert checkpoint(shard.address) == grpc.StatusCode.UNAVAILABLE, "the checkpoint fit the disk"
            try:
                assert pusher.push(client, seq, keys_of(client, seq)), f"fresh push {seq} reported as a duplicate"
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, f"{exc.code()}: {exc.details()}"
                assert "storage" in (exc.details() or ""), exc.details()
                return acked, (client, seq)
            acked.append((client, seq))
            if mode.startswith("interval"):
                time.sleep(0.02)  # let the background flushes run between pushes
    pytest.fail(f"{mode}: the shard never refused a push on a full disk")


def wait_for_writes(address: str, status: int, timeout_s: float) -> float:
    began = time.monotonic()
    while health_status(address, WRITES) != status:
        assert time.monotonic() - began < timeout_s, f"Writes health not {status} after {timeout_s}s: {stats(address)}"
        time.sleep(0.1)
    return time.monotonic() - began


@pytest.mark.parametrize("mode", MODES)
def test_disk_fills_then_frees_and_nothing_acknowledged_is_lost(
    tmp_path: Path, procs: list[ShardProcess], mode: str
) -> None:
    args = (f"--data-dir={tmp_path / 'data'}", f"--durability={mode}")
    shard = start(procs, tmp_path, *args)
    create_table(shard.address)
    acked = [("a", seq) for seq in range(1, 11)]
    push_all(shard.address, acked)
    set_file_size_limit(shard.proc.pid, 0)  # the disk is full: no file may grow by a byte
    later, refused = push_until_refused(shard, mode, "b")
    acked += later
    before_space = len(acked)

    # Full: pushes refused, reads served (with every acknowledged push), and retries
    # keep failing as long as the disk stays full.
    assert health_status(shard.address, WRITES) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert health_status(shard.address, "") == health_pb2.HealthCheckResponse.SERVING
    st = stats(shard.address)
    assert st["writable"] is False and st["storage_error"], st
    assert lost_and_extra(row_counts(shard.address), acked) == (0, 0)
    with PSClient([shard.address]) as ps:  # new keys too: their rows are made in RAM
        assert ps.lookup(TABLE, np.arange(NUM_KEYS, NUM_KEYS + 10)).shape == (10, DIM)
    time.sleep(1.5)
    st = stats(shard.address)
    assert st["writable"] is False, "the shard claimed to be writable on a full disk"
    # Its background retries fail, and say so: in Stats and in the Background health service.
    assert "storage-recovery" in {f["loop"] for f in st["failing_loops"]}, st["failing_loops"]
    assert health_status(shard.address, BACKGROUND) == health_pb2.HealthCheckResponse.NOT_SERVING
    # A recovery try that failed left reads working: every acknowledged push is still read.
    assert lost_and_extra(row_counts(shard.address), acked) == (0, 0)

    # Space comes back: the shard takes writes again by itself.
    set_file_size_limit(shard.proc.pid, None)
    recovered_s = wait_for_writes(shard.address, health_pb2.HealthCheckResponse.SERVING, 30)
    st = stats(shard.address)
    assert st["writable"] is True and st["storage_error"] == "", st
    began = time.monotonic()  # the loops that failed run again at once and clear
    while health_status(shard.address, BACKGROUND) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() - began < 10, (
            f"Background health still failing: {stats(shard.address)['failing_loops']}"
        )
        time.sleep(0.1)
    assert stats(shard.address)["failing_loops"] == []
    with Pusher(shard.address, table=TABLE, dim=DIM) as pusher:
        assert pusher.push(*refused, keys_of(*refused)), "the refused push had been recorded as applied"
    acked.append(refused)
    more = [(refused[0], seq) for seq in range(refused[1] + 1, refused[1] + 6)]
    push_all(shard.address, more)
    acked += more
    stop_shard(shard)  # must exit 0: everything was written

    shard = start(procs, tmp_path, *args)
    lost, extra = lost_and_extra(row_counts(shard.address), acked)
    print(
        f"\n{mode}: {before_space} pushes acknowledged before space returned, {len(acked)} in all; writable "
        f"again {recovered_s:.1f}s after space returned; after SIGTERM + restart {lost} row updates lost, {extra} extra"
    )
    assert (lost, extra) == (0, 0), f"{mode}: {lost} acknowledged row updates lost, {extra} applied twice"
    with Pusher(shard.address, table=TABLE, dim=DIM) as pusher:
        again = [p for p in acked[-8:] if pusher.push(*p, keys_of(*p))]
        assert not again, f"{mode}: acknowledged pushes applied again after the restart: {again}"
    stop_shard(shard)


def stop_on_a_full_disk(
    procs: list[ShardProcess], tmp_path: Path, mode: str, *extra: str
) -> tuple[tuple[str, ...], list[Push], Push, Path]:
    """Run a shard until its disk refuses writes, then SIGTERM it: it must exit 3 with a
    rescue dump. Returns its arguments, the acknowledged pushes, the refused one, the dump.

    The data dir fails for good: its write-ahead log (MBs, from rows spilled under a
    small memory budget) is over the 400 KB file size limit, and reopening it would
    write a table file of every row (~750 KB). What is unwritten at the stop (at most
    the RAM budget's worth) fits in a new file: the rescue dump."""
    data = tmp_path / "data"
    args = (f"--data-dir={data}", f"--durability={mode}", "--grace-s=1", "--memory-budget-bytes=200000", *extra)
    shard = start(procs, tmp_path, *args)
    create_table(shard.address)
    acked = [("a", seq) for seq in range(1, 41)]
    push_all(shard.address, acked)
    wal = sum(f.stat().st_size for f in (data / "db").glob("*.log"))
    assert wal > 1 << 20, f"only {wal} bytes of write-ahead log: the budget did not make the shard spill"
    set_file_size_limit(shard.proc.pid, 400_000)
    later, refused = push_until_refused(shard, mode, "small")
    acked += later
    began = time.monotonic()
    code = terminate(shard)
    took = time.monotonic() - began
    log = shard.log.read_text(errors="replace")
    assert code == 3, f"{mode}: exit {code} after SIGTERM on a full disk:\n{log[-3000:]}"
    found = re.search(r"--restore-from (\S+)", log)
    assert found, f"the log does not say how to restore:\n{log[-3000:]}"
    dump = Path(found.group(1))
    assert (dump / "manifest.json").exists(), dump
    assert "final flush failed" in log and took >= 1.0, f"gave up after {took:.1f}s without retrying"
    print(f"\n{mode}: {len(acked)} pushes acknowledged, stopped on a full disk (exit {code} after {took:.1f}s)")
    return args, acked, refused, dump


@pytest.mark.parametrize("mode", ["interval:0.2", "checkpoint-only"])
def test_stop_on_a_full_disk_saves_a_rescue_dump_and_restore_recovers_every_push(
    tmp_path: Path, procs: list[ShardProcess], mode: str
) -> None:
    args, acked, refused, dump = stop_on_a_full_disk(procs, tmp_path, mode)
    assert dump.parent == tmp_path / "data" / "checkpoints", dump
    shard = start(procs, tmp_path, *args, f"--restore-from={dump}")
    lost, extra = lost_and_extra(row_counts(shard.address), acked)
    print(f"{mode}: after --restore-from {lost} row updates lost, {extra} extra")
    assert (lost, extra) == (0, 0), f"{mode}: {lost} acknowledged row updates lost, {extra} applied twice"
    with Pusher(shard.address, table=TABLE, dim=DIM) as pusher:
        assert not [p for p in acked[-8:] if pusher.push(*p, keys_of(*p))], "acknowledged pushes applied again"
        assert pusher.push(*refused, keys_of(*refused)), "the refused push had been recorded as applied"
    stop_shard(shard)

    # Applying the same dump twice would overwrite newer rows: refused, with a reason.
    with pytest.raises(ShardStartError, match="already applied"):
        start(procs, tmp_path, *args, f"--restore-from={dump}")
    shard = start(procs, tmp_path, *args)
    assert lost_and_extra(row_counts(shard.address), [*acked, refused]) == (0, 0)
    stop_shard(shard)


def test_a_plain_restart_applies_the_pending_dump_before_it_serves(tmp_path: Path, procs: list[ShardProcess]) -> None:
    # What a restart policy does after exit 3: start the shard again, as it was.
    args, acked, refused, dump = stop_on_a_full_disk(procs, tmp_path, "interval:0.2")
    shard = start(procs, tmp_path, *args)
    lost, extra = lost_and_extra(row_counts(shard.address), acked)
    assert (lost, extra) == (0, 0), f"plain restart: {lost} acknowledged row updates lost, {extra} applied twice"
    assert f"applied rescue dump {dump}" in shard.log.read_text(errors="replace")
    with Pusher(shard.address, table=TABLE, dim=DIM) as pusher:
        assert not [p for p in acked[-8:] if pusher.push(*p, keys_of(*p))], "acknowledged pushes applied again"
    stop_shard(shard)
    shard = start(procs, tmp_path, *args)  # applied once: the next start goes on as usual
    assert lost_and_extra(row_counts(shard.address), acked) == (0, 0)
    stop_shard(shard)


def test_a_dump_is_never_applied_over_rows_written_after_it(tmp_path: Path, procs: list[ShardProcess]) -> None:
    args, acked, _, dump = stop_on_a_full_disk(procs, tmp_path, "interval:0.2")
    away = tmp_path / "elsewhere" / dump.name
    away.parent.mkdir()
    dump.rename(away)  # out of every place a start looks: this start cannot know of it
    shard = start(procs, tmp_path, *args)
    later = [("c", seq) for seq in range(1, 31)]
    push_all(shard.address, later)
    newer = row_counts(shard.address)
    stop_shard(shard)

    # The dump's rows are older than these pushes on the keys both touched.
    with pytest.raises(ShardStartError, match=f"another state of .* --discard-rescue={re.escape(str(away))}"):
        start(procs, tmp_path, *args, f"--restore-from={away}")
    away.rename(dump)  # back where the shard left it: a start finds it, and refuses to go past it
    with pytest.raises(
        ShardStartError, match=f"never applied: {re.escape(str(dump))} .* --discard-rescue={re.escape(str(dump))}"
    ) as refused:
        start(procs, tmp_path, *args)
    assert "Traceback" not in str(refused.value)
    shard = start(procs, tmp_path, *args, f"--discard-rescue={dump}")
    np.testing.assert_array_equal(row_counts(shard.address), newer)
    stop_shard(shard)
    shard = start(procs, tmp_path, *args)  # discarded: no longer in the way
    np.testing.assert_array_equal(row_counts(shard.address), newer)
    stop_shard(shard)
    with pytest.raises(ShardStartError, match="already discarded"):
        start(procs, tmp_path, *args, f"--restore-from={dump}")


def test_a_follower_on_a_full_disk_stops_without_a_rescue_dump(tmp_path: Path, procs: list[ShardProcess]) -> None:
    # A serving shard's rows come from its training shard, and it acknowledged no push: rows
    # it could not write at its stop are streamed to it again when it restarts. A rescue dump
    # of them would only be something for a person to apply or discard (and, with the serving
    # shard's checkpoint root the training shard's, it would lie among that shard's files).
    leader = start(procs, tmp_path / "train", f"--data-dir={tmp_path / 'train' / 'data'}")
    with PSClient([leader.address]) as ps:
        ps.create_table("big", 64, optimizer="sgd", initializer="zeros", lr=1.0)
        for chunk in np.array_split(np.arange(NUM_KEYS), 8):  # ~2 MB the follower writes to its WAL
            ps.push("big", chunk, -np.ones((chunk.shape[0], 64), np.float32))
    data = tmp_path / "serve" / "data"
    serve_args = ("--mode=serve", f"--follow={leader.address}", f"--data-dir={data}", "--grace-s=1")
    follower = start(procs, tmp_path / "serve", *serve_args)

    def caught_up() -> None:
        began = time.monotonic()
        while stats(follower.address)["version"] != stats(leader.address)["version"]:
            assert time.monotonic() - began < 30, f"the follower did not catch up: {stats(follower.address)}"
            time.sleep(0.1)

    caught_up()
    began = time.monotonic()
    while sum(f.stat().st_size for f in (data / "db").glob("*.log")) <= 1 << 20:  # its copy is written
        assert time.monotonic() - began < 30, "the follower did not write the rows it follows"
        time.sleep(0.1)
    set_file_size_limit(follower.proc.pid, 400_000)  # its log cannot grow: the disk is full
    with PSClient([leader.address]) as ps:
        ps.push("big", np.arange(64), -np.ones((64, 64), np.float32))  # rows the follower cannot write
    caught_up()
    code = terminate(follower)
    log = follower.log.read_text(errors="replace")
    assert code == 0, f"exit {code}: a serving shard has no acknowledged update to lose:\n{log[-3000:]}"
    assert "rescue dump" not in log, log[-3000:]
    assert not [p for p in tmp_path.rglob("*rescue-*")], "a serving shard wrote a rescue dump"

    # Restarted with room again, it goes on from what it saved and holds the leader's rows.
    follower = start(procs, tmp_path / "serve", *serve_args)
    caught_up()
    with PSClient([follower.address]) as served, PSClient([leader.address]) as trained:
        np.testing.assert_array_equal(served.lookup("big", np.arange(128)), trained.lookup("big", np.arange(128)))
    stop_shard(follower)
    stop_shard(leader)


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs under ``tmp_path``: a filesystem of its own that really fills up
    (ENOSPC, unlike the file size limit of the other tests, which every file shares).
    Mounting needs root (CAP_SYS_ADMIN); the test is skipped without it."""
    volume = tmp_path / "volume"
    volume.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(volume)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield volume
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)


def fill(volume: Path) -> Path:
    """Write a file that takes every free byte of ``volume``; returns it."""
    filler = volume / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)
    return filler


def test_a_full_data_volume_sends_the_dump_to_the_rescue_dir(
    tmp_path: Path, procs: list[ShardProcess], small_volume: Path
) -> None:
    # The shipped manifest's set-up: the data dir (and so the default checkpoint root)
    # on a volume of its own. Without --rescue-dir every rescue place is on that volume.
    data, rescue = small_volume / "data", tmp_path / "rescue"
    args = (f"--data-dir={data}", "--durability=interval:60", "--grace-s=1")
    shard = start(procs, tmp_path, *args)
    assert "every place a rescue dump can go" in shard.log.read_text(errors="replace")
    stop_shard(shard)

    shard = start(procs, tmp_path, *args, f"--rescue-dir={rescue}")
    create_table(shard.address)
    acked = [("a", seq) for seq in range(1, 86)]
    push_all(shard.address, acked)  # acknowledged, in RAM until the next flush (60 s)
    filler = fill(small_volume)
    code = terminate(shard)
    log = shard.log.read_text(errors="replace")
    assert code == 3, f"exit {code} after SIGTERM on a full data volume:\n{log[-3000:]}"
    dumps = list(rescue.glob("rescue-*"))
    assert len(dumps) == 1 and (dumps[0] / "manifest.json").exists(), (dumps, log[-3000:])

    filler.unlink()  # space again: a plain restart applies the dump, then serves
    shard = start(procs, tmp_path, *args, f"--rescue-dir={rescue}")
    lost, extra = lost_and_extra(row_counts(shard.address), acked)
    print(
        f"\n{len(acked)} pushes acknowledged before the data volume filled; after the restart {lost} row updates lost"
    )
    assert (lost, extra) == (0, 0), f"{lost} acknowledged row updates lost, {extra} applied twice"
    stop_shard(shard)


def test_stop_when_not_even_a_rescue_dump_fits_says_the_rows_are_lost(
    tmp_path: Path, procs: list[ShardProcess]
) -> None:
    # 8192 rows of dim 64 (2.1 MB unwritten, checkpoint-only) fit in neither the data
    # dir nor a rescue dump under a 1 MiB limit; the log line saying so (a few KB) does.
    args = (f"--data-dir={tmp_path / 'data'}", "--durability=checkpoint-only", "--grace-s=1")
    shard = start(procs, tmp_path, *args, limit=LIMIT_BYTES)
    with PSClient([shard.address]) as ps:
        ps.create_table("big", 64, optimizer="sgd", initializer="zeros", lr=1.0)
        for chunk in np.array_split(np.arange(NUM_KEYS), 8):
            ps.push("big", chunk, -np.ones((chunk.shape[0], 64), np.float32))
    code = terminate(shard)
    log = shard.log.read_text(errors="replace")
    assert code == 4, f"exit {code}:\n{log[-3000:]}"
    assert "LOST" in log and "cannot write a rescue dump" in log and "8192 rows" in log, log[-3000:]


def test_restart_that_cannot_replay_its_log_says_how_much_space_it_needs(
    tmp_path: Path, procs: list[ShardProcess]
) -> None:
    args = (f"--data-dir={tmp_path / 'data'}", "--durability=every-push")
    shard = start(procs, tmp_path, *args)
    create_table(shard.address)
    acked = [("c", seq) for seq in range(1, 61)]  # ~2.8 MB of write-ahead log
    push_all(shard.address, acked)
    shard.proc.kill()  # a crash: a clean stop would have written the log's rows to table files
    shard.proc.wait()

    with pytest.raises(ShardStartError) as refused:
        start(procs, tmp_path, *args, limit=LIMIT_BYTES // 2)
    message = str(refused.value)
    assert "exit 1" in message and "Traceback" not in message, message
    needed = re.search(r"needs up to about ([0-9.]+) MiB free", message)
    assert needed and float(needed.group(1)) > 2.0, message
    assert "RLIMIT_FSIZE" in message and "nothing on disk was lost" in message, message

    shard = start(procs, tmp_path, *args)  # with room again, it opens and holds every push
    assert lost_and_extra(row_counts(shard.address), acked) == (0, 0)
    stop_shard(shard)
