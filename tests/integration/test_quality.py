"""Quality on real click logs: what the cross-validation says holds, on the README's commands.

Each case runs an example script exactly as the README shows it (``python
examples/train_dlrm.py --data ... --schema ...``, default settings but for the flags the
README gives) on a sample in ``../shared/data`` and checks the AUC on the last 20% of the
rows against the hashed-LR baseline measured on the same split (``../shared/data/README.md``).

What is asserted comes from ``benchmarks/quality_cv.py`` (every fifth of each sample, in row
order, evaluating a model trained on the other four, seeds 0 and 1: 10 runs per model; the split
tested here is the last fifth). Where all 10 runs beat the LR on the same block, the test asks
for AUC >= the LR; elsewhere, that the model stays within a margin of it that covers the worst
run's deficit:

* Criteo DLRM: 10 of 10 (mean +0.011, worst +0.008): >= the LR.
* MovieLens DLRM: 10 of 10 (mean +0.004, worst +0.001): >= the LR.
* Criteo DeepFM: 9 of 10 (mean +0.005, worst -0.001): within 0.005.
* Avazu DLRM and DeepFM: 5 and 7 of 10 (mean -0.000 and +0.000, worst -0.003 and -0.004; every
  block's 95% interval holds zero): within 0.005.
* MovieLens DeepFM: 6 of 10 (worst -0.008; below the LR on the third and fourth fifths, by
  0.007 each): within 0.01.

A plain run trains one model per dataset (about 45 s on 2 cores) and DLRM on the MovieLens
fifth where the defaults used to fall short (about 25 s); ``pytest -m slow`` runs the rest. The samples are not part of the repository: without them every case skips.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.profiles import long_run

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data"

# (schema, file, hashed-LR AUC on the last 20%, evaluation rows)
DATASETS = {
    "criteo": ("criteo_kaggle_train_head10k.txt", 0.7242, 2000),
    "avazu": ("avazu_train_head10k.csv", 0.7256, 2000),
    "movielens": ("movielens_ml-100k_u.data", 0.6952, 20000),
}
# (schema, model) -> how far below the LR the AUC may be; see the docstring
MARGINS = {
    ("criteo", "dlrm"): 0.0,  # beat the LR in 10 of 10 CV runs
    ("criteo", "deepfm"): 0.005,  # 9 of 10
    ("avazu", "dlrm"): 0.005,  # 5 of 10: matches it
    ("avazu", "deepfm"): 0.005,  # 7 of 10
    ("movielens", "dlrm"): 0.0,  # 10 of 10
    ("movielens", "deepfm"): 0.01,  # 6 of 10
}
DEFAULT = [("criteo", "dlrm"), ("avazu", "deepfm"), ("movielens", "dlrm")]  # one per dataset, the fastest sure pass

# Blocks of the cross-validation where the defaults before first-order weights kept rare values
# fell below the LR (seed 0): (schema, model, block) -> (the LR's AUC on that block, the margin).
# MovieLens DLRM on its third fifth was 0.018 below, Avazu's fourth fifth 0.007 below (both models).
BLOCKS = {
    ("movielens", "dlrm", 2): (0.7167, 0.0),
    ("avazu", "dlrm", 3): (0.7203, 0.005),
    ("avazu", "deepfm", 3): (0.7203, 0.005),
}


def cases() -> list[object]:
    out: list[object] = []
    for schema in DATASETS:
        for model in ("dlrm", "deepfm"):
            marks = [] if (schema, model) in DEFAULT else [pytest.mark.slow]
            out.append(pytest.param(schema, model, marks=marks, id=f"{model}-{schema}"))
    return out


def train_example(schema: str, model: str, flags: list[str], out: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run ``examples/train_{model}.py --data SAMPLE --schema SCHEMA FLAGS`` as the README
    shows it, with a run directory of the test's own; its metrics (skips without the sample)."""
    path = DATA / DATASETS[schema][0]
    if not path.exists():
        pytest.skip(f"{path} is absent (shared test data)")
    argv = [f"examples/train_{model}.py", "--data", str(path), "--schema", schema, *flags, "--output-dir", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(REPO)
    runpy.run_path(str(REPO / "examples" / f"train_{model}.py"), run_name="__main__")
    metrics = json.loads((out / "metrics.json").read_text())
    final, config = metrics["final"], metrics["config"]
    print(
        f"{model} on {schema} {' '.join(flags)}: AUC {final['auc']:.4f}, logloss {final['logloss']:.4f}, "
        f"batch {config['batch_size']}, epochs {config['epochs']}"
    )
    return metrics


@pytest.mark.parametrize(("schema", "model"), cases())
def test_example_matches_or_beats_hashed_logistic_regression(
    schema: str, model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    _, baseline, eval_rows = DATASETS[schema]
    margin = MARGINS[(schema, model)]
    if (schema, model) not in DEFAULT and not long_run(request.config):
        pytest.skip("the full model x dataset matrix runs with `pytest -m slow`")
    final = train_example(schema, model, [], tmp_path, monkeypatch)["final"]
    assert final["samples"] == eval_rows  # the baseline's split: the last 20% of the rows
    assert final["auc"] >= baseline - margin, (
        f"{model} on {schema}: AUC {final['auc']:.4f} < hashed LR {baseline} - {margin} (the margin the "
        "cross-validation of benchmarks/quality_cv.py supports)"
    )


@pytest.mark.parametrize(
    ("schema", "model", "block"),
    [
        pytest.param(*key, marks=[] if key[0] == "movielens" else [pytest.mark.slow], id=f"{key[1]}-{key[0]}-{key[2]}")
        for key in BLOCKS
    ],
)
def test_defaults_hold_on_the_fifths_where_they_fell_short(
    schema: str, model: str, block: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """One block of the cross-validation, trained as a user would (``--folds 5 --eval-fold K
    --train-fraction 1``), against the LR on the same block (``benchmarks/quality_cv.py``)."""
    baseline, margin = BLOCKS[(schema, model, block)]
    if schema != "movielens" and not long_run(request.config):
        pytest.skip("the Avazu blocks run with `pytest -m slow`")
    flags = ["--folds", "5", "--eval-fold", str(block), "--train-fraction", "1"]
    metrics = train_example(schema, model, flags, tmp_path, monkeypatch)
    n = metrics["data"]["train_rows"] + metrics["data"]["eval_rows"]
    assert metrics["final"]["samples"] == n * (block + 1) // 5 - n * block // 5  # that fifth evaluates
    assert metrics["final"]["auc"] >= baseline - margin, (
        f"{model} on fifth {block + 1} of {schema}: AUC {metrics['final']['auc']:.4f} < hashed LR {baseline} - {margin}"
    )
