"""benchmarks/run_all's report, built from small synthetic JSON shaped like each benchmark's.

Nothing runs here: ``run_all.main(["--from-json", ...])`` reads the files and writes REPORT.md,
and the tests read its headline table back: each figure's ratio, goal and pass/fail, and a
benchmark that is missing, failed or wrote a JSON the report cannot read.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import headlines  # noqa: E402
import run_all  # noqa: E402

Table = dict[tuple[str, str], dict[str, str]]


def speed(gb_per_s: float) -> dict[str, float]:
    return {"gb_per_s": gb_per_s, "p50_ms": 16.0 / gb_per_s, "p90_ms": 20.0 / gb_per_s, "m_rows_per_s": 1.0}


def foundation_json() -> dict[str, Any]:
    def mode(lookup: float, push: float) -> dict[str, Any]:
        s: dict[str, Any] = {
            "ours_lookup": speed(2.0 * lookup),
            "ceiling_lookup": speed(2.0),
            "lookup_ratio": lookup,
            "ours_push": speed(2.0 * push),
            "ceiling_push": speed(2.0),
            "push_ratio": push,
        }
        return s

    tuned = mode(0.5, 0.75) | {
        "ours_lookup2": speed(1.8),
        "ceiling_lookup2": speed(2.0),
        "lookup2_ratio": 0.9,
        "ours_push2": speed(1.0),
        "ceiling_push2": speed(2.0),
        "push2_ratio": 0.5,
    }
    breakdown = dict.fromkeys(
        (
            "plan",
            "encode",
            "rpc_wait",
            "decode_scatter",
            "push_encode",
            "push_rpc_wait",
            "server_lookup",
            "server_push",
        ),
        1.0,
    )
    return {
        "quick": True,
        "machine": {"nproc": 2},
        "loadavg_start": [0.5, 0.5, 0.5],
        "loadavg_end": [1.0, 0.6, 0.5],
        "wall_s": 20.0,
        "summary": {"tuned": tuned, "default": mode(0.25, 0.6)},
        "breakdown_ms": breakdown,
        "memory": {"rows": 1_000_000, "raw_row_bytes": 128, "bytes_per_row": 160.0},
        "ready": {"cold_s": 2.5, "warm_median_s": 0.2, "first_call_cold_s": 1.0, "first_call_warm_median_s": 0.1},
    }


def zipf_run(mode: str, rows_per_s: float, hit_rate: float = 0.6) -> dict[str, Any]:
    return {
        "mode": mode,
        "rows": 400_000,
        "rows_per_s": rows_per_s,
        "step_ms": 1e3 * 14_000 / rows_per_s,
        "ram_hit_rate": hit_rate,
        "faulted_in_per_step": 2500.0,
        "spilled_per_step": 2500.0,
        "written_per_step": 2600.0,
    }


def tier_json() -> dict[str, Any]:
    served = [
        zipf_run("all in RAM (gRPC)", 4e6),
        zipf_run("budget 10%, interval:5 (gRPC)", 2.4e6, 0.75),
        zipf_run("budget 10%, interval:5, LRU (gRPC)", 1e6),
        zipf_run("budget 10%, every-push (gRPC)", 0.8e6),
    ]
    in_process = [
        zipf_run("all in RAM", 20e6),
        zipf_run("budget 10%, interval:5", 2e6),
        zipf_run("budget 10%, every-push", 1e6),
    ]
    scale = [
        {
            "rows": n,
            "resident_rows": n // 10,
            "us_per_row": us,
            "ram_hit_rate": 0.7,
            "populate_rows_per_s": 1e6,
            "restart_ready_s": 0.4,
        }
        for n, us in ((1_000_000, 1.0), (4_000_000, 1.5))
    ]
    io = {
        "rows": 200_000,
        "record_bytes": 136,
        "tier_write_rows_per_s": 1.2e6,
        "raw_write_rows_per_s": 1e6,
        "tier_read_rows_per_s": 0.5e6,
        "raw_read_rows_per_s": 0.25e6,
        "write_ratio": 1.2,
        "read_ratio": 2.0,
    }
    return {
        "machine": "Linux",
        "quick": True,
        "batch": 16384,
        "zipf_s": 1.05,
        "repeats": 1,
        "wall_s": 30.0,
        "zipf_part": {"served": served, "zipf": in_process, "floor": {"read_ms": 5.0, "write_ms": 2.0, "cores": 2.0}},
        "scale": scale,
        "io": io,
    }


def variant(samples_per_s: float, samples_per_cpu_s: float = 40_000) -> dict[str, Any]:
    phases = {"prefetch": 1.0, "lookup": 2.0, "forward": 10.0, "backward": 20.0, "step": 2.0}
    return {
        "samples_per_s": samples_per_s,
        "clean_rounds": 3,
        "round_samples_per_s": [samples_per_s] * 3,
        "round_others_cores": [0.0] * 3,
        "phases_ms_per_step": phases,
        "wall_ms_per_step": 40.0,
        "samples_per_cpu_s": samples_per_cpu_s,
    }


def training_json() -> dict[str, Any]:
    variants = {
        "ours pipelined": variant(70_000, 36_000),
        "ours sync": variant(50_000),
        "(a) in-process": variant(100_000),
        "floor: dense tower alone, 1 thread": variant(90_000),
    }
    return {
        "quick": True,
        "machine": {"nproc": 2},
        "loadavg_start": [1, 1, 1],
        "loadavg_end": [2, 1, 1],
        "wall_s": 60.0,
        "torchrec": {"skipped": True, "status": "ModuleNotFoundError: No module named 'torchrec'"},
        "datagen_ms_per_batch": 20.0,
        "variants": variants,
        "best_baseline": "(a) in-process",
        "ratio": 0.7,
        "goal": 0.8,
        "pass": False,
        "cpu_ratio": 0.9,
        "cpu_goal": 0.9,
        "cpu_pass": True,
        "floor": {"variant": "floor: dense tower alone, 1 thread", "ratio": 0.9},
    }


def cell(p99_ms: float, requests_per_s: float) -> dict[str, float]:
    return {
        "p50_ms": p99_ms / 2,
        "p99_ms": p99_ms,
        "mean_ms": p99_ms / 2,
        "requests_per_s": requests_per_s,
        "requests": 100,
    }


def cpu(client_ms: float, server_ms: float) -> dict[str, float]:
    return {"client_cpu_ms_per_request": client_ms, "server_cpu_ms_per_request": server_ms}


def serving_json(parts: tuple[str, ...] = ("lookup", "infer", "freshness")) -> dict[str, Any]:
    cells = {
        "ours": {"1": cell(3.0, 400), "8": cell(30.0, 500) | cpu(2.0, 1.0)},
        "shards-raw": {"1": cell(2.5, 500), "8": cell(20, 700)},
        "ceiling": {"1": cell(2.0, 800), "8": cell(15.0, 1000) | cpu(0.5, 0.5)},
        "redis-threads": {"1": cell(8.0, 200), "8": cell(80.0, 200)},
        "redis-asyncio": {"1": cell(9.0, 150), "8": cell(70.0, 250)},
    }
    goals = [
        {"goal": "p99 vs ceiling, concurrency 1", "ratio": 1.5, "target": "<= 1.5x", "pass": True},
        {"goal": "requests/s vs redis-threads, concurrency 1", "ratio": 2.0, "target": ">= 1.3x", "pass": True},
        {"goal": "p99 vs ceiling, concurrency 8", "ratio": 2.0, "target": "<= 1.5x", "pass": False},
        {"goal": "requests/s vs redis-asyncio, concurrency 8", "ratio": 2.0, "target": ">= 2.0x", "pass": True},
    ]
    res: dict[str, Any] = {
        "quick": True,
        "parts": list(parts),
        "machine": {"nproc": 2},
        "loadavg_start": [1, 1, 1],
        "loadavg_end": [2, 1, 1],
        "wall_s": 45.0,
    }
    if "lookup" in parts:
        res["lookup"] = {
            "setup": {"rows": 50_000, "dim": 64, "shards": 2, "keys_per_request": 2600, "ps_mode": "serve"},
            "cells": cells,
            "goals": goals,
        }
    if "infer" in parts:
        res["infer"] = {
            "cells": {
                "ps-infer": {"1": cell(14.0, 90), "8": cell(40.0, 100)},
                "in-process": {"1": cell(10.0, 180), "8": cell(50.0, 250)},
            },
            "goals": [
                {
                    "goal": "ps-infer requests/s vs in-process, concurrency 1",
                    "ratio": 0.5,
                    "target": ">= 0.5x",
                    "pass": True,
                },
                {
                    "goal": "ps-infer requests/s vs in-process, concurrency 8",
                    "ratio": 0.4,
                    "target": ">= 0.5x",
                    "pass": False,
                },
            ],
        }
    else:
        res["infer"] = {"skipped": "ps-infer not available (no worker.serving)"}
    if "freshness" in parts:
        lag = {"samples": 30, "timeouts": 0, "p50_ms": 5.0, "p99_ms": 20.0, "max_ms": 30.0, "poll_interval_ms": 1.0}
        res["freshness"] = {
            "idle": lag | {"p99_ms": 2.0},
            "under_load": lag,
            "load": {"pushes_per_s": 100.0},
            "goals": [
                {"goal": "p99 lag under training load", "value_ms": 20.0, "target": "<= 1 s, no timeouts", "pass": True}
            ],
        }
    return res


def step_figures(samples_per_s: float) -> dict[str, float]:
    return {"samples_per_s": samples_per_s, "median_step_s": 0.01, "slowest_step_s": 0.1, "steps": 100}


def reshard_json() -> dict[str, Any]:
    return {
        "dim": 16,
        "rows": 300_000,
        "goals": {"move_vs_lookup": 0.5, "training_during_move": 0.7, "bytes_vs_expected": 0.1},
        "lookup": {"rows_per_s": 4_000_000},
        "write_floor_rows_per_s": 800_000,
        "move": {
            "rows_per_s": 200_000,
            "bytes_moved": 1_050_000,
            "bytes_expected": 1_000_000,
            "phases_s": {"prepare": 0.01, "copy": 0.5, "freeze": 0.03, "commit": 0.01, "total": 0.55},
        },
        "training": {
            "batch": 8192,
            "steady": step_figures(1_000_000),
            "during_move": step_figures(800_000),
            "during_paced_move": step_figures(900_000),
        },
        "ratios": {
            "move_vs_lookup": 0.05,
            "move_vs_write_floor": 0.25,
            "training_during_move": 0.8,
            "training_during_paced_move": 0.9,
            "bytes_vs_expected": 0.05,
        },
        "passed": {
            "move_vs_lookup": False,
            "training_during_move": True,
            "training_during_paced_move": True,
            "bytes_vs_expected": True,
        },
    }


def resume_json() -> dict[str, Any]:
    phases = {"restart": 1.0, "start_to_resume": 2.0, "resume_to_first_step": 2.0}
    return {
        "rows": 10_000_000,
        "workers": 2,
        "rounds": [{"resume_s": 5.0, "phases_s": phases}, {"resume_s": 6.0, "phases_s": phases}],
        "cold_start_s": 8.0,
        "goal_s": 10.0,
        "resume_s": 5.0,
        "resume_over_cold_start": 0.625,
        "pass": True,
    }


BUILDERS = {
    "foundation": foundation_json,
    "tier": tier_json,
    "training": training_json,
    "serving": serving_json,
    "reshard": reshard_json,
    "resume": resume_json,
}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    for name, build in BUILDERS.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(build()))
    return tmp_path


def report(src: Path, *args: str) -> tuple[int, str, Table]:
    """run_all --from-json over ``src`` into ``src/out``: exit status, REPORT.md, its headline table."""
    out = src / "out"
    code = run_all.main(["--from-json", str(src), "--out", str(out), *args])
    text = (out / "REPORT.md").read_text()
    table: Table = {}
    section = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    header: list[str] = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if not header:
            header = cells
            continue
        row = dict(zip(header, cells))
        table[(row["benchmark"], row["figure"])] = row
    return code, text, table


def cells(table: Table, bench: str, figure: str) -> tuple[str, str, str]:
    row = table[(bench, figure)]
    return row["ratio"], row["goal"], row["pass"]


def test_every_benchmark_read_ratios_goals_and_pass(results: Path) -> None:
    code, text, t = report(results)
    assert code == 0
    assert cells(t, "foundation", "Lookup 64Ki keys × dim 64, client malloc tuned") == ("0.50×", "≥ 0.6×", "**fail**")
    assert cells(t, "foundation", "Push 64Ki keys × dim 64, client malloc tuned") == ("0.75×", "≥ 0.48×", "pass")
    assert cells(t, "foundation", "Lookup 64Ki keys × dim 64, 2 calls in flight") == ("0.90×", "≥ 0.6×", "pass")
    assert cells(t, "foundation", "Memory per row, dim 16 Adagrad, 1,000,000 rows") == ("1.25×", "≤ +48 B", "pass")
    assert cells(t, "foundation", "ps-server ready (port file written), cold numba cache") == ("", "≤ 2 s", "**fail**")
    assert t[("foundation", "Lookup 64Ki keys × dim 64, client malloc tuned")]["ceiling or peer"].startswith(
        "ceiling 2.00 GB/s"
    )
    assert cells(t, "tier", "Zipf lookup+push, 400,000 rows, budget 10%, interval:5, through gRPC") == (
        "0.60×",
        "≥ 0.35×",
        "pass",
    )
    assert cells(t, "tier", "RAM hit rate, Zipf, 400,000 rows, budget 10%, interval:5, through gRPC") == (
        "",
        "≥ 0.72",
        "pass",
    )
    # The goals are for the default (LFU) through gRPC; LRU and in process are for information.
    assert cells(t, "tier", "Zipf lookup+push, 400,000 rows, budget 10%, interval:5, LRU, through gRPC") == (
        "0.25×",
        "",
        "",
    )
    assert cells(t, "tier", "Zipf lookup+push, 400,000 rows, budget 10%, interval:5, in process") == ("0.10×", "", "")
    assert cells(t, "tier", "Zipf lookup+push, 400,000 rows, budget 10%, every-push, through gRPC") == ("0.20×", "", "")
    assert cells(t, "tier", "Lookup cost per row, 1M–4M rows stored (10% resident), max vs min") == (
        "1.50×",
        "flat ±25% (≤ 1.67×)",
        "pass",
    )
    assert cells(t, "tier", "RocksDB read, 200,000 rows of 136 B, tier") == ("2.00×", "", "")
    assert cells(t, "training", "DLRM training, ours pipelined") == ("0.70×", "≥ 0.8×", "**fail**")
    assert cells(t, "training", "DLRM training, ours pipelined, samples per CPU-second (worker + shards)") == (
        "0.90×",
        "≥ 0.9×",
        "pass",
    )
    assert cells(t, "training", "DLRM training, floor: dense tower alone, 1 thread") == ("0.90×", "", "")
    assert cells(t, "training", "DLRM training, ours sync") == ("0.50×", "", "")
    assert t[("training", "DLRM training, ours sync")]["ceiling or peer"] == "(a) in-process 100,000 samples/s"
    assert cells(t, "serving", "Lookup p99, concurrency 1") == ("1.50×", "≤ 1.5×", "pass")
    assert cells(t, "serving", "Lookup p99, concurrency 8") == ("2.00×", "≤ 1.5×", "**fail**")
    assert cells(t, "serving", "Lookup requests/s, concurrency 8") == ("0.50×", "", "")
    # The faster Redis client is the peer, per concurrency: threads at 1, asyncio at 8.
    assert t[("serving", "Lookup requests/s vs Redis, concurrency 1")]["ceiling or peer"] == "redis-threads 200/s"
    assert cells(t, "serving", "Lookup requests/s vs Redis, concurrency 8") == ("2.00×", "≥ 2.0×", "pass")
    # CPU per request where the JSON has it (concurrency 8 here), none where it has not.
    assert cells(t, "serving", "Lookup CPU per request (client + servers), concurrency 8") == ("3.00×", "", "")
    assert ("serving", "Lookup CPU per request (client + servers), concurrency 1") not in t
    assert cells(t, "serving", "ps-infer Predict requests/s, concurrency 8") == ("0.40×", "≥ 0.5×", "**fail**")
    fresh = "Freshness: push ack → visible on a follower, p99 under training load"
    assert cells(t, "serving", fresh) == ("10.00×", "≤ 1 s, no timeouts", "pass")
    what = "Live reshard 2 → 3 shards, 300,000 rows of dim 16"
    assert cells(t, "reshard", f"{what}, rows moved/s") == ("0.05×", "≥ 0.5×", "**fail**")
    assert cells(t, "reshard", f"{what}, rows moved/s vs writing them durably") == ("0.25×", "", "")
    assert cells(t, "reshard", "Training samples/s during a move") == ("0.80×", "≥ 0.7×", "pass")
    assert cells(t, "reshard", "Training samples/s during a paced move") == ("0.90×", "≥ 0.7×", "pass")
    assert cells(t, "reshard", f"{what}, bytes moved vs jump-hash expectation (off by)")[1:] == ("≤ 0.1", "pass")
    resumed = "Resume after a worker's kill -9, 10,000,000 rows, 2 workers"
    assert cells(t, "resume", resumed) == ("0.62×", "≤ 10 s", "pass")
    assert "6 of 6 benchmarks ran and were read. Goals met: 19 of 26." in text
    if importlib.util.find_spec("matplotlib"):  # the chart comes with the bench extra only
        assert (results / "out" / "report-ratios.png").stat().st_size > 0
    else:
        assert not (results / "out" / "report-ratios.png").exists()
        assert "matplotlib is not installed: no chart" in text
    assert "TorchRec not measured: ModuleNotFoundError" in text


def test_missing_benchmark_is_reported_and_fails_the_run(results: Path) -> None:
    (results / "tier.json").unlink()
    code, text, t = report(results)
    assert code == 1
    assert t[("tier", f"missing: no tier.json (nor tier-*.json) in {results}")]["pass"] == "**fail**"
    assert "| tier | missing |" in text
    # The others still read.
    assert cells(t, "training", "DLRM training, ours pipelined") == ("0.70×", "≥ 0.8×", "**fail**")


def test_failed_run_shows_its_stderr_and_not_a_stale_json(results: Path) -> None:
    run = {
        "command": [sys.executable, "benchmarks/bench_training.py", "--quick"],
        "wall_s": 3.0,
        "exit": 1,
        "error": "exit status 1",
        "stderr_tail": "Traceback (most recent call last):\nRuntimeError: boom",
    }
    ok = {
        "command": [sys.executable, "benchmarks/bench_tier.py", "--quick"],
        "wall_s": 31.0,
        "exit": 0,
        "json": "tier.json",
    }
    meta = {
        "argv": ["benchmarks/run_all", "--quick"],
        "quick": True,
        "started": "2025-01-01T00:00:00+00:00",
        "finished": "2025-01-01T00:02:00+00:00",
        "loadavg_before": [0.1, 0.2, 0.3],
        "loadavg_after": [1, 1, 1],
        "runs": {"training": run, "tier": ok},
    }
    (results / "run_all.json").write_text(json.dumps(meta))
    code, text, t = report(results, "--only", "tier,training")
    assert code == 1
    assert t[("training", "benchmark failed: exit status 1")]["pass"] == "**fail**"
    assert not any(bench == "training" and "DLRM" in figure for bench, figure in t)  # training.json is stale
    assert "RuntimeError: boom" in text.split("## training", 1)[1]
    assert "| training | **FAILED** | 3.0 s |" in text
    assert "benchmarks/bench_tier.py --quick` — 31 s" in text
    assert not any(bench in ("foundation", "serving") for bench, _ in t)  # not selected
    assert "with `--quick`" in text
    code, text, t = report(results)  # no --only: the benchmarks that run recorded
    assert {bench for bench, _ in t} == {"tier", "training"}


def test_unreadable_json_is_a_failure_naming_the_key(results: Path) -> None:
    broken = foundation_json()
    del broken["memory"]
    (results / "foundation.json").write_text(json.dumps(broken))
    code, text, t = report(results, "--skip", "serving")
    assert code == 1
    assert t[("foundation", "benchmark failed: foundation.json could not be read: KeyError: 'memory'")]
    assert not any(bench == "serving" for bench, _ in t)


def test_partial_serving_json_and_skipped_part(tmp_path: Path) -> None:
    (tmp_path / "serving-lookup.json").write_text(json.dumps(serving_json(("lookup",))))
    code, text, t = report(tmp_path, "--only", "serving")
    assert code == 0
    assert cells(t, "serving", "Lookup p99, concurrency 1") == ("1.50×", "≤ 1.5×", "pass")
    assert not any("ps-infer" in figure or "Freshness" in figure for _, figure in t)
    assert "infer part skipped: ps-infer not available" in text
    assert "From `serving-lookup.json`" in text


def test_target_text_and_ratio() -> None:
    assert headlines.pretty_target(">= 1.3x") == "≥ 1.3×"
    assert headlines.target_ratio("<= 1.5x") == 1.5
    assert headlines.target_ratio("<= 1 s, no timeouts") is None
    assert run_all.command(run_all.BY_NAME["serving"], True, ["--parts", "lookup"])[1:] == [
        "benchmarks/bench_serving.py",
        "--quick",
        "--parts",
        "lookup",
    ]
