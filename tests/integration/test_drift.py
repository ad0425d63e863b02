"""``ps-admin drift`` against real shards and their checkpoints, checked against the rows as
the client read them before and after (the oracle), computed here with numpy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from client import PSClient
from deploy.drift import cosine, drift, find_checkpoint
from deploy.operations import checkpoint_cluster
from deploy.reshard import AdminError
from tests.integration.shards import RunningShard, start_shard

REPO = Path(__file__).resolve().parents[2]


def shards(tmp_path: Path, procs: list[RunningShard]) -> list[str]:
    started = [start_shard(i, 2, tmp_path, "--data-dir=data-{shard}") for i in range(2)]
    procs.extend(started)
    return [s.address for s in started]


def train(client: PSClient, keys: np.ndarray, scale: float) -> None:
    rng = np.random.default_rng(len(keys))
    client.lookup("emb", keys)
    client.push("emb", keys, (rng.standard_normal((len(keys), 8)) * scale).astype(np.float32))


def test_drift_since_a_checkpoint_matches_the_rows_read_before_and_after(
    tmp_path: Path, procs: list[RunningShard]
) -> None:
    addresses = shards(tmp_path, procs)
    old_keys, new_keys = np.arange(0, 3000, dtype=np.int64), np.arange(1000, 4000, dtype=np.int64)
    with PSClient(addresses) as client:
        client.create_table("emb", 8, optimizer="sgd", lr=0.5)
        train(client, old_keys, 1.0)
        before = client.lookup("emb", old_keys)
        checkpoint_cluster(addresses, "before")
        train(client, new_keys, 0.3)
        after = client.lookup("emb", old_keys)  # keys 0..999 untouched since, 1000..2999 trained again
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "deploy.admin", "drift", "--addresses", ",".join(addresses), "--table", "emb"]
        + ["--from", "before", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "mean cosine" in done.stdout and "new keys           25.00%" in done.stdout, done.stdout
    report = json.loads((out / "drift.json").read_text())
    assert (out / "drift.png").stat().st_size > 0
    a, b = before, after
    assert report["both"] == 3000 and report["older_rows"] == 3000 and report["newer_rows"] == 4000
    assert report["new_share"] == pytest.approx(1000 / 4000) and report["gone_share"] == 0.0
    assert report["mean_cosine"] == pytest.approx(float(cosine(a, b).mean()), rel=1e-6)
    assert report["mean_l2_change"] == pytest.approx(float(np.linalg.norm(b - a, axis=1).mean()), rel=1e-6)
    assert sum(report["cosine_hist"]["counts"]) == 3000 and report["cosine_hist"]["counts"][-1] >= 1000


def test_a_sample_is_the_keys_of_a_range_of_the_hashed_key_space(tmp_path: Path, procs: list[RunningShard]) -> None:
    addresses = shards(tmp_path, procs)
    keys = np.unique(np.random.default_rng(3).integers(-(1 << 63), (1 << 63) - 1, 20_000, dtype=np.int64))
    with PSClient(addresses) as client:
        client.create_table("emb", 8, optimizer="sgd", lr=0.5)
        train(client, keys, 1.0)
        before = client.lookup("emb", keys)
        first = checkpoint_cluster(addresses, "first")
        train(client, keys[5000:], 0.3)
        after = client.lookup("emb", keys)
        second = checkpoint_cluster(addresses, "second")
    roots = sorted({Path(p).parent.parent for p in first["parts"]})
    report = drift(find_checkpoint(roots, "first"), [Path(p) for p in second["parts"]], "emb", sample=2000)
    inside = keys.view(np.uint64) < np.uint64(report.key_span)
    assert report.both == report.older_rows == int(inside.sum()) and 1000 < report.both < 4000
    assert report.mean_cosine == pytest.approx(float(cosine(before[inside], after[inside]).mean()), rel=1e-6)
    assert report.new_share == report.gone_share == 0.0
    with pytest.raises(AdminError, match="checkpoint 'third': not under"):
        find_checkpoint(roots, "third")
    with pytest.raises(AdminError, match="no table 'nope'"):
        drift(find_checkpoint(roots, "first"), find_checkpoint(roots, "second"), "nope")
