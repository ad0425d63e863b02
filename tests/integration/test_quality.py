"""Quality on real click logs: what the cross-validation says holds, on the README's commands.

Each case runs an example script exactly as the README shows it (``python
examples/train_dlrm.py --data ... --schema ...``, default settings but for the flags the
README gives) on a sample in ``../shared/data`` and checks the AUC on the last 20% of the
rows against the hashed-LR baseline measured on the same split (``../shared/data/README.md``).

What is asserted comes from ``benchmarks/quality_cv.py --folds 4 --seeds 3`` (4 contiguous
blocks of the first 80% of the rows, each evaluating a model trained on the other three,
seeds 0-2: 12 runs per model; the last 20% never read), not from the one split tested here.
Where all 12 runs beat the LR on the same block, the test asks for AUC >= the LR; where they
go both ways, only that the model matches it, AUC >= LR - 0.01 (about twice the worst
run's deficit, two to three standard deviations of the run-by-run difference):

* Criteo DLRM: 12 of 12 (mean +0.011, worst +0.005): >= the LR.
* MovieLens DLRM with ``--min-count 1``: 12 of 12 (mean +0.004, worst +0.002): >= the LR,
  and the README recommends that command. With the default min_count 2 it won 9 of 12
  (worst -0.005), DeepFM 8 of 12 (worst -0.005).
* Criteo DeepFM: 11 of 12 (mean +0.007, worst -0.0002): within 0.01.
* Avazu DLRM and DeepFM: 6 of 12 each (mean -0.001 and -0.000, worst -0.004 and -0.006):
  within 0.01; the candidates min_count=1 and sparse_lr=0.01 did not change that.

A plain run trains one model per dataset (about 45 s on 2 cores); ``pytest -m slow`` runs
the other three. The samples are not part of the repository: without them every case skips.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

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
# (schema, model) -> (the README's extra flags, how far below the LR the AUC may be); see the docstring
CASES = {
    ("criteo", "dlrm"): ((), 0.0),  # beat the LR in 12 of 12 CV runs
    ("criteo", "deepfm"): ((), 0.01),  # 11 of 12
    ("avazu", "dlrm"): ((), 0.01),  # 6 of 12: matches it
    ("avazu", "deepfm"): ((), 0.01),  # 6 of 12
    ("movielens", "dlrm"): (("--min-count", "1"), 0.0),  # 12 of 12
    ("movielens", "deepfm"): ((), 0.01),  # 8 of 12
}
DEFAULT = [("criteo", "dlrm"), ("avazu", "deepfm"), ("movielens", "dlrm")]  # one per dataset, the fastest sure pass


def cases() -> list[object]:
    out: list[object] = []
    for schema in DATASETS:
        for model in ("dlrm", "deepfm"):
            marks = [] if (schema, model) in DEFAULT else [pytest.mark.slow]
            out.append(pytest.param(schema, model, marks=marks, id=f"{model}-{schema}"))
    return out


@pytest.mark.parametrize(("schema", "model"), cases())
def test_example_matches_or_beats_hashed_logistic_regression(
    schema: str, model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    name, baseline, eval_rows = DATASETS[schema]
    flags, margin = CASES[(schema, model)]
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{path} is absent (shared test data)")
    if (schema, model) not in DEFAULT and not long_run(request.config):
        pytest.skip("the full model x dataset matrix runs with `pytest -m slow`")
    # The README's command, plus a run directory of the test's own.
    argv = [
        f"examples/train_{model}.py",
        "--data",
        str(path),
        "--schema",
        schema,
        *flags,
        "--output-dir",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(REPO)
    runpy.run_path(str(REPO / "examples" / f"train_{model}.py"), run_name="__main__")
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    final, config = metrics["final"], metrics["config"]
    print(
        f"{model} on {schema}: AUC {final['auc']:.4f} (hashed LR {baseline}), logloss {final['logloss']:.4f}, "
        f"batch {config['batch_size']}, epochs {config['epochs']}"
    )
    assert final["samples"] == eval_rows  # the baseline's split: the last 20% of the rows
    assert final["auc"] >= baseline - margin, (
        f"{model} on {schema}: AUC {final['auc']:.4f} < hashed LR {baseline} - {margin} (the margin the "
        "cross-validation of benchmarks/quality_cv.py supports)"
    )
