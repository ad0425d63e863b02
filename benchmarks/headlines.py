"""What each benchmark's JSON says, as headline rows for ``run_all``'s report.

A headline row is one figure beside its ceiling or peer measured in the same run, their ratio,
and the goal with pass/fail where the benchmark sets one. There is one reader per benchmark
(``READERS``): a pure function of the parsed JSON that returns a ``Section`` (the rows, plus
detail tables in Markdown). The layouts are the ones the benchmarks write (``bench_*.py``).
Where a JSON holds goals and pass/fail (training, serving), those are reported as they are;
foundation's and tier's JSON hold none: their goals are defined here (``FOUNDATION_GOALS``,
``TIER_GOAL``, ...), and ``bench_foundation.py`` and ``bench_tier.py`` import them. A reader raises ``KeyError``,
``TypeError`` or ``ValueError`` on a layout it does not know; ``run_all`` reports that as the
benchmark's failure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Goals of bench_foundation.py and bench_tier.py (their JSON has no goals): they import these.
FOUNDATION_GOALS = {"lookup": 0.6, "push": 0.48}  # ours / ceiling, GB/s
FOUNDATION_MEMORY_OVER_BYTES = 48  # bytes per row above the raw 128
FOUNDATION_READY_S = 2.0
TIER_GOAL = 0.35  # budget-10% (interval:5, LFU) rows/s / all-RAM rows/s
TIER_HIT_RATE_GOAL = 0.72  # the same run's RAM hit rate
TIER_FLAT = 0.25  # per-row lookup cost within +-25% around the middle, i.e. max/min <= 5/3


@dataclass(frozen=True)
class Headline:
    """One figure beside its ceiling or peer; ``passed`` is None where no goal applies.

    ``target`` is the goal as a ratio (for the chart's marker), None where the goal is not a
    ratio of these two figures; ``lower_is_better`` for latencies and sizes.
    """

    figure: str
    ours: str
    peer: str = ""
    ratio: float | None = None
    goal: str = ""
    passed: bool | None = None
    target: float | None = None
    lower_is_better: bool = False


@dataclass
class Section:
    """A benchmark's headline rows and its detail tables (Markdown lines)."""

    headlines: list[Headline] = field(default_factory=list)
    details: list[str] = field(default_factory=list)


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table; ``|`` inside a cell is escaped."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


def pretty_target(text: str) -> str:
    """A JSON target such as ``>= 1.3x`` as the report writes it (``≥ 1.3×``)."""
    text = text.replace("<=", "≤").replace(">=", "≥")
    return re.sub(r"(\d)x\b", r"\1×", text)


def target_ratio(text: str) -> float | None:
    """The number in a ratio target (``<= 1.5x`` -> 1.5); None unless it is a ratio."""
    found = re.search(r"(\d+(?:\.\d+)?)x\b", text)
    return float(found.group(1)) if found else None


def rate(x: float) -> str:
    """A count per second in a few digits: 5.34 M, 0.59 M, 86,085."""
    return f"{x / 1e6:.2f} M" if x >= 1e5 else f"{x:,.0f}"


def _goal_rows(goals: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {g["goal"]: g for g in goals}


def _with_goal(h: Headline, goal: dict[str, Any] | None) -> Headline:
    """``h`` with the JSON's goal (target text, pass) where the benchmark recorded one."""
    if goal is None:
        return h
    ratio = goal.get("ratio", h.ratio)
    return Headline(
        h.figure,
        h.ours,
        h.peer,
        ratio,
        pretty_target(str(goal["target"])),
        bool(goal["pass"]),
        target_ratio(str(goal["target"])),
        h.lower_is_better,
    )


# -- foundation ------------------------------------------------------------------------------


def foundation(res: dict[str, Any]) -> Section:
    """``foundation.json``: Lookup/Push vs the raw-bytes gRPC ceiling, memory per row, ready time."""
    out = Section()

    def speed(d: dict[str, float]) -> str:
        return f"{d['gb_per_s']:.2f} GB/s ({d['p50_ms']:.1f} ms)"

    summary = res["summary"]
    # "tuned" is the client's default (ClientConfig.tune_malloc=True), so it comes first.
    cases = [(mode, op, "") for mode in ("tuned", "default") for op in ("lookup", "push")]
    cases += [("tuned", op, "2") for op in ("lookup", "push")]
    for mode, op, two in cases:
        s = summary[mode]
        ratio, goal = s[f"{op}{two}_ratio"], FOUNDATION_GOALS[op]
        what = "2 calls in flight" if two else f"client malloc {mode}"
        out.headlines.append(
            Headline(
                f"{op.capitalize()} 64Ki keys × dim 64, {what}",
                speed(s[f"ours_{op}{two}"]),
                "ceiling " + speed(s[f"ceiling_{op}{two}"]),
                ratio,
                f"≥ {goal}×",
                ratio >= goal,
                goal,
            )
        )
    m = res["memory"]
    raw, per_row = m["raw_row_bytes"], m["bytes_per_row"]
    over = per_row - raw
    out.headlines.append(
        Headline(
            f"Memory per row, dim 16 Adagrad, {m['rows']:,} rows",
            f"{per_row:.1f} B (+{over:.1f} B)",
            f"raw {raw} B",
            per_row / raw,
            f"≤ +{FOUNDATION_MEMORY_OVER_BYTES} B",
            over <= FOUNDATION_MEMORY_OVER_BYTES,
            (raw + FOUNDATION_MEMORY_OVER_BYTES) / raw,
            lower_is_better=True,
        )
    )
    r = res["ready"]
    for label, s in (("warm numba cache, median", r["warm_median_s"]), ("cold numba cache", r["cold_s"])):
        out.headlines.append(
            Headline(
                f"ps-server ready (port file written), {label}",
                f"{s:.2f} s",
                goal=f"≤ {FOUNDATION_READY_S:g} s",
                passed=s <= FOUNDATION_READY_S,
            )
        )
    b = res.get("breakdown_ms")
    if b:
        rows = [
            (label, f"{b[k]:.2f}")
            for label, k in (
                ("Lookup: plan (dedup, group, pack)", "plan"),
                ("Lookup: encode", "encode"),
                ("Lookup: RPC wait", "rpc_wait"),
                ("… of which the shard's handler (in process)", "server_lookup"),
                ("Lookup: decode + scatter", "decode_scatter"),
                ("Push: plan + encode", "push_encode"),
                ("Push: RPC wait", "push_rpc_wait"),
                ("… of which the shard's handler (in process)", "server_push"),
            )
        ]
        out.details += ["Where a call's time goes (client tuned, median ms):", "", *md_table(("step", "ms"), rows), ""]
    out.details.append(
        f"First lookup+push after ready: cold {r['first_call_cold_s']:.2f} s, warm "
        f"{r['first_call_warm_median_s']:.2f} s (median)."
    )
    return out


# -- tier --------------------------------------------------------------------------------------


def tier(res: dict[str, Any]) -> Section:
    """``tier.json`` (or ``tier-<part>.json``): RocksDB tier vs all-RAM, lookup cost vs size, I/O vs raw."""
    out = Section()
    z = res.get("zipf_part")
    if z:
        for part, how in (("served", "through gRPC"), ("zipf", "in process")):
            ram = z[part][0]
            for r in z[part][1:]:
                mode = r["mode"].replace(" (gRPC)", "")
                ratio, goal = r["rows_per_s"] / ram["rows_per_s"], mode.endswith("interval:5") and part == "served"
                out.headlines.append(
                    Headline(
                        f"Zipf lookup+push, {r['rows']:,} rows, {mode}, {how}",
                        f"{rate(r['rows_per_s'])} rows/s",
                        f"all in RAM {rate(ram['rows_per_s'])} rows/s",
                        ratio,
                        f"≥ {TIER_GOAL}×" if goal else "",
                        ratio >= TIER_GOAL if goal else None,
                        TIER_GOAL if goal else None,
                    )
                )
                if goal:
                    hit = r["ram_hit_rate"]
                    out.headlines.append(
                        Headline(
                            f"RAM hit rate, Zipf, {r['rows']:,} rows, {mode}, {how}",
                            f"{hit:.3f}",
                            "",
                            None,
                            f"≥ {TIER_HIT_RATE_GOAL}",
                            hit >= TIER_HIT_RATE_GOAL,
                            None,
                        )
                    )
        rows = [
            (
                r["mode"],
                f"{rate(r['rows_per_s'])}",
                f"{r['ram_hit_rate']:.2f}",
                f"{r['faulted_in_per_step']:,.0f} / {r['written_per_step']:,.0f}",
                f"{r['step_ms']:.2f}",
            )
            for part in ("served", "zipf")
            for r in z[part]
        ]
        out.details += md_table(("mode", "rows/s", "RAM hit rate", "faulted in / written per step", "step ms"), rows)
        f, r_ms, tier_run = z["floor"], z["served"][0]["step_ms"], z["served"][1]
        io = f["read_ms"] + f["write_ms"]
        out.details += [
            "",
            f"Raw rocksdict I/O of one gRPC tier step: read {f['read_ms']:.2f} ms + write "
            f"{f['write_ms']:.2f} ms = {io:.2f} ms (all-RAM step {r_ms:.2f} ms). Best ratio a design doing "
            f"that I/O could reach: {r_ms / (r_ms + io):.2f}× with no overlap, "
            f"{r_ms / (r_ms + io / f['cores']):.2f}× spread over {f['cores']:.0f} cores; the tier: "
            f"{r_ms / tier_run['step_ms']:.2f}×.",
            "",
        ]
    scale = res.get("scale") or []
    if scale:
        costs = [s["us_per_row"] for s in scale]
        lo, hi = min(costs), max(costs)
        mid = (hi + lo) / 2
        within = max(abs(c - mid) / mid for c in costs)
        sizes = f"{scale[0]['rows'] / 1e6:g}M–{scale[-1]['rows'] / 1e6:g}M"
        out.headlines.append(
            Headline(
                f"Lookup cost per row, {sizes} rows stored (10% resident), max vs min",
                f"{hi:.2f} µs",
                f"{lo:.2f} µs",
                hi / lo,
                f"flat ±{TIER_FLAT:.0%} (≤ 1.67×)",
                within <= TIER_FLAT,
                (1 + TIER_FLAT) / (1 - TIER_FLAT),
                lower_is_better=True,
            )
        )
        out.details += md_table(
            ("rows stored", "µs per looked-up row", "RAM hit rate", "restart to first lookup"),
            [
                (
                    f"{s['rows']:,}",
                    f"{s['us_per_row']:.3f}",
                    f"{s['ram_hit_rate']:.2f}",
                    f"{s['restart_ready_s']:.2f} s",
                )
                for s in scale
            ],
        )
        out.details.append("")
    io_res = res.get("io")
    if io_res:
        for op in ("write", "read"):
            out.headlines.append(
                Headline(
                    f"RocksDB {op}, {io_res['rows']:,} rows of {io_res['record_bytes']} B, tier",
                    f"{rate(io_res[f'tier_{op}_rows_per_s'])} rows/s",
                    f"raw rocksdict {rate(io_res[f'raw_{op}_rows_per_s'])} rows/s",
                    io_res[f"{op}_ratio"],
                )
            )
    if not out.headlines:
        raise ValueError("no part in this JSON (zipf_part, scale, io)")
    return out


# -- training ----------------------------------------------------------------------------------


def training(res: dict[str, Any]) -> Section:
    """``training.json``: DLRM samples/s of our variants vs the faster in-process baseline."""
    out = Section()
    variants, best = res["variants"], res["best_baseline"]
    peer = variants[best]["samples_per_s"] if best else math.nan
    for name, s in variants.items():
        if name == best:
            continue
        ratio = s["samples_per_s"] / peer if best else None
        h = Headline(
            f"DLRM training, {name}",
            f"{s['samples_per_s']:,.0f} samples/s",
            f"{best} {peer:,.0f} samples/s" if best else "no baseline ran",
            ratio,
        )
        if name == "ours pipelined" and "goal" in res:
            h = Headline(
                h.figure,
                h.ours,
                h.peer,
                res.get("ratio", ratio),
                f"≥ {res['goal']}×",
                bool(res["pass"]),
                float(res["goal"]),
            )
        out.headlines.append(h)
        if name == "ours pipelined" and "cpu_goal" in res and best:
            out.headlines.append(
                Headline(
                    "DLRM training, ours pipelined, samples per CPU-second (worker + shards)",
                    f"{s['samples_per_cpu_s']:,.0f}",
                    f"{best} {variants[best]['samples_per_cpu_s']:,.0f}",
                    res["cpu_ratio"],
                    f"≥ {res['cpu_goal']}×",
                    bool(res["cpu_pass"]),
                    float(res["cpu_goal"]),
                )
            )
    tr = res.get("torchrec", {})
    if tr.get("skipped"):
        out.details.append(f"TorchRec not measured: {tr.get('status', '?')}")
    unclean = [n for n, s in variants.items() if s.get("clean_rounds") == 0]
    if unclean:
        out.details.append(
            f"**No clean round** (other processes used the cores throughout): {', '.join(unclean)}; "
            "their figures measure the contention."
        )
    phases = list(next(iter(variants.values()))["phases_ms_per_step"])
    rows = [
        (
            name,
            *(f"{s['phases_ms_per_step'][p]:.1f}" for p in phases),
            f"{s['wall_ms_per_step']:.1f}",
            f"{s.get('clean_rounds', '?')}/{len(s.get('round_samples_per_s', []))}",
        )
        for name, s in variants.items()
    ]
    out.details += ["", "ms per step:", "", *md_table(("variant", *phases, "wall", "clean rounds"), rows)]
    if "datagen_ms_per_batch" in res:
        out.details += ["", f"Data generation (not in the figures): {res['datagen_ms_per_batch']:.1f} ms per batch."]
    return out


# -- serving -----------------------------------------------------------------------------------


CPU_KEYS = ("client_cpu_ms_per_request", "server_cpu_ms_per_request")


def _cpu(cell: dict[str, Any]) -> float:
    return float(cell[CPU_KEYS[0]] + cell[CPU_KEYS[1]])


def _latency(cell: dict[str, Any]) -> str:
    text = f"p50 {cell['p50_ms']:.2f} ms, p99 {cell['p99_ms']:.2f} ms, {cell['requests_per_s']:.0f}/s"
    if all(k in cell for k in CPU_KEYS):
        text += f"; CPU {cell[CPU_KEYS[0]]:.2f} + {cell[CPU_KEYS[1]]:.2f} ms/request (client + servers)"
    return text


def serving(res: dict[str, Any]) -> Section:
    """``serving.json`` (or ``serving-<parts>.json``): lookup vs the ceiling and Redis, ps-infer vs
    the in-process predictor, follower freshness."""
    out = Section()
    lk = res.get("lookup")
    if lk:
        cells, goals = lk["cells"], _goal_rows(lk.get("goals", []))
        for c in cells["ours"]:
            ours, ceil = cells["ours"][c], cells["ceiling"][c]
            redis = max((n for n in cells if n.startswith("redis")), key=lambda n: cells[n][c]["requests_per_s"])
            out.headlines += [
                Headline(
                    f"Lookup requests/s, concurrency {c}",
                    f"{ours['requests_per_s']:,.0f}/s",
                    f"ceiling {ceil['requests_per_s']:,.0f}/s",
                    ours["requests_per_s"] / ceil["requests_per_s"],
                ),
                _with_goal(
                    Headline(
                        f"Lookup p99, concurrency {c}",
                        f"{ours['p99_ms']:.2f} ms",
                        f"ceiling {ceil['p99_ms']:.2f} ms",
                        ours["p99_ms"] / ceil["p99_ms"],
                        lower_is_better=True,
                    ),
                    goals.get(f"p99 vs ceiling, concurrency {c}"),
                ),
                _with_goal(
                    Headline(
                        f"Lookup requests/s vs Redis, concurrency {c}",
                        f"{ours['requests_per_s']:,.0f}/s",
                        f"{redis} {cells[redis][c]['requests_per_s']:,.0f}/s",
                        ours["requests_per_s"] / cells[redis][c]["requests_per_s"],
                    ),
                    goals.get(f"requests/s vs {redis}, concurrency {c}"),
                ),
            ]
            if CPU_KEYS[0] in ours and CPU_KEYS[0] in ceil:  # bench_serving records CPU since 71b56ce
                a, b = _cpu(ours), _cpu(ceil)
                out.headlines.append(
                    Headline(
                        f"Lookup CPU per request (client + servers), concurrency {c}",
                        f"{a:.2f} ms",
                        f"ceiling {b:.2f} ms",
                        a / b,
                        lower_is_better=True,
                    )
                )
        st = lk.get("setup", {})
        out.details += [
            f"Lookup: {st.get('keys_per_request', 0):,} keys × dim {st.get('dim', '?')} per request from "
            f"{st.get('shards', '?')} shards (`--mode {st.get('ps_mode', '?')}`), {st.get('rows', 0):,} rows:",
            "",
            *md_table(
                ("system", *(f"concurrency {c}" for c in cells["ours"])),
                [(n, *(_latency(by_c[c]) for c in by_c)) for n, by_c in cells.items()],
            ),
            "",
        ]
    inf = res.get("infer")
    if inf and "cells" in inf:
        cells, goals = inf["cells"], _goal_rows(inf.get("goals", []))
        for c in cells["ps-infer"]:
            a, b = cells["ps-infer"][c], cells["in-process"][c]
            out.headlines.append(
                _with_goal(
                    Headline(
                        f"ps-infer Predict requests/s, concurrency {c}",
                        f"{a['requests_per_s']:,.0f}/s",
                        f"in-process predictor {b['requests_per_s']:,.0f}/s",
                        a["requests_per_s"] / b["requests_per_s"],
                    ),
                    goals.get(f"ps-infer requests/s vs in-process, concurrency {c}"),
                )
            )
        out.details += [
            "ps-infer vs the in-process predictor:",
            "",
            *md_table(
                ("system", *(f"concurrency {c}" for c in cells["ps-infer"])),
                [(n, *(_latency(by_c[c]) for c in by_c)) for n, by_c in cells.items()],
            ),
            "",
        ]
    elif inf:
        out.details.append(f"infer part skipped: {inf.get('skipped', '?')}")
    fr = res.get("freshness")
    if fr and "under_load" in fr:
        load, idle = fr["under_load"], fr["idle"]
        goal = (fr.get("goals") or [None])[0]
        h = Headline(
            "Freshness: push ack → visible on a follower, p99 under training load",
            f"{load['p99_ms']:.1f} ms",
            f"idle {idle['p99_ms']:.1f} ms",
            load["p99_ms"] / idle["p99_ms"],
            lower_is_better=True,
        )
        if goal is not None:  # an absolute goal (seconds), not a ratio of these two
            h = Headline(
                h.figure,
                h.ours,
                h.peer,
                h.ratio,
                pretty_target(str(goal["target"])),
                bool(goal["pass"]),
                lower_is_better=True,
            )
        out.headlines.append(h)
        out.details += [
            f"Freshness: idle p50 {idle['p50_ms']:.1f} ms, p99 {idle['p99_ms']:.1f} ms; under load p50 "
            f"{load['p50_ms']:.1f} ms, p99 {load['p99_ms']:.1f} ms, max {load['max_ms']:.1f} ms, "
            f"{load['timeouts']} timeouts; load {fr['load']['pushes_per_s']:.0f} pushes/s."
        ]
    elif fr:
        out.details.append(f"freshness part skipped: {fr.get('skipped', '?')}")
    if not out.headlines:
        raise ValueError("no part with figures in this JSON (lookup, infer, freshness)")
    return out


# -- reshard ---------------------------------------------------------------------------------


def reshard(res: dict[str, Any]) -> Section:
    """``reshard.json``: a live 2 -> 3 move's rows/s against a lookup of the same rows and the
    durable-write floor, and training's samples/s during moves against steady training."""
    out = Section()
    rows, move, goals, passed, r = res["rows"], res["move"], res["goals"], res["passed"], res["ratios"]
    what = f"Live reshard 2 → 3 shards, {rows:,} rows of dim {res['dim']}"
    out.headlines.append(
        Headline(
            f"{what}, rows moved/s",
            f"{rate(move['rows_per_s'])} rows/s",
            f"lookup {rate(res['lookup']['rows_per_s'])} rows/s",
            r["move_vs_lookup"],
            f"≥ {goals['move_vs_lookup']}×",
            bool(passed["move_vs_lookup"]),
            float(goals["move_vs_lookup"]),
        )
    )
    out.headlines.append(
        Headline(
            f"{what}, rows moved/s vs writing them durably",
            f"{rate(move['rows_per_s'])} rows/s",
            f"RocksDB write floor {rate(res['write_floor_rows_per_s'])} rows/s",
            r["move_vs_write_floor"],
        )
    )
    training, steady = res["training"], res["training"]["steady"]["samples_per_s"]
    for key, name in (("during_move", "a move"), ("during_paced_move", "a paced move")):
        ratio_key = f"training_{key}"
        out.headlines.append(
            Headline(
                f"Training samples/s during {name}",
                f"{rate(training[key]['samples_per_s'])}/s",
                f"steady {rate(steady)}/s",
                r[ratio_key],
                f"≥ {goals['training_during_move']}×",
                bool(passed[ratio_key]),
                float(goals["training_during_move"]),
            )
        )
    out.headlines.append(
        Headline(
            f"{what}, bytes moved vs jump-hash expectation (off by)",
            f"{move['bytes_moved'] / 1e6:,.1f} MB",
            f"expected {move['bytes_expected'] / 1e6:,.1f} MB",
            r["bytes_vs_expected"],
            f"≤ {goals['bytes_vs_expected']}",
            bool(passed["bytes_vs_expected"]),
            None,
            lower_is_better=True,
        )
    )
    phases = move.get("phases_s", {})
    out.details += [
        "",
        "Seconds per step of the idle move:",
        "",
        *md_table(tuple(phases), [tuple(f"{v:.2f}" for v in phases.values())]),
        "",
        *md_table(
            ("training", "samples/s", "median step s", "slowest step s"),
            [
                (k, rate(v["samples_per_s"]), f"{v['median_step_s']:.3f}", f"{v['slowest_step_s']:.3f}")
                for k, v in training.items()
                if isinstance(v, dict)
            ],
        ),
    ]
    return out


def resume(res: dict[str, Any]) -> Section:
    """``resume.json``: a worker's death to its group's first step after the restart, against
    a cold start of the same group (median over the kills)."""
    out = Section()
    out.headlines.append(
        Headline(
            f"Resume after a worker's kill -9, {res['rows']:,} rows, {res['workers']} workers",
            f"{res['resume_s']:.2f} s",
            f"cold start {res['cold_start_s']:.2f} s",
            res["resume_over_cold_start"],
            f"≤ {res['goal_s']:g} s",
            bool(res["pass"]),
            None,
            lower_is_better=True,
        )
    )
    phases = list(res["rounds"][0]["phases_s"])
    rows = [
        (str(i + 1), f"{r['resume_s']:.2f}", *(f"{r['phases_s'][k]:.2f}" for k in phases))
        for i, r in enumerate(res["rounds"])
    ]
    out.details += ["", *md_table(("kill", "death → first step s", *phases), rows)]
    return out


READERS: dict[str, Callable[[dict[str, Any]], Section]] = {
    "foundation": foundation,
    "tier": tier,
    "training": training,
    "serving": serving,
    "reshard": reshard,
    "resume": resume,
}
