"""A user's own click log, no Python: ``python -m worker.trainer --data clicks.csv --schema
clicks.toml`` against real shards, then ``ps-infer`` on the run directory alone. The held-out
rows, sent as the text fields of the file (the multi-valued ``tags`` as ``a|b|c``), score
exactly as the trainer's own final evaluation scored them (``predictions.npy``), bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from client import PredictClient
from deploy.local import LocalCluster
from tests.integration.infer_helpers import REPO, Trained, start_infer, stop_infer

SCHEMA = """\
# clicks.toml
delimiter = ","
header = true
label = "clicked"

[columns]
price = "numeric"
user = "categorical"
item = "categorical"
tags = { kind = "multi-valued", separator = "|" }
"""
ROWS, TRAIN = 2000, 1600  # --train-fraction 0.8: rows 1600.. are held out


def click_log(path: Path) -> list[list[str]]:
    """Rows with a signal in every feature kind; ``id`` is a column the schema does not read."""
    rng = np.random.default_rng(11)
    rows = []
    for i in range(ROWS):
        user, item = int(rng.integers(0, 60)), int(rng.integers(0, 40))
        tags = sorted({f"t{int(t)}" for t in rng.integers(0, 12, int(rng.integers(0, 4)))})
        price = "" if i % 13 == 0 else f"{rng.lognormal(2, 1):.2f}"
        logit = (user % 3 - 1) + 0.8 * ("t1" in tags) - 0.8 * ("t2" in tags) + (item % 2) - 0.5
        clicked = int(rng.random() < 1 / (1 + np.exp(-logit)))
        rows.append([str(clicked), price, str(i), f"u{user}", f"item{item}", "|".join(tags)])
    path.write_text("clicked,price,id,user,item,tags\n" + "".join(",".join(r) + "\n" for r in rows))
    return rows


def test_a_log_trained_through_a_schema_file_scores_in_ps_infer_as_in_training(tmp_path: Path) -> None:
    rows = click_log(tmp_path / "clicks.csv")
    (tmp_path / "clicks.toml").write_text(SCHEMA)
    run = tmp_path / "run"
    with LocalCluster(2, root=tmp_path / "shards") as cluster:
        trained = subprocess.run(
            [
                sys.executable,
                "-m",
                "worker.trainer",
                "--addresses",
                ",".join(cluster.addresses),
                "--data",
                "clicks.csv",
                "--schema",
                "clicks.toml",
                "--epochs",
                "2",
                "--progress",
                "false",
                "--output-dir",
                str(run),
            ],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert trained.returncode == 0, trained.stderr[-3000:]
        expected = np.load(run / "predictions.npy")  # the final evaluation's, rows 1600..1999 in order
        manifest = json.loads((run / "manifest.json").read_text())
        # 3: the first-order weights keep rare values, which predictors of format 2 would share
        assert manifest["format_version"] == 3 and manifest["schema"]["toml"] == SCHEMA
        assert {c["column"]: c.get("separator") for c in manifest["schema"]["categorical"]} == {
            "user": None,
            "item": None,
            "tags": "|",
        }
        assert json.loads((run / "metrics.json").read_text())["final"]["auc"] > 0.6  # it learned something
        infer = start_infer(Trained(cluster.addresses, run), tmp_path, "clicks")
        try:
            held_out = rows[TRAIN:]
            columns = {
                name: [r[j] for r in held_out] for j, name in ((1, "price"), (3, "user"), (4, "item"), (5, "tags"))
            }
            assert any(r[5] == "" for r in held_out) and any("|" in r[5] for r in held_out)
            got = []
            with PredictClient(infer.address) as client:
                for lo, hi in ((0, 1), (1, 100), (100, 400)):
                    got.append(client.predict({}, {k: v[lo:hi] for k, v in columns.items()}))
                # One user's context and the tags of each candidate: the same scores as all in candidates.
                user = columns["user"][7]
                same_user = {k: v[:50] for k, v in columns.items() if k != "user"}
                in_context = client.predict({"user": user}, same_user)
                in_candidates = client.predict({}, same_user | {"user": [user] * 50})
        finally:
            stop_infer(infer)
    assert expected.shape == (ROWS - TRAIN,)
    np.testing.assert_array_equal(np.concatenate(got), expected)
    np.testing.assert_array_equal(in_context, in_candidates)
