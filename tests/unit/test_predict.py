"""The predictor without a network: request columns and their wire form, the exported model
and manifest, hashing raw values as the readers do (bit-exact scores against the eager
model on the reader's keys), the error paths, and the micro-batcher.

Rows come from ``MemoryRows``: a pure function of (table, key), so a lookup needs no shard.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.nn.functional as F

from protos import infer_pb2 as pb
from protos.columns import Column, InvalidRequest, columns_of, decode_request, encode_request
from protos.keys import hash_features, mix64
from worker.config import EmbeddingTableConfig, FeatureConfig
from worker.data import ColumnSchema, feature_seed, load_click_log, rare_key
from worker.export import ServingModel, describe_data, load_model, probabilities, serving_manifest
from worker.fields import dense_values
from worker.models import DLRM
from worker.predictor import MIN_ROWS, PAD_ROWS, Encoded, Predictor
from worker.serving import Batcher, InferConfig, _Gate, _Refused, main
from worker.synthetic import synthetic_criteo

DIM = 4
CAT = [f"C{i}" for i in range(1, 27)]
DENSE = [f"I{i}" for i in range(1, 14)]
KEY_FEATURES = CAT + [f"{d}_bucket" for d in DENSE]


class MemoryRows:
    """Rows as a pure function of (table, key); records the keys asked for."""

    def __init__(self, dims: Mapping[str, int]) -> None:
        self.dims = dims
        self.asked: list[dict[str, npt.NDArray[np.int64]]] = []

    def lookup_many(self, requests: Mapping[str, npt.ArrayLike]) -> dict[str, npt.NDArray[np.float32]]:
        self.asked.append({t: np.asarray(k) for t, k in requests.items()})
        out = {}
        for table, keys in requests.items():
            k = np.asarray(keys, dtype=np.int64)
            cols = [mix64(k ^ np.int64(j * 7919 + len(table))) for j in range(self.dims[table])]
            out[table] = (np.stack(cols, 1) >> np.uint64(40)).astype(np.float32) / 2**24 - 0.5
        return out


def criteo_lines(n: int, seed: int = 0) -> list[str]:
    """Criteo-format rows: counts (some empty, negative, large), 8-hex categoricals (some empty, few distinct)."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        ints = [
            ("" if rng.random() < 0.2 else str(int(rng.integers(-2, 3)) if j == 1 else int(rng.lognormal(2, 2))))
            for j in range(13)
        ]
        cats = ["" if rng.random() < 0.1 else f"{int(rng.integers(0, 4)) * 0x1F3A5B7:08x}" for _ in range(26)]
        lines.append("\t".join([str(int(rng.integers(0, 2))), *ints, *cats]))
    return lines


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory of format 1, for a small DLRM on a Criteo-format file: every table
    read rare values as the rare key (as runs did before the first-order weights kept them)."""
    return write_run(tmp_path_factory.mktemp("run"), shared_by=None)


@pytest.fixture(scope="module")
def run_keeping(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run as the trainer writes it now (format 3): the embeddings share rare
    values, the first-order weights (table ``wide``) keep every value."""
    return write_run(tmp_path_factory.mktemp("run"), shared_by=["embedding"])


def write_run(out: Path, shared_by: list[str] | None) -> Path:
    (out / "log.txt").write_text("\n".join(criteo_lines(16)) + "\n")
    torch.manual_seed(0)
    model = DLRM(13, KEY_FEATURES, DIM, bottom=[8], top=[8], wide=[f + ".wide" for f in KEY_FEATURES])
    torch.save(model.state_dict(), out / "dense.pt")
    tables = [EmbeddingTableConfig("embedding", DIM), EmbeddingTableConfig("wide", 1)]
    features = [FeatureConfig(f, "embedding") for f in KEY_FEATURES] + [
        FeatureConfig(f + ".wide", "wide") for f in KEY_FEATURES
    ]
    log = load_click_log(out / "log.txt", ColumnSchema.criteo())
    vocabulary = log[:12].frequent_keys(2)
    np.savez_compressed(out / "vocabulary.npz", **vocabulary)  # type: ignore[arg-type]
    rare_values = {"min_count": 2, "vocabulary": "vocabulary.npz", "rare_keys": {f: rare_key(f) for f in vocabulary}}
    manifest: dict[str, Any] = {"tables": [{"name": t.name, "dim": t.dim} for t in tables]}
    schema = describe_data("criteo", out / "log.txt", KEY_FEATURES, 13)
    if shared_by is None:
        manifest |= serving_manifest(model, out, tables, features, 13, schema, ".wide") | {"rare_values": rare_values}
    else:
        rare_values["shared_by"] = shared_by
        manifest |= serving_manifest(model, out, tables, features, 13, schema, ".wide", rare_values)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def reference(run: Path, rows: MemoryRows, lo: int, hi: int, wide_keeps: bool = False) -> npt.NDArray[np.float32]:
    """The eager model on the reader's keys for log rows [lo, hi): rare values shared as in
    training, by the embeddings and (unless ``wide_keeps``) the first-order weights."""
    log = load_click_log(run / "log.txt", ColumnSchema.criteo())
    batch = next(log.with_rare_keys(2, counted_in=log[:12])[lo:hi].batches(hi - lo))
    as_read = next(log[lo:hi].batches(hi - lo))
    model = DLRM(13, KEY_FEATURES, DIM, bottom=[8], top=[8], wide=[f + ".wide" for f in KEY_FEATURES])
    model.load_state_dict(torch.load(run / "dense.pt"))
    pooled = {}
    for f in KEY_FEATURES:
        for name, table in ((f, "embedding"), (f + ".wide", "wide")):
            keys = (as_read if wide_keeps and table == "wide" else batch).sparse[f].values.numpy()
            weight = torch.from_numpy(rows.lookup_many({table: keys})[table])
            pooled[name] = F.embedding_bag(torch.arange(len(keys)), weight, torch.arange(len(keys)), mode="sum")
    # At the predictor's smallest call: smaller matrices may take other kernel paths (other bits).
    pad = max(MIN_ROWS - (hi - lo), -(hi - lo) % PAD_ROWS)
    dense = torch.cat([batch.dense, batch.dense[-1:].expand(pad, -1)])
    pooled = {name: torch.cat([t, t[-1:].expand(pad, -1)]) for name, t in pooled.items()}
    with torch.no_grad():
        out: npt.NDArray[np.float32] = probabilities(model.eval()(dense, pooled)).numpy()[: hi - lo]
    return out


def raw_columns(run: Path, lo: int, hi: int) -> dict[str, list[str]]:
    fields = [line.split("\t") for line in (run / "log.txt").read_text().splitlines()[lo:hi]]
    return {name: [f[1 + j] for f in fields] for j, name in enumerate(DENSE + CAT)}


@functools.cache
def served(run: Path) -> ServingModel:
    return load_model(run)


def predictor(run: Path, **kw: Any) -> tuple[Predictor, MemoryRows]:
    rows = MemoryRows({"embedding": DIM, "wide": 1})
    return Predictor(served(run), rows, **kw), rows


# --- the exported run


def test_manifest_describes_the_schema_and_the_program(run: Path) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and manifest["program"]["file"] == "model.pt2"
    schema = manifest["schema"]
    assert [c["column"] for c in schema["categorical"]] == CAT and schema["categorical"][0]["values"] == "string"
    assert schema["categorical"][0]["seed"] == feature_seed("C1")
    assert [d["bucket_feature"] for d in schema["dense"]] == [f"{d}_bucket" for d in DENSE]
    assert manifest["features"][-1] == {
        "name": "I13_bucket.wide",
        "table": "wide",
        "pooling": "sum",
        "keys": "I13_bucket",
    }
    model = load_model(run)
    assert model.columns == (*CAT, *DENSE) and model.dims == {"embedding": DIM, "wide": 1}


def test_program_loads_without_the_model_class(run: Path) -> None:
    program = torch.export.load(run / "model.pt2").module()
    assert "DLRM" not in type(program).__name__
    dense = torch.randn(24, 13)
    pooled = {f: torch.randn(24, DIM) for f in KEY_FEATURES} | {f + ".wide": torch.randn(24, 1) for f in KEY_FEATURES}
    model = DLRM(13, KEY_FEATURES, DIM, bottom=[8], top=[8], wide=[f + ".wide" for f in KEY_FEATURES])
    model.load_state_dict(torch.load(run / "dense.pt"))
    with torch.no_grad():
        assert torch.equal(program(dense, pooled), model.eval()(dense, pooled))


def test_load_model_refuses_a_run_without_export(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"model": "dlrm"}))
    with pytest.raises(ValueError, match="format_version None"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="manifest.json"):
        load_model(tmp_path / "nothing")


# --- scores


def test_scores_from_raw_text_equal_the_eager_model_on_the_readers_keys(run: Path) -> None:
    p, rows = predictor(run)
    columns = raw_columns(run, 0, 16)
    scores = p.predict({}, columns)
    np.testing.assert_array_equal(scores, reference(run, rows, 0, 16))


def test_first_order_weights_that_keep_rare_values_read_every_key_as_it_is(run_keeping: Path) -> None:
    """Format 3: the embeddings read keys outside the vocabulary as the rare key, the
    first-order weights read each key as it is; bit-exact against the eager model."""
    manifest = json.loads((run_keeping / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and manifest["rare_values"]["shared_by"] == ["embedding"]
    model = load_model(run_keeping)
    assert model.rare_shared_by == {"embedding"}
    rows = MemoryRows({"embedding": DIM, "wide": 1})
    scores = Predictor(model, rows).predict({}, raw_columns(run_keeping, 0, 16))
    asked = rows.asked[-1]
    rare = [rare_key(f) for f in KEY_FEATURES]
    assert np.isin(rare, asked["embedding"]).any() and not np.isin(rare, asked["wide"]).any()
    np.testing.assert_array_equal(scores, reference(run_keeping, rows, 0, 16, wide_keeps=True))
    assert not np.array_equal(scores, reference(run_keeping, rows, 0, 16))  # the keys do differ here


def test_context_values_apply_to_every_candidate(run: Path) -> None:
    p, _ = predictor(run)
    columns = raw_columns(run, 0, 8)
    shared = {name: values[0] for name, values in columns.items() if name in ("C1", "I1", "C7")}
    broadcast = {name: [v] * 8 for name, v in shared.items()}
    rest = {name: v for name, v in columns.items() if name not in shared}
    np.testing.assert_array_equal(p.predict(shared, rest), p.predict({}, rest | broadcast))


def test_dense_values_may_be_numbers_or_text(run: Path) -> None:
    p, _ = predictor(run)
    columns: dict[str, Any] = raw_columns(run, 0, 8)
    as_text = p.predict({}, columns)
    for d in DENSE:
        columns[d] = [float(v) if v else None for v in columns[d]]  # None: missing, as an empty field
    np.testing.assert_array_equal(p.predict({}, columns), as_text)


def test_scores_do_not_depend_on_the_batch(run: Path) -> None:
    p, _ = predictor(run)
    a = p.encode(*columns_of({}, raw_columns(run, 0, 3)))
    b = p.encode(*columns_of({}, raw_columns(run, 3, 16)))
    alone = [p.score([a])[0], p.score([b])[0]]
    together = p.score([a, b])
    for x, y in zip(alone, together):
        np.testing.assert_array_equal(x, y)


def test_probabilities_do_not_depend_on_position_or_length() -> None:
    torch.manual_seed(0)
    logits = torch.randn(40_000) * 3
    full = probabilities(logits)
    assert torch.allclose(full, torch.sigmoid(logits), rtol=0, atol=1e-7)
    rng = np.random.default_rng(0)
    for lo, n in zip(rng.integers(0, 39_000, 300), rng.integers(1, 1000, 300)):
        assert torch.equal(probabilities(logits[lo : lo + n].clone()), full[lo : lo + n])


def test_values_outside_the_vocabulary_use_the_rare_key(run: Path) -> None:
    p, rows = predictor(run)
    columns = raw_columns(run, 0, 8)
    columns["C1"] = ["never-seen"] * 8
    p.predict({}, columns)
    asked = set(rows.asked[-1]["embedding"].tolist())
    assert rare_key("C1") in asked
    assert hash_features(np.array([0]), 0)[0] not in asked  # sanity: keys are hashes, not ids


def test_synthetic_raw_values_are_the_generators_ids_and_counts() -> None:
    batch = next(synthetic_criteo(64, 64, seed=5))
    # C9 draws ids from a vocabulary of 3: its keys are those ids hashed as integers.
    assert set(batch.sparse["C9"].values.tolist()) <= set(hash_features(np.arange(3), feature_seed("C9")).tolist())
    # Dense columns are log1p(count): the counts come back exactly and transform to the same bits.
    counts = np.round(np.expm1(batch.dense.numpy().astype(np.float64)))
    np.testing.assert_array_equal(dense_values(counts, log_transform=True), batch.dense.numpy())
    schema = describe_data("synthetic", "synthetic", CAT, 13)
    assert {c["values"] for c in schema["categorical"]} == {"int64"} and schema["log_transform"]


# --- bad requests


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda ctx, c: c.update(zz=["x"] * 8), "candidates['zz']: unknown feature"),
        (lambda ctx, c: c.update(C2=list(range(8))), "candidates['C2']: int64 values, the model takes string"),
        (lambda ctx, c: c.pop("C3"), "missing features: C3"),
        (lambda ctx, c: c.update(I2=["1", "x", "", "2", "3", "4", "5", "6"]), "candidates['I2']: value 1 is b'x'"),
        (lambda ctx, c: c.update(I2=[1.0, np.inf, 0, 0, 0, 0, 0, 0]), "candidates['I2']: value 1 is inf"),
        (lambda ctx, c: ctx.update(C4=Column.of(["a", "b"])) or c.pop("C4"), "context['C4']: 2 values, expected one"),
    ],
)
def test_bad_requests_name_the_field(run: Path, change: Any, field: str) -> None:
    p, _ = predictor(run)
    context: dict[str, Any] = {}
    candidates: dict[str, Any] = dict(raw_columns(run, 0, 8))
    change(context, candidates)
    n, ctx, cand = columns_of(context, candidates)
    with pytest.raises(InvalidRequest) as info:
        p.encode(n, ctx, cand)
    assert field in str(info.value)


def test_candidate_counts_are_bounded(run: Path) -> None:
    p, _ = predictor(run, max_candidates=4)
    n, ctx, cand = columns_of({}, raw_columns(run, 0, 8))
    with pytest.raises(InvalidRequest, match=r"num_candidates: 8, must be in \[1, 4\]"):
        p.encode(n, ctx, cand)
    with pytest.raises(InvalidRequest, match="num_candidates: 0"):
        p.encode(0, ctx, cand)
    with pytest.raises(InvalidRequest, match=r"candidates\['I1'\]: 8 values, expected num_candidates=3"):
        p.encode(3, ctx, cand)


def test_a_feature_in_context_and_candidates_is_refused(run: Path) -> None:
    p, _ = predictor(run)
    n, ctx, cand = columns_of({"C1": "a"}, raw_columns(run, 0, 8))
    with pytest.raises(InvalidRequest, match=r"candidates\['C1'\]: also in context\['C1'\]"):
        p.encode(n, ctx, cand)


# --- columns and their wire form


def test_columns_from_python_values() -> None:
    assert Column.of(["é", b"\0x"]).lengths.tolist() == [2, 2]  # type: ignore[union-attr]
    assert Column.of(np.array([2**64 - 1], dtype=np.uint64)).values.tolist() == [-1]
    assert Column.of([1, 2**64 - 1]).values.tolist() == [1, -1]
    nan = Column.of([1, None, 2.5]).values
    assert np.isnan(nan[1]) and nan[2] == 2.5
    assert Column.of(np.array(["ab", "c"])).type == "string"
    for bad in ([1, "a"], [True], [object()]):
        with pytest.raises(TypeError, match="values of types"):
            Column.of(bad)


def test_request_round_trip_rows_and_columns() -> None:
    rows = encode_request({"u": "x"}, [{"i": 1, "p": 0.5}, {"i": 2, "p": None}])
    cols = encode_request({"u": "x"}, {"i": np.array([1, 2]), "p": [0.5, None]})
    assert rows.SerializeToString() == cols.SerializeToString()
    n, context, candidates = decode_request(pb.PredictRequest.FromString(rows.SerializeToString()))
    assert n == 2 and bytes(context["u"].values) == b"x" and candidates["i"].values.tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"candidates\[1\]: features"):
        encode_request({}, [{"i": 1}, {"j": 2}])
    with pytest.raises(ValueError, match="3 values, expected 2"):
        encode_request({}, {"i": [1, 2], "j": [1, 2, 3]})


def wire(name: str, type_: int, values: bytes, lengths: bytes = b"") -> pb.Column:
    return pb.Column(name=name, type=type_, values=values, lengths=lengths)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "column, message",
    [
        (wire("a", 0, b""), r"candidates\['a'\].type: 0"),
        (wire("a", pb.VALUE_TYPE_INT64, b"1234567"), r"candidates\['a'\].values: 7 bytes, not a multiple of 8"),
        (wire("a", pb.VALUE_TYPE_STRING, b"ab", b"\x02\0\0"), r"candidates\['a'\].lengths: 3 bytes"),
        (wire("a", pb.VALUE_TYPE_STRING, b"ab", np.array([3], "<i4").tobytes()), "add up to 3 bytes, values has 2"),
        (wire("a", pb.VALUE_TYPE_STRING, b"", np.array([-1, 1], "<i4").tobytes()), "a negative length"),
        (
            wire("a", pb.VALUE_TYPE_FLOAT64, bytes(8), b"\0\0\0\0"),
            r"only string columns have lengths \(this one is float64\)",
        ),
        (
            wire("a", pb.VALUE_TYPE_INT64, bytes(8), b"\0\0\0\0"),
            r"only string columns have lengths \(this one is int64\)",
        ),
    ],
)
def test_wire_columns_are_checked(column: pb.Column, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        decode_request(pb.PredictRequest(num_candidates=1, candidates=[column]))


def test_a_feature_given_twice_on_the_wire_is_refused() -> None:
    col = wire("a", pb.VALUE_TYPE_INT64, bytes(8))
    with pytest.raises(InvalidRequest, match=r"candidates\['a'\]: feature given twice"):
        decode_request(pb.PredictRequest(num_candidates=1, context=[col], candidates=[col]))


# --- batching, admission, settings


class SlowScorer:
    """Stands in for a Predictor: records each batch's sizes, takes ``delay_s`` per call."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.batches = delay_s, []  # type: list[list[int]]

    def score(self, batches: Sequence[Encoded]) -> list[npt.NDArray[np.float32]]:
        self.batches.append([b.n for b in batches])
        time.sleep(self.delay_s)
        return [b.dense[:, 0].copy() for b in batches]


def encoded(n: int, value: float) -> Encoded:
    return Encoded(np.zeros((1, n), np.int64), np.full((n, 1), value, np.float32))


def test_batcher_scores_concurrent_requests_together_and_splits_the_scores() -> None:
    scorer = SlowScorer(0.05)
    batcher = Batcher(scorer, wait_s=0.0, max_rows=10, encoding=lambda: 0)  # type: ignore[arg-type]
    try:
        results = [batcher.submit(encoded(1, 0.0))]
        while not scorer.batches:  # the first call is running: the next ones queue meanwhile
            time.sleep(0.001)
        results += [batcher.submit(encoded(n, float(i))) for i, n in enumerate([2, 3, 4, 5], start=1)]
        for i, (n, f) in enumerate(zip([1, 2, 3, 4, 5], results)):
            assert f.result(timeout=5).tolist() == [float(i)] * n
    finally:
        batcher.close()
    # The first call runs alone; the rest queued meanwhile, and are split at max_rows=10.
    assert scorer.batches == [[1], [2, 3, 4], [5]]


def test_batcher_waits_for_requests_being_encoded_but_not_past_its_deadline() -> None:
    scorer, encoding = SlowScorer(0.0), [1]
    batcher = Batcher(scorer, wait_s=0.2, max_rows=100, encoding=lambda: encoding[0])  # type: ignore[arg-type]
    try:
        first = batcher.submit(encoded(1, 0.0))
        time.sleep(0.05)
        encoding[0] = 0
        second = batcher.submit(encoded(1, 1.0))
        first.result(timeout=5), second.result(timeout=5)
        started = time.monotonic()
        encoding[0] = 1  # someone is "encoding" forever: the batch still goes at the deadline
        batcher.submit(encoded(1, 2.0)).result(timeout=5)
        assert 0.15 < time.monotonic() - started < 2.0
    finally:
        batcher.close()
    assert scorer.batches[0] == [1, 1]


def test_batcher_passes_a_scoring_failure_to_every_request_of_the_batch() -> None:
    class Failing:
        def score(self, batches: Sequence[Encoded]) -> list[Any]:
            raise RuntimeError("shards down")

    batcher = Batcher(Failing(), wait_s=0.0, max_rows=10, encoding=lambda: 0)  # type: ignore[arg-type]
    try:
        with pytest.raises(RuntimeError, match="shards down"):
            batcher.submit(encoded(1, 0.0)).result(timeout=5)
    finally:
        batcher.close()


def test_gate_refuses_beyond_the_limit_at_once() -> None:
    gate = _Gate(2)
    gate.enter(), gate.enter()
    with pytest.raises(_Refused) as info:
        gate.enter()
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-concurrent" in str(info.value)
    gate.leave()
    gate.enter()


def test_gate_under_threads_never_admits_more_than_its_limit() -> None:
    gate, admitted, peak, lock = _Gate(3), [0], [0], threading.Lock()

    def one() -> None:
        try:
            gate.enter()
        except _Refused:
            return
        with lock:
            admitted[0] += 1
            peak[0] = max(peak[0], admitted[0])
        time.sleep(0.001)
        with lock:
            admitted[0] -= 1
        gate.encoded(), gate.leave()

    with futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: one(), range(200)))
    assert peak[0] <= 3 and gate.in_flight == 0


def test_infer_config_reads_replicas_and_checks_settings(capsys: pytest.CaptureFixture[str]) -> None:
    config = InferConfig(model=Path("run"), ps=("h:1|h:2", "h:3"))
    assert config.addresses() == [["h:1", "h:2"], ["h:3"]]
    with pytest.raises(ValueError, match="model: required"):
        InferConfig(ps=("h:1",))
    with pytest.raises(ValueError, match="shard 1"):
        InferConfig(model=Path("run"), ps=("h:1", "h"))
    assert main(["--model", "run", "--ps", "h:1", "--max-candidates", "10", "--max-batch-rows", "5"]) == 2
    assert "max_batch_rows=5: must be >= max_candidates=10" in capsys.readouterr().err
    assert config.wait_s > 0, "started right after training, serving shards may still be loading"
    assert main(["--model", "run", "--ps", "h:1", "--wait-s", "-1"]) == 2
    assert "wait_s=-1.0: must be a finite number >= 0" in capsys.readouterr().err
