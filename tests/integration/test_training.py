"""End-to-end training: torchrun DDP via ps-launch, pipelined vs sync quality (real data: test_quality.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from deploy.train import run
from worker.trainer import TrainerConfig

REPO = Path(__file__).resolve().parents[2]


def launch(tmp_path: Path, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.launch", "--log-dir", str(tmp_path / "shards"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_two_worker_ddp_through_ps_launch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Each worker needs a GPU of its own; with fewer than two, both train on CPU (gloo).
    device = "auto" if torch.cuda.device_count() >= 2 else "cpu"
    result = launch(
        tmp_path,
        "--shards",
        "2",
        "--workers",
        "2",
        "--",
        "python",
        "examples/train_dlrm.py",
        "--train-samples",
        "24000",
        "--eval-samples",
        "4000",
        "--batch-size",
        "512",
        "--progress",
        "false",
        "--device",
        device,
        "--output-dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    digests = metrics["dense_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], digests  # DDP kept the workers' dense weights equal
    assert metrics["final"]["auc"] > 0.6
    # What the trainer reports for operators: throughput, time waiting for rows, push latency.
    assert metrics["samples_per_s"] > 0 and metrics["lookup_wait_s"] >= 0
    assert metrics["pushes"] > 0 and 0 < metrics["push_mean_s"] <= metrics["push_max_s"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert [t["name"] for t in manifest["tables"]] == ["embedding", "wide"] and manifest["num_shards"] == 2
    assert len(manifest["features"]) == 2 * 26  # each feature, and its first-order weight
    assert all(rows > 0 for rows in manifest["shard_rows"])  # both shards hold rows
    assert "AUC" in result.stdout


@pytest.mark.gpu
def test_more_workers_than_gpus_is_a_clear_error(tmp_path: Path) -> None:
    workers = str(torch.cuda.device_count() + 1)
    result = launch(
        tmp_path,
        "--shards",
        "1",
        "--workers",
        workers,
        "--",
        "python",
        "examples/train_dlrm.py",
        "--train-samples",
        "4000",
        "--eval-samples",
        "1000",
        "--progress",
        "false",
        timeout_s=180,
    )
    assert result.returncode != 0
    assert "needs a GPU of its own" in result.stderr and "--device cpu" in result.stderr, result.stderr[-3000:]


def test_parity_pipelined_auc_matches_sync(tmp_path: Path) -> None:
    common = dict(train_samples=240_000, eval_samples=20_000, batch_size=1024, progress=False, num_shards=2)
    sync = run(TrainerConfig(mode="sync", output_dir=tmp_path / "sync", **common))  # type: ignore[arg-type]
    pipelined = run(TrainerConfig(mode="pipelined", output_dir=tmp_path / "pipe", **common))  # type: ignore[arg-type]
    a, b = sync["final"]["auc"], pipelined["final"]["auc"]
    print(f"sync AUC {a:.4f}, pipelined AUC {b:.4f}")
    assert a > 0.7, a  # learned something real (the planted model allows ~0.8)
    assert abs(a - b) <= 0.003, (a, b)


def test_ps_launch_stops_everything_when_a_shard_dies(tmp_path: Path) -> None:
    # Build the pattern at run time: spelled out, it would also match this very command line
    # (and the launcher's, which carries it after "--").
    pattern = f"{tmp_path / 'shards'}/port.' + '1"
    killer = f"import subprocess, time; subprocess.run(['pkill', '-9', '-f', '{pattern}']); time.sleep(120)"
    started = time.monotonic()
    result = launch(tmp_path, "--shards", "2", "--", "python", "-c", killer, timeout_s=90)
    assert result.returncode != 0
    assert "shard 1 died" in result.stderr
    assert time.monotonic() - started < 60  # did not wait for the worker's sleep
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).returncode == 1  # nothing left


def test_ps_launch_reports_a_failed_worker(tmp_path: Path) -> None:
    result = launch(tmp_path, "--shards", "1", "--", "python", "-c", "raise SystemExit(3)", timeout_s=120)
    assert result.returncode != 0
    assert "workers exited with status" in result.stderr
    assert subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).returncode == 1


def test_ps_launch_needs_a_command(tmp_path: Path) -> None:
    result = launch(tmp_path, "--shards", "1", timeout_s=60)
    assert result.returncode == 2 and "missing '-- COMMAND'" in result.stderr


@pytest.mark.parametrize("when", ["training", "starting shards"])
def test_sigterm_to_ps_launch_stops_shards_and_workers(tmp_path: Path, when: str) -> None:
    # Started the way a shell starts a background job (`ps-launch ... &`): SIGINT ignored.
    proc = subprocess.Popen(
        [
            "sh",  # a shell's trap "" INT sets SIGINT to ignored, which exec keeps: no Python runs in the fork
            "-c",
            'trap "" INT; exec "$@"',
            "sh",
            sys.executable,
            "-m",
            "deploy.launch",
            "--data-dir",
            str(tmp_path / "shards"),
            "--shards",
            "2",
            "--",
            "python",
            "-c",
            "import time; time.sleep(300)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    deadline = time.monotonic() + 60
    sign = "port.0" if when == "starting shards" else "port.1"
    while not (tmp_path / "shards" / sign).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    while when == "training" and not any("shards up" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5 if when == "training" else 0.0)  # torchrun starting its worker
    proc.terminate()
    assert proc.wait(60) == 130
    reader.join(10)
    err = "".join(lines)
    assert "interrupted (SIGINT or SIGTERM)" in err, err
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True).stdout
    assert left == "", left


def test_killed_ps_launch_leaves_nothing_behind(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deploy.launch",
            "--data-dir",
            str(tmp_path / "shards"),
            "--shards",
            "2",
            "--",
            "python",
            "-c",
            "import time; time.sleep(300)",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "shards" / "port.1").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    proc.kill()  # SIGKILL: no handler runs; the children's parent-death signal must do it
    proc.wait()
    deadline = time.monotonic() + 30
    left = "?"
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = subprocess.run(["pgrep", "-af", str(tmp_path)], capture_output=True, text=True).stdout
    assert left == "", left
