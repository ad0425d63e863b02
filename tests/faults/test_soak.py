"""A soak with connection churn: clients connect, call, and leave (politely or not), over and
over; the shard's memory must settle and every acknowledged push must be counted once.

Each round takes one of a few clients, opens its channels (``start``), looks rows up,
pushes, and closes them again; every third round instead abandons a raw channel with a
call still in flight. The clients keep their identities, as trainers that reconnect do:
state a shard keeps per client id (the push ledger, capped at 65,536 ids) or per change
(the followers' change log, capped by ``--follow-history-keys``, set small here so it is
full before the warm-up ends) is bounded by design and not what this soak looks for. RSS
of the shard is read after a warm-up share of the time and at the end: growth at most 5%.
A plain run soaks ~25 s; ``pytest -m slow`` soaks 30 minutes.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from client import ClientConfig, PSClient
from protos import ps_pb2 as pb
from tests.integration.shards import start_shard, stop_shard
from tests.profiles import long_run

RSS_GROWTH_MAX = 0.05
WARM_UP_SHARE = 0.3
KEYS, DIM = 2_000, 16


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.slow  # selected by `pytest -m slow`, which runs the 30-minute version
def test_connection_churn_soak(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    seconds = 1800.0 if long_run(request.config) else 25.0
    shard = start_shard(0, 1, tmp_path, f"--data-dir={tmp_path / 'data'}", "--follow-history-keys=50000")
    rng = np.random.default_rng(7)
    acknowledged = rounds = abandoned = 0
    lookup_body = pb.LookupRequest(
        entries=[pb.LookupEntry(table="t", keys=np.arange(KEYS).tobytes())], num_shards=1, shard=0
    ).SerializeToString()
    try:
        with PSClient([shard.address]) as setup:
            setup.create_table("t", dim=DIM)
            setup.lookup("t", np.arange(KEYS))
        clients = [PSClient([shard.address], ClientConfig(deadline_s=30)) for _ in range(4)]
        start = time.monotonic()
        warm_until, stop_at = start + WARM_UP_SHARE * seconds, start + seconds
        rss_after_warm_up = 0
        while time.monotonic() < stop_at:
            if not rss_after_warm_up and time.monotonic() >= warm_until:
                rss_after_warm_up = _rss(shard.proc.pid)
            rounds += 1
            if rounds % 3 == 0:
                # Leave rudely: a call in flight when the channel goes away.
                channel = grpc.insecure_channel(shard.address)
                future = channel.unary_unary("/ps.v1.ParameterServer/Lookup", None, None).future(lookup_body, timeout=5)
                time.sleep(float(rng.uniform(0, 0.002)))
                channel.close()
                future.cancel()
                abandoned += 1
                continue
            client = clients[rounds % len(clients)].start()  # new channels, same identity
            try:
                keys = rng.choice(KEYS, 256, replace=False)
                assert client.lookup("t", keys).shape == (256, DIM)
                assert client.push("t", keys, np.full((256, DIM), 1e-3, np.float32)).rows_updated == 256
                acknowledged += 1
            finally:
                client.close()
        rss_end = _rss(shard.proc.pid)
        with PSClient([shard.address]) as check:
            pushed_keys = check.admin.stats()[0]["tables"][0]["pushes"]
        growth = rss_end / rss_after_warm_up - 1
        print(
            f"soak {seconds:.0f} s: {rounds} rounds, {acknowledged} acknowledged pushes, {abandoned} abandoned "
            f"channels; RSS after warm-up {rss_after_warm_up / 2**20:.1f} MiB -> {rss_end / 2**20:.1f} MiB "
            f"({growth:+.2%})"
        )
        assert pushed_keys == 256 * acknowledged  # every acknowledged push applied once, none lost
        assert growth <= RSS_GROWTH_MAX, f"shard RSS grew {growth:.1%} after the warm-up"
    finally:
        stop_shard(shard)
