"""Quality by blocked cross-validation: DLRM and DeepFM (default settings) vs. a hashed logistic regression.

The README's quality table is one split (the last 20% of the rows evaluate). Moving the
evaluation block moves AUC by more than the seed does, so defaults are judged here on every
block: each sample in ``../shared/data`` is cut into ``--folds`` contiguous blocks (5 by default:
its fifths, in row order), and each block in turn evaluates a model trained on the others
(``TrainerConfig.folds``/``eval_fold`` with ``train_fraction=1``, so the trainer chooses its batch
size and epochs on those rows as it always does), for ``--seeds`` seeds. The last fifth is the
README's split. ``--training-rows-only`` cuts only the first 80% into blocks (the last 20% never
read). Per dataset and model: the mean AUC, its standard deviation and min-max over every (fold,
seed), how many runs beat the hashed LR on the same block, and the mean difference from it on
each block; then, per block, that difference with its 95% interval from a paired bootstrap of
the block's rows (``BOOTSTRAP`` resamples, each scoring the LR and every seed's model), so a
shortfall within the noise of a block of 2,000 rows reads as such.

The hashed LR is the sanity baseline of ``../shared/data/README.md``, written again here: one-hot
logistic regression on 2^20 hashed buckets (the keys the trainer's readers make, Criteo's counts
as log-scale buckets, plus a bias), per-row Adagrad with lr 0.05 from zeros, 3 epochs in row order.
It has no seed. On the last-20% split (``--final``) it gives the data README's AUCs within noise.

``--set name:key=value,key=value`` adds a candidate setting (a TrainerConfig field per key), run on
the same folds and seeds as the defaults, to see whether a change of default holds over the folds.
``--final`` also runs every model on the last-20% split (the README's), for ``--seeds`` seeds:
reported beside the CV, never used to choose.

Every run trains in this process against 2 local shards started for it (``deploy.train.run``),
one at a time. Results are appended to the JSON as they come; ``--resume`` skips the runs the JSON
already holds, so an interrupted run can go on.

Usage: ``python benchmarks/quality_cv.py [--quick] [--folds 5] [--seeds 2] [--datasets criteo,avazu]
[--models dlrm,deepfm] [--set NAME:key=value,...] [--training-rows-only] [--final] [--resume]``
-> ``benchmarks/results/quality_cv.{json,png,npz}`` (the npz: every run's predictions, for the
intervals and ``--resume``). ``--quick`` (a few minutes): fold 0 only, one
seed (6 training runs). The full run (every fifth of the three samples, 2 models, 2 seeds: 60
training runs) takes about 20 minutes on 2 shared cores; each ``--set`` adds about 10 per seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from deploy.train import run  # noqa: E402
from worker.config import TrainerConfig  # noqa: E402
from worker.data import auc, load_click_log, logloss  # noqa: E402
from worker.dataset import SCHEMAS, cv_fold  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DATA = REPO.parent / "shared" / "data"
FILES = {
    "criteo": "criteo_kaggle_train_head10k.txt",
    "avazu": "avazu_train_head10k.csv",
    "movielens": "movielens_ml-100k_u.data",
}
TRAIN_FRACTION = 0.8
LR_BITS, LR_RATE, LR_EPOCHS = 20, 0.05, 3
FINAL = -1  # the "fold" of a run on the README's split: the last 20% evaluate


# --- the hashed logistic regression


@numba.njit(cache=True)
def _lr_fit(buckets: npt.NDArray[np.int64], labels: npt.NDArray[np.float32], epochs: int, lr: float) -> Any:
    """Per-row Adagrad on a one-hot LR; ``buckets`` ``[n, F]`` (column 0 the bias bucket)."""
    w = np.zeros(1 << LR_BITS, np.float64)
    g2 = np.zeros(1 << LR_BITS, np.float64)
    n, f = buckets.shape
    for _ in range(epochs):
        for i in range(n):
            z = 0.0
            for j in range(f):
                z += w[buckets[i, j]]
            p = 1.0 / (1.0 + np.exp(-max(-35.0, min(35.0, z))))
            g = p - labels[i]
            for j in range(f):
                b = buckets[i, j]
                g2[b] += g * g
                if g2[b] > 0.0:
                    w[b] -= lr * g / np.sqrt(g2[b])
    return w


def _lr_buckets(keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``[F, n]`` keys -> ``[n, F + 1]`` bucket ids, the bias bucket (0) first."""
    mask = (1 << LR_BITS) - 1
    b = (keys.view(np.uint64) & np.uint64(mask)).astype(np.int64).T
    return np.ascontiguousarray(np.concatenate([np.zeros((b.shape[0], 1), np.int64), b], axis=1))


def hashed_lr(schema: str, fold: int, folds: int, fraction: float) -> dict[str, float]:
    """AUC and logloss of the hashed LR on one fold of the first ``fraction`` of the rows
    (``FINAL``: the last 20% of the rows)."""
    rows = load_click_log(DATA / FILES[schema], SCHEMAS[schema]())
    n_train = int(len(rows) * TRAIN_FRACTION)
    if fold != FINAL:
        rows, n_train = cv_fold(rows[: int(len(rows) * fraction)], folds, fold)
    buckets, labels = _lr_buckets(rows.keys), rows.labels
    w = _lr_fit(buckets[:n_train], labels[:n_train], LR_EPOCHS, LR_RATE)
    z = np.clip(w[buckets[n_train:]].sum(axis=1), -35.0, 35.0)
    p = 1.0 / (1.0 + np.exp(-z))
    y = labels[n_train:]
    return {"auc": auc(y, p), "logloss": logloss(y, p), "samples": float(len(y)), "labels": y, "predictions": p}


# --- the trainer's models


def train_once(
    schema: str, model: str, fold: int, folds: int, fraction: float, seed: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    """One trainer run (default settings plus ``overrides``) on one fold of the first ``fraction``
    of the rows; its final metrics and choices."""
    with tempfile.TemporaryDirectory(prefix="quality-cv-") as out:
        cv: dict[str, Any] = {} if fold == FINAL else {"folds": folds, "eval_fold": fold, "train_fraction": fraction}
        config = TrainerConfig(
            data=str(DATA / FILES[schema]),
            schema=schema,
            model=model,
            seed=seed,
            device="cpu",
            progress=False,
            log_level="WARNING",
            output_dir=Path(out),
            **cv,
            **overrides,
        )
        m = run(config)
        predictions = np.load(Path(out) / "predictions.npy")  # the evaluation block's, in row order
    return {
        **m["final"],
        "predictions": predictions,
        "epochs": int(m["config"]["epochs"]),
        "batch_size": int(m["config"]["batch_size"]),
        "train_rows": m["data"]["train_rows"],
        # eval_serve_dtype: the same model scored with rows as such serving shards hold them
        **({"served_auc": m["final_served"]["auc"]} if "final_served" in m else {}),
    }


def parse_set(text: str) -> tuple[str, dict[str, Any]]:
    """``name:key=value,key=value`` -> (name, overrides typed as the TrainerConfig fields)."""
    name, _, rest = text.partition(":")
    types = {f.name: f.type for f in dataclasses.fields(TrainerConfig)}
    overrides: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"--set {text}: {key!r} is not a TrainerConfig field")
        kind = str(types[key])
        overrides[key] = (
            value.lower() in ("1", "true", "yes")
            if kind == "bool"
            else int(value)
            if kind == "int"
            else float(value)
            if kind == "float"
            else value
        )
    if not name or not overrides:
        raise SystemExit(f"--set {text}: expected NAME:key=value[,key=value]")
    return name, overrides


# --- summary


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dataset, variant, split): mean, std, min, max AUC; wins over LR on the same fold."""
    lr = {(r["dataset"], r["fold"]): r["auc"] for r in runs if r["variant"] == "hashed LR"}
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        split = "final" if r["fold"] == FINAL else "cv"
        groups.setdefault((r["dataset"], r["variant"], split), []).append(r)
    out = []
    for (dataset, variant, split), rs in sorted(groups.items()):
        aucs = [r["auc"] for r in rs]
        deltas = [r["auc"] - lr[(dataset, r["fold"])] for r in rs if (dataset, r["fold"]) in lr]
        per_fold: dict[int, list[float]] = {}
        for r in rs:
            if (dataset, r["fold"]) in lr:
                per_fold.setdefault(r["fold"], []).append(r["auc"] - lr[(dataset, r["fold"])])
        out.append(
            {
                "dataset": dataset,
                "variant": variant,
                "split": split,
                "runs": len(rs),
                "mean": statistics.fmean(aucs),
                "std": statistics.stdev(aucs) if len(aucs) > 1 else 0.0,
                "min": min(aucs),
                "max": max(aucs),
                "mean_minus_lr": statistics.fmean(deltas) if deltas else None,
                "std_minus_lr": statistics.stdev(deltas) if len(deltas) > 1 else 0.0,
                "min_minus_lr": min(deltas) if deltas else None,
                "wins": sum(d > 0 for d in deltas),
                "compared": len(deltas),
                "folds_won_on_mean": sum(statistics.fmean(v) >= 0 for v in per_fold.values()),
                "per_fold_minus_lr": {f: statistics.fmean(v) for f, v in sorted(per_fold.items())},
                "folds": len(per_fold),
                "epochs": sorted({r["epochs"] for r in rs if "epochs" in r}),
            }
        )
    return out


BOOTSTRAP = 1000  # resamples of a block's evaluation rows for the 95% interval of (model - LR)


def block_intervals(runs: list[dict[str, Any]], arrays: dict[str, npt.NDArray[Any]]) -> list[dict[str, Any]]:
    """Per (dataset, variant, block): the model's AUC minus the LR's, averaged over seeds, and
    its 95% interval from a paired bootstrap of the block's rows (the same resample scores the
    LR and every seed's model), so a difference within the noise of the block says so."""
    out = []
    keyed = {(r["dataset"], r["variant"], r["fold"], r["seed"]) for r in runs}
    for dataset, variant, fold in sorted({(d, v, f) for d, v, f, _ in keyed if v != "hashed LR" and f != FINAL}):
        y, base = arrays.get(f"labels|{dataset}|{fold}"), arrays.get(f"{dataset}|hashed LR|{fold}|None")
        seeds = sorted(s for d, v, f, s in keyed if (d, v, f) == (dataset, variant, fold))
        models = [arrays.get(f"{dataset}|{variant}|{fold}|{s}") for s in seeds]
        if y is None or base is None or any(m is None or m.shape != y.shape for m in models):
            continue
        rng = np.random.default_rng(0)
        diffs = []
        for _ in range(BOOTSTRAP):
            i = rng.integers(0, len(y), len(y))
            if 0 < y[i].sum() < len(i):
                diffs.append(statistics.fmean(auc(y[i], m[i]) for m in models) - auc(y[i], base[i]))  # type: ignore[index]
        point = statistics.fmean(auc(y, m) for m in models) - auc(y, base)  # type: ignore[arg-type]
        lo, hi = np.percentile(diffs, [2.5, 97.5])
        out.append(
            {"dataset": dataset, "variant": variant, "block": fold, "seeds": len(seeds), "minus_lr": point}
            | {"ci95": [float(lo), float(hi)]}
        )
    return out


def block_table(blocks: list[dict[str, Any]]) -> str:
    lines = ["| data | model | block | seeds | AUC − LR | 95% interval |", "|---|---|---|---|---|---|"]
    for b in blocks:
        lo, hi = b["ci95"]
        lines.append(
            f"| {b['dataset']} | {b['variant']} | {b['block']} | {b['seeds']} | {b['minus_lr']:+.4f} | "
            f"[{lo:+.4f}, {hi:+.4f}] |"
        )
    return "\n".join(lines)


def table(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| data | split | model | runs | mean AUC | std | min-max | mean - LR | std of - LR | worst - LR | beats LR (runs) "
        "| ≥ LR (block means) | − LR per block (mean over seeds) | epochs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        vs = s["variant"] == "hashed LR"
        lines.append(
            f"| {s['dataset']} | {s['split']} | {s['variant']} | {s['runs']} | {s['mean']:.4f} | {s['std']:.4f} | "
            f"{s['min']:.4f}-{s['max']:.4f} | "
            + (
                "| | | | | | |"
                if vs
                else f"{s['mean_minus_lr']:+.4f} | {s['std_minus_lr']:.4f} | {s['min_minus_lr']:+.4f} | {s['wins']}/{s['compared']} | "
                f"{s['folds_won_on_mean']}/{s['folds']} | "
                + " ".join(f"{d:+.4f}" for d in s["per_fold_minus_lr"].values())
                + f" | {','.join(map(str, s['epochs']))} |"
            )
        )
    return "\n".join(lines)


def chart(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # here only: measuring does not need it

    datasets = sorted({r["dataset"] for r in runs})
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4.5), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        rs = [r for r in runs if r["dataset"] == dataset and r["fold"] != FINAL]
        variants = sorted({r["variant"] for r in rs}, key=lambda v: (v != "hashed LR", v))
        folds = sorted({r["fold"] for r in rs})
        for i, v in enumerate(variants):
            for f in folds:
                ys = [r["auc"] for r in rs if r["variant"] == v and r["fold"] == f]
                x = f + (i - (len(variants) - 1) / 2) * 0.8 / max(1, len(variants))
                ax.scatter([x] * len(ys), ys, s=18, color=f"C{i}", label=v if f == folds[0] else None)
        ax.set_title(f"{dataset}: AUC per evaluation block")
        ax.set_xlabel("evaluation block (contiguous, in row order)")
        ax.set_xticks(folds)
        ax.set_ylabel("AUC")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fold 0 and one seed only (a few minutes)")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument(
        "--training-rows-only",
        action="store_true",
        help="cut only the first 80%% of the rows into blocks (the last 20%% never read); default: every row",
    )
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--datasets", default=",".join(FILES))
    ap.add_argument("--models", default="dlrm,deepfm")
    ap.add_argument("--set", action="append", default=[], metavar="NAME:key=value,...")
    ap.add_argument("--final", action="store_true", help="also run the last-20%% split (reported, not used)")
    ap.add_argument("--resume", action="store_true", help="keep the runs the JSON holds, do the rest")
    ap.add_argument("--out", default=str(RESULTS / "quality_cv.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    datasets = [d for d in args.datasets.split(",") if d]
    missing = [d for d in datasets if not (DATA / FILES[d]).exists()]
    if missing:
        raise SystemExit(f"no sample data for {missing} in {DATA}")
    folds = list(range(1 if args.quick else args.folds))
    seeds = list(range(1 if args.quick else args.seeds))
    variants: list[tuple[str, str, dict[str, Any]]] = [(m, m, {}) for m in args.models.split(",") if m]
    for text in args.set:
        name, overrides = parse_set(text)
        variants += [(f"{m} {name}", m, overrides) for m in args.models.split(",") if m]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = json.loads(out.read_text())["runs"] if args.resume and out.exists() else []
    # Every run's predictions on its block and each block's labels, for the intervals (beside the JSON).
    stored = out.with_suffix(".npz")
    arrays: dict[str, npt.NDArray[Any]] = {}
    if args.resume and stored.exists():
        with np.load(stored) as npz:
            arrays = {k: npz[k] for k in npz.files}
    done = {(r["dataset"], r["variant"], r["fold"], r.get("seed")) for r in runs}
    splits = folds + ([FINAL] if args.final else [])
    fraction = TRAIN_FRACTION if args.training_rows_only else 1.0
    started = time.perf_counter()

    def save() -> None:
        res = {
            "folds": args.folds,
            "blocks_of": "the first 80% of the rows" if args.training_rows_only else "every row",
            "seeds": seeds,
            "train_fraction": TRAIN_FRACTION,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "runs": runs,
            "summary": summarize(runs),
        }
        out.write_text(json.dumps(res, indent=2))
        np.savez_compressed(stored, **arrays)  # type: ignore[arg-type]

    def keep(r: dict[str, Any], dataset: str, variant: str, fold: int, seed: int | None) -> dict[str, Any]:
        """``r`` without its arrays, which go to ``arrays``."""
        arrays[f"{dataset}|{variant}|{fold}|{seed}"] = np.asarray(r.pop("predictions"), np.float64)
        if "labels" in r:
            arrays[f"labels|{dataset}|{fold}"] = np.asarray(r.pop("labels"), np.float64)
        return r

    for dataset in datasets:
        for fold in splits:
            if (dataset, "hashed LR", fold, None) not in done:
                t0 = time.perf_counter()
                r = keep(hashed_lr(dataset, fold, args.folds, fraction), dataset, "hashed LR", fold, None)
                runs.append({"dataset": dataset, "variant": "hashed LR", "fold": fold, "seed": None, **r})
                runs[-1]["wall_s"] = time.perf_counter() - t0
                print(f"{dataset} fold {fold} hashed LR: AUC {r['auc']:.4f}", flush=True)
                save()
            for name, model, overrides in variants:
                for seed in seeds:
                    if (dataset, name, fold, seed) in done:
                        continue
                    t0 = time.perf_counter()
                    r = keep(
                        train_once(dataset, model, fold, args.folds, fraction, seed, overrides),
                        dataset,
                        name,
                        fold,
                        seed,
                    )
                    runs.append(
                        {"dataset": dataset, "variant": name, "fold": fold, "seed": seed, "overrides": overrides, **r}
                    )
                    runs[-1]["wall_s"] = time.perf_counter() - t0
                    print(
                        f"{dataset} fold {fold} {name} seed {seed}: AUC {r['auc']:.4f} epochs {r['epochs']} "
                        f"({runs[-1]['wall_s']:.0f} s)",
                        flush=True,
                    )
                    save()
    blocks = block_intervals(runs, arrays)
    save()
    out.write_text(json.dumps(json.loads(out.read_text()) | {"blocks": blocks}, indent=2))
    print()
    print(table(summarize(runs)))
    print()
    print(block_table(blocks))
    try:
        chart(runs, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG chart written")
    print(f"\nwall {time.perf_counter() - started:.0f} s; wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
