"""Row-wise vs per-element Adagrad on the embeddings: AUC on the three real samples.

Row-wise Adagrad (``rowwise_adagrad``: one accumulator per row, TorchRec's and FBGEMM's
default) costs half the memory of per-element Adagrad (``adagrad``, the trainer's default). This
trains DLRM and DeepFM on each sample of ``../shared/data`` (Criteo, Avazu, MovieLens) with both,
on the README's split (the last 20% of the rows evaluate), for ``--seeds`` seeds (3), everything
else at its default; the same seed gives both optimizers the same data order and dense start.
It prints each pair's AUC, the mean |ΔAUC| and mean ΔAUC (row-wise minus per-element) per
dataset and overall, and writes JSON and a PNG.

Usage: ``python benchmarks/quality_rowwise.py [--seeds 3] [--datasets criteo,avazu,movielens]``
-> ``benchmarks/results/quality_rowwise.{json,png}`` (36 training runs, about 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout
sys.path.insert(1, str(Path(__file__).resolve().parent))

from quality_cv import DATA, FILES, FINAL, RESULTS, train_once  # noqa: E402

OPTIMIZERS = ("adagrad", "rowwise_adagrad")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--datasets", default="criteo,avazu,movielens")
    parser.add_argument("--models", default="dlrm,deepfm")
    args = parser.parse_args()
    datasets = [d for d in args.datasets.split(",") if (DATA / FILES[d]).is_file()]
    if not datasets:
        raise SystemExit(f"no sample of {args.datasets} under {DATA}: nothing to compare")
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for schema in datasets:
        for model in args.models.split(","):
            for seed in range(args.seeds):
                pair = {}
                for opt in OPTIMIZERS:
                    m = train_once(schema, model, FINAL, 0, 0.8, seed, {"sparse_optimizer": opt})
                    pair[opt] = float(m["auc"])
                runs.append({"dataset": schema, "model": model, "seed": seed, **pair})
                delta = pair["rowwise_adagrad"] - pair["adagrad"]
                print(
                    f"{schema:<10}{model:<7}seed {seed}: adagrad {pair['adagrad']:.4f} "
                    f"rowwise {pair['rowwise_adagrad']:.4f} delta {delta:+.4f}",
                    flush=True,
                )
    wall = time.perf_counter() - t0
    rows = []
    for schema in datasets:
        deltas = [r["rowwise_adagrad"] - r["adagrad"] for r in runs if r["dataset"] == schema]
        rows.append((schema, statistics.mean(map(abs, deltas)), statistics.mean(deltas), len(deltas)))
    every = [r["rowwise_adagrad"] - r["adagrad"] for r in runs]
    print(f"\nrow-wise minus per-element Adagrad, AUC on the last 20% ({args.seeds} seeds, DLRM and DeepFM)")
    print(f"{'dataset':<12}{'mean |dAUC|':>12}{'mean dAUC':>11}{'runs':>6}")
    for schema, mabs, mean, n in rows:
        print(f"{schema:<12}{mabs:>12.4f}{mean:>+11.4f}{n:>6}")
    print(f"{'all':<12}{statistics.mean(map(abs, every)):>12.4f}{statistics.mean(every):>+11.4f}{len(every):>6}")
    print(f"({2 * len(runs)} training runs, {wall:.0f} s)")
    RESULTS.mkdir(exist_ok=True)
    out = {"runs": runs, "mean_abs_delta": statistics.mean(map(abs, every)), "mean_delta": statistics.mean(every)}
    (RESULTS / "quality_rowwise.json").write_text(json.dumps(out, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG chart written")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['dataset']}\n{r['model']} s{r['seed']}" for r in runs]
    ax.bar(range(len(runs)), every, color=["tab:blue" if d >= 0 else "tab:red" for d in every])
    ax.axhline(0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(runs)), labels, fontsize=5, rotation=90)
    ax.set_ylabel("AUC: row-wise minus per-element Adagrad")
    fig.tight_layout()
    fig.savefig(RESULTS / "quality_rowwise.png", dpi=110)


if __name__ == "__main__":
    main()
