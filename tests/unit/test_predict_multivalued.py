"""The predictor on a model trained through a schema file with a multi-valued column: the
manifest carries the separator, a request's ``"a|b"`` becomes the keys the reader gave that
field (rare values shared as in training), and scores equal the eager model's bit for bit.
Rows come from ``MemoryRows`` (tests/unit/test_predict.py): no shard needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.nn.functional as F

from protos.columns import Column, InvalidRequest
from tests.unit.test_predict import MemoryRows
from worker.config import EmbeddingTableConfig, FeatureConfig
from worker.data import load_click_log, rare_key
from worker.dataset import schema_of
from worker.export import describe_data, load_model, probabilities, serving_manifest
from worker.models import DLRM
from worker.predictor import MIN_ROWS, PAD_ROWS, Predictor
from worker.rare import share_rare

DIM = 4
FEATURES = ["user", "tags"]
SCHEMA = """\
label = "clicked"
[columns]
price = "numeric"
user = "categorical"
tags = { kind = "multi-valued", separator = "|" }
"""


def lines(n: int) -> list[str]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(n):
        tags = "|".join(f"t{int(t)}" for t in rng.integers(0, 6, int(rng.integers(0, 4))))
        price = "" if i % 9 == 0 else f"{rng.lognormal(1, 1):.2f}"
        out.append(f"{i % 2},{price},u{int(rng.integers(0, 5))},{tags}")
    return out


def dlrm() -> DLRM:
    torch.manual_seed(0)
    return DLRM(1, FEATURES, DIM, bottom=[8], top=[8], wide=[f + ".wide" for f in FEATURES])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory as the trainer writes it for ``--schema clicks.toml``."""
    out = tmp_path_factory.mktemp("run")
    (out / "clicks.csv").write_text("clicked,price,user,tags\n" + "\n".join(lines(48)) + "\n")
    (out / "clicks.toml").write_text(SCHEMA)
    model = dlrm()
    torch.save(model.state_dict(), out / "dense.pt")
    tables = [EmbeddingTableConfig("embedding", DIM), EmbeddingTableConfig("wide", 1)]
    features = [FeatureConfig(f, "embedding") for f in FEATURES] + [
        FeatureConfig(f + ".wide", "wide") for f in FEATURES
    ]
    log = load_click_log(out / "clicks.csv", schema_of(str(out / "clicks.toml")))
    vocabulary = log[:40].frequent_keys(3)
    np.savez_compressed(out / "vocabulary.npz", **vocabulary)  # type: ignore[arg-type]
    manifest: dict[str, Any] = {
        "rare_values": {
            "min_count": 3,
            "vocabulary": "vocabulary.npz",
            "rare_keys": {f: rare_key(f) for f in vocabulary},
        },
        "tables": [{"name": t.name, "dim": t.dim} for t in tables],
    }
    schema = describe_data(str(out / "clicks.toml"), out / "clicks.csv", FEATURES, 1)
    manifest |= serving_manifest(model, out, tables, features, 1, schema, ".wide")
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def reference(run: Path, rows: MemoryRows, lo: int, hi: int) -> npt.NDArray[np.float32]:
    """The eager model on the reader's keys (rare values shared as in training) for rows [lo, hi)."""
    log = load_click_log(run / "clicks.csv", schema_of(str(run / "clicks.toml")))
    batch = next(log.with_rare_keys(3, counted_in=log[:40])[lo:hi].batches(hi - lo))
    model = dlrm()
    model.load_state_dict(torch.load(run / "dense.pt"))
    pooled = {}
    for f in FEATURES:
        ids = batch.sparse[f]
        for name, table in ((f, "embedding"), (f + ".wide", "wide")):
            weight = torch.from_numpy(rows.lookup_many({table: ids.values.numpy()})[table])
            pooled[name] = F.embedding_bag(torch.arange(len(ids.values)), weight, ids.offsets[:-1], mode="sum")
    pad = max(MIN_ROWS - (hi - lo), -(hi - lo) % PAD_ROWS)
    dense = torch.cat([batch.dense, batch.dense[-1:].expand(pad, -1)])
    pooled = {name: torch.cat([t, t[-1:].expand(pad, -1)]) for name, t in pooled.items()}
    with torch.no_grad():
        out: npt.NDArray[np.float32] = probabilities(model.eval()(dense, pooled)).numpy()[: hi - lo]
    return out


def raw(run: Path, lo: int, hi: int) -> dict[str, list[str]]:
    fields = [line.split(",") for line in (run / "clicks.csv").read_text().splitlines()[1 + lo : 1 + hi]]
    return {name: [f[j] for f in fields] for j, name in enumerate(["clicked", "price", "user", "tags"]) if j}


def test_the_manifest_carries_the_separator_and_the_schema_file(run: Path) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["format_version"] == 2  # predictors before multi-valued columns refuse it, rightly
    tags = manifest["schema"]["categorical"][-1]
    assert tags["column"] == "tags" and tags["separator"] == "|" and tags["values"] == "string"
    assert manifest["schema"]["toml"] == SCHEMA and manifest["schema"]["source"].endswith("clicks.toml")
    model = load_model(run)
    assert model.columns == ("user", "tags", "price")
    assert [k.separator for k in model.key_features] == [None, "|"]


@pytest.mark.parametrize("lo, hi", [(40, 41), (40, 48), (0, 48)])
def test_scores_from_raw_text_equal_the_eager_model_on_the_readers_keys(run: Path, lo: int, hi: int) -> None:
    predictor = Predictor(load_model(run), MemoryRows({"embedding": DIM, "wide": 1}))
    got = predictor.predict({}, raw(run, lo, hi))
    np.testing.assert_array_equal(got, reference(run, predictor.rows, lo, hi))  # type: ignore[arg-type]


def test_a_multi_valued_context_and_batched_requests(run: Path) -> None:
    predictor = Predictor(load_model(run), MemoryRows({"embedding": DIM, "wide": 1}))
    columns = raw(run, 0, 10)
    columns["tags"] = ["t1|t2"] * 10
    shared = {k: v for k, v in columns.items() if k != "tags"}
    np.testing.assert_array_equal(predictor.predict({"tags": "t1|t2"}, shared), predictor.predict({}, columns))
    requests = [predictor.encode(*_columns(raw(run, lo, hi))) for lo, hi in ((0, 3), (3, 4), (4, 20))]
    together = predictor.score(requests)
    alone = [predictor.score([r])[0] for r in requests]
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(a, b)
    # The keys of "t1|t2": the reader's, in order; "" is no key at all. Encoding keeps the
    # keys as read; a value training never saw becomes the rare key for the readers that
    # shared rare values (every table here: the manifest is of format 2).
    bag = predictor.encode(*_columns({**shared, "tags": ["t1|t2", "", "never-seen|t1"] * 3 + [""]})).bags[0]
    assert bag.offsets.tolist()[:4] == [0, 2, 2, 4]
    assert bag.values[3] == bag.values[0] != bag.values[2]
    tags = next(k for k in predictor.model.key_features if k.name == "tags")
    assert tags.vocabulary is not None and predictor.model.rare_shared_by is None
    read = share_rare(bag.values, tags.vocabulary, tags.rare_key)
    assert read[2] == rare_key("tags") and read[3] == read[0] == bag.values[0]


def test_a_multi_valued_column_takes_strings(run: Path) -> None:
    predictor = Predictor(load_model(run), MemoryRows({"embedding": DIM, "wide": 1}))
    assert predictor.accepts()["tags"] == ("string",)
    columns = raw(run, 0, 2)
    with pytest.raises(InvalidRequest, match=r"candidates\['tags'\]: int64 values, the model takes string"):
        predictor.encode(2, {}, {**{k: Column.of(v) for k, v in columns.items()}, "tags": Column.of([1, 2])})


def _columns(columns: dict[str, list[str]]) -> tuple[int, dict[str, Column], dict[str, Column]]:
    return len(next(iter(columns.values()))), {}, {k: Column.of(v) for k, v in columns.items()}
