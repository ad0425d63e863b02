"""Quality on real click logs: the README's commands beat a hashed logistic regression.

Each case runs an example script exactly as the README shows it (``python
examples/train_dlrm.py --data ... --schema ...``, all defaults) on a sample in
``../shared/data`` and checks the AUC on the last 20% of the rows against the hashed-LR
baseline measured on the same split (``../shared/data/README.md``). A plain run trains
one model per dataset (about 45 s on 2 cores); ``pytest -m slow`` runs the other three.
The samples are not part of the repository: without them every case skips.
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
DEFAULT = [("criteo", "dlrm"), ("avazu", "deepfm"), ("movielens", "dlrm")]  # one per dataset, the fastest sure pass


def cases() -> list[object]:
    out: list[object] = []
    for schema in DATASETS:
        for model in ("dlrm", "deepfm"):
            marks = [] if (schema, model) in DEFAULT else [pytest.mark.slow]
            out.append(pytest.param(schema, model, marks=marks, id=f"{model}-{schema}"))
    return out


@pytest.mark.parametrize(("schema", "model"), cases())
def test_example_beats_hashed_logistic_regression(
    schema: str, model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    name, baseline, eval_rows = DATASETS[schema]
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{path} is absent (shared test data)")
    if (schema, model) not in DEFAULT and not long_run(request.config):
        pytest.skip("the full model x dataset matrix runs with `pytest -m slow`")
    # The README's command, plus a run directory of the test's own.
    argv = [f"examples/train_{model}.py", "--data", str(path), "--schema", schema, "--output-dir", str(tmp_path)]
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
    assert final["auc"] >= baseline, f"{model} on {schema}: AUC {final['auc']:.4f} < hashed LR {baseline}"
