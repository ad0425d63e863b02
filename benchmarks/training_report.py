"""The training benchmark's printed report and chart (``bench_training.py`` measures).

Example:
    >>> PHASES[0]
    'prefetch'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BATCH, DIM, SHARDS = 4096, 16, 2
QUIET_CORES = 0.2  # a round is clean when other processes used fewer cores than this during it
GOAL, CPU_GOAL = 0.8, 0.9  # ours' samples/s, and samples per CPU-second, against the best baseline
FLOOR = "floor: dense tower alone"
COMPACT = "ours pipelined, bfloat16 rows and wire"  # storage, optimizer state and wire at 16 bits
COMPACT_GOAL = 1.1  # its samples/s against ours pipelined at float32
PHASES = ("prefetch", "lookup", "forward", "backward", "step")


def report(res: dict[str, Any]) -> str:
    v, best = res["variants"], res["best_baseline"]
    rows = [("variant", "samples/s", "rounds: samples/s (others' cores)", f"vs {best or '-'}", "goal", "pass")]
    for name, s in v.items():
        ratio = s["samples_per_s"] / v[best]["samples_per_s"] if best else float("nan")
        goal = name == "ours pipelined" and best is not None
        per_round = [
            f"{x:,.0f} ({o:.1f}{'' if o < QUIET_CORES else '*'})"
            for x, o in zip(s["round_samples_per_s"], s["round_others_cores"])
        ]
        rows.append(
            (
                name,
                f"{s['samples_per_s']:,.0f}",
                " ".join(per_round),
                f"{ratio:.2f}x",
                f">= {GOAL}x" if goal else "-",
                str(ratio >= GOAL) if goal else "-",
            )
        )
    if best:
        rows.append(
            (
                "ours pipelined, samples per CPU-second",
                f"{v['ours pipelined']['samples_per_cpu_s']:,.0f}",
                f"{best}: {v[best]['samples_per_cpu_s']:,.0f}",
                f"{res['cpu_ratio']:.2f}x",
                f">= {CPU_GOAL}x",
                str(res["cpu_pass"]),
            )
        )
    if res["torchrec"]["skipped"]:
        rows.append(("(b) TorchRec", "skipped", res["torchrec"]["status"][:60], "-", "-", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(
        f"samples/s: median of the clean rounds; * = other processes used >= {QUIET_CORES} cores during the "
        "round, left out of every figure (unless no round of that variant was clean)"
    )
    if best:
        lines.append(
            f"floor: {res['floor']['variant']} (no embedding work) runs {res['floor']['ratio']:.2f}x {best}: "
            "the most ours pipelined could reach with its embeddings free"
        )
    if "compact" in res:
        c = res["compact"]
        lines.append(
            f"{COMPACT}: {c['ratio']:.2f}x ours pipelined at float32 (goal >= {c['goal']}x: "
            f"{'met' if c['pass'] else 'MISSED'}); the floor above bounds both"
        )
        if "sparse_alone" in c:
            a = c["sparse_alone"]
            ms = a["ms_per_step"]
            lines.append(
                f"the sparse traffic alone (each step's lookups and pushes, no dense tower): float32 "
                f"{ms['float32']:.1f} ms, 16-bit {ms['bfloat16']:.1f} ms per step ({a['ratio']:.2f}x): "
                "what 16 bits could win at most"
            )
    if any(s["clean_rounds"] == 0 for s in v.values()):
        lines.append(
            "WARNING: a variant had no clean round: its figures measure the contention, not us; "
            "run again on a quiet machine"
        )
    names = list(v)
    lines += [
        "",
        "Breakdown, ms per step (mean over the clean rounds' steps; 'lookup' = inside emb(...) / the embedding module):",
        f"  {'':<36}" + "".join(f"{n:>26}" for n in names),
    ]
    table = [
        (
            f"{k}" + (" (plan + submit next lookup)" if k == "prefetch" else ""),
            [v[n]["phases_ms_per_step"][k] for n in names],
        )
        for k in PHASES
    ]
    table += [
        ("sum of phases", [sum(v[n]["phases_ms_per_step"].values()) for n in names]),
        ("wall per step (round wall / steps)", [v[n]["wall_ms_per_step"] for n in names]),
        ("worker CPU per step", [v[n]["worker_cpu_ms_per_step"] for n in names]),
        ("shard CPU per step (both shards)", [sum(v[n].get("shard_cpu_ms_per_step", [0.0])) for n in names]),
        ("cores busy (our CPU / wall)", [v[n]["cores_busy"] for n in names]),
        ("samples per CPU-second (ours all)", [v[n]["samples_per_cpu_s"] for n in names]),
    ]
    lines += [f"  {label:<36}" + "".join(f"{x:>26.2f}" for x in xs) for label, xs in table]
    lines.append(
        f"  data generation (synthetic_criteo, inline in the trainer, excluded above): {res['datagen_ms_per_batch']:.1f} ms/batch"
    )
    p = v["ours pipelined"]
    lines.append(
        f"  ours pipelined with it inline (sequential estimate): {BATCH / (p['wall_ms_per_step'] + res['datagen_ms_per_batch']) * 1e3:,.0f} samples/s"
    )
    for name in [n for n in names if n.startswith("ours")]:
        s = v[name]
        ps = s["per_step"]
        lines.append(f"\nShards per step, {name}:")
        for i in range(SHARDS):
            lines.append(
                f"  shard {i}: {ps[f'shard{i}_lookups']:,.0f} keys looked up, {ps[f'shard{i}_pushes']:,.0f} pushed, "
                f"{ps[f'shard{i}_rows_created']:,.0f} rows created; CPU {s['shard_cpu_ms_per_step'][i]:.1f} ms"
            )
        lines.append(
            f"  client lookup_many {s['client_lookup_ms_per_call']:.1f} ms/call, push_many {s['client_push_ms_per_call']:.1f} ms/call "
            f"(wall, on the pipeline's background threads)"
        )
    return "\n".join(lines)


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # here only: measuring does not need it

    v, best = res["variants"], res["best_baseline"]
    names = list(v)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    ax1.bar(
        range(len(names)),
        [v[n]["samples_per_s"] for n in names],
        color=["C0" if n.startswith("ours") else "C1" for n in names],
    )
    if best:
        ax1.axhline(GOAL * v[best]["samples_per_s"], color="black", ls="--", label=f"goal: {GOAL}x {best}")
        ax1.legend(fontsize=8)
    ax1.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
    ax1.set(
        ylabel="samples/s", title=f"DLRM, 26 tables x dim {DIM}, batch {BATCH}, {res['machine']['nproc']} CPU cores"
    )
    for y, n in enumerate(names):
        left = 0.0
        for i, k in enumerate(PHASES):
            x = v[n]["phases_ms_per_step"][k]
            ax2.barh(y, x, left=left, color=f"C{i}", label=k if y == 0 else None)
            left += x
    ax2.set(yticks=range(len(names)), yticklabels=names, xlabel="ms per step (mean)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
