"""worker.data: the FNV kernel against ``hash_feature``, the click-log readers on small
files and on the real samples in ``../shared/data`` (skipped when absent), the synthetic
stream with its planted model, and the eval metrics against brute force.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.keys import hash_feature, hash_features
from worker.data import (
    BadLines,
    Batch,
    ColumnSchema,
    DataError,
    auc,
    feature_seed,
    hash_strings,
    load_click_log,
    logloss,
    read_click_log,
)
from worker.synthetic import SyntheticBatch, synthetic_criteo

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
CRITEO = DATA / "criteo_kaggle_train_head10k.txt"
AVAZU = DATA / "avazu_train_head10k.csv"
MOVIELENS = DATA / "movielens_ml-100k_u.data"

# From ../shared/data/README.md: distinct non-empty values and empty cells of C1..C26.
CRITEO_DISTINCT = [
    175,
    386,
    5520,
    4032,
    56,
    7,
    3184,
    93,
    3,
    2986,
    2084,
    5283,
    1725,
    24,
    2035,
    4723,
    9,
    1149,
    546,
    3,
    5036,
    7,
    12,
    2524,
    39,
    1938,
]
CRITEO_EMPTY = [
    0,
    0,
    357,
    357,
    0,
    1332,
    0,
    0,
    0,
    0,
    0,
    357,
    0,
    0,
    0,
    357,
    0,
    0,
    4496,
    4496,
    357,
    8182,
    0,
    357,
    4496,
    4496,
]
AVAZU_DISTINCT = {
    "site_id": 381,
    "site_domain": 317,
    "site_category": 14,
    "app_id": 313,
    "app_domain": 31,
    "app_category": 14,
    "device_id": 1075,
    "device_ip": 7302,
    "device_model": 1168,
    "device_type": 4,
    "device_conn_type": 4,
    "C1": 6,
    "banner_pos": 4,
    "C14": 271,
    "C15": 4,
    "C16": 5,
    "C17": 111,
    "C18": 4,
    "C19": 32,
    "C20": 108,
    "C21": 29,
}


def cat(batches: Sequence[Batch], feature: str) -> np.ndarray:
    return torch.cat([b.sparse[feature].values for b in batches]).numpy()


def labels_of(batches: Sequence[Batch]) -> np.ndarray:
    return torch.cat([b.labels for b in batches]).numpy()


# --- the FNV-1a kernel is hash_feature, bit for bit


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text() | st.binary(), max_size=30), st.integers(-(2**63), 2**64 - 1))
def test_kernel_equals_hash_feature(values: list[str | bytes], seed: int) -> None:
    assert hash_strings(values, seed).tolist() == [hash_feature(v, seed) for v in values]


def test_kernel_edge_values() -> None:
    values = ["", "a", "\u00e9\u4e2d\U0001f642", "x" * 10_000, "\0", "68fd1e64"]
    for seed in (0, 1, -1, 2**63, feature_seed("C1")):
        assert hash_strings(values, seed).tolist() == [hash_feature(v, seed) for v in values]
    assert hash_strings([], 3).shape == (0,)


def test_feature_seed_is_fixed() -> None:
    assert feature_seed("C1") == hash_feature("C1", 0) % 2**64
    assert feature_seed("C1") != feature_seed("C2")


# --- Criteo format on small files

ROWS = [
    # label, I1..I13, C1..C26
    ["1", "5", "-1", "", "0", "1382", "4", "15", "2", "181", "1", "2", "", "2"] + [f"{i:08x}" for i in range(26)],
    ["0", "", "2", "0", "44", "1", "102", "8", "2", "2", "4", "1", "1", "4"] + [""] * 3 + ["68fd1e64"] * 23,
    ["0", "-7", "", "", "", "", "", "", "", "", "", "", "", ""] + [""] * 26,
]


def write(path: Path, rows: list[list[str]], sep: str = "\t", end: str = "\n") -> Path:
    path.write_text("".join(sep.join(r) + end for r in rows))
    return path


def test_criteo_small_file(tmp_path: Path) -> None:
    p = write(tmp_path / "small.tsv", ROWS)
    (b,) = list(read_click_log(p, ColumnSchema.criteo(), batch_size=8))
    assert b.labels.dtype == torch.float32 and b.labels.tolist() == [1.0, 0.0, 0.0]
    raw = np.array([[float(x) if x else 0.0 for x in r[1:14]] for r in ROWS])
    assert b.dense.dtype == torch.float32 and b.dense.shape == (3, 13)
    np.testing.assert_allclose(b.dense.numpy(), np.log1p(np.maximum(raw, 0.0)), rtol=1e-6)
    assert list(b.sparse) == [f"C{i}" for i in range(1, 27)] + [f"I{i}_bucket" for i in range(1, 14)]
    for i in range(26):
        j = b.sparse[f"C{i + 1}"]
        assert j.offsets.tolist() == [0, 1, 2, 3] and j.lengths().tolist() == [1, 1, 1]
        assert j.values.tolist() == [hash_feature(r[14 + i], feature_seed(f"C{i + 1}")) for r in ROWS]
    # "" is a key of its own, distinct from any value
    assert b.sparse["C1"].values[2].item() == hash_feature("", feature_seed("C1"))

    # Buckets of the raw counts: floor(v) up to 2, 3 + floor(ln(v)^2) above, and "" has its own key
    buckets = [[int(v) if v <= 2 else 3 + math.floor(math.log(v) ** 2) for v in r] for r in raw]
    for i in range(13):
        seed = feature_seed(f"I{i + 1}_bucket")
        want = [hash_features(np.array([v[i]]), seed)[0] for v in buckets]
        want = [
            w if r[1 + i] else hash_features(np.array([np.iinfo(np.int64).min]), seed)[0] for w, r in zip(want, ROWS)
        ]
        assert b.sparse[f"I{i + 1}_bucket"].values.tolist() == want, i
    # I3 of row 1 is "0" and of row 2 is "": a missing count is not a zero count
    assert b.sparse["I3_bucket"].values[1] != b.sparse["I3_bucket"].values[2]

    plain = ColumnSchema(0, range(1, 14), range(14, 40), log_transform=False)
    (b2,) = list(read_click_log(p, plain, batch_size=8))
    np.testing.assert_array_equal(b2.dense.numpy(), raw.astype(np.float32))  # -1 and -7 kept as is
    assert list(b2.sparse) == [f"C{i}" for i in range(1, 27)]  # index-addressed, no header: C{j+1}
    assert b2.sparse["C5"].values.equal(b.sparse["C5"].values)


def test_batches_chunks_limit_skip(tmp_path: Path) -> None:
    rows = [[str(i % 2), str(i), f"v{i % 7}"] for i in range(103)]
    p = write(tmp_path / "t.tsv", rows)
    schema = ColumnSchema(0, [1], [2], log_transform=False)

    def read(batch_size: int, **kw: int) -> list[Batch]:
        return list(read_click_log(p, schema, batch_size, **kw))

    whole = read(1000)
    assert [b.batch_size for b in read(10)] == [10] * 10 + [3]
    for chunk_bytes in (1, 7, 64, 1 << 20):  # lines straddle chunk boundaries
        bs = read(10, chunk_bytes=chunk_bytes)
        assert torch.cat([b.dense for b in bs]).equal(whole[0].dense)
        assert torch.cat([b.sparse["C1"].values for b in bs]).equal(whole[0].sparse["C1"].values)
    for skip, limit in [(0, 0), (5, 10), (0, 103), (100, 50), (103, None), (200, 1), (7, None)]:
        kw = {"skip": skip, "chunk_bytes": 16} | ({} if limit is None else {"limit": limit})
        got = read(4, **kw)
        values = torch.cat([b.dense[:, 0] for b in got]).tolist() if got else []
        end = 103 if limit is None else skip + limit
        assert values == [float(i) for i in range(skip, min(end, 103))]
    with pytest.raises(ValueError):
        read(0)
    with pytest.raises(ValueError):
        read(4, skip=-1)


def test_crlf_no_trailing_newline_header_bom(tmp_path: Path) -> None:
    p = tmp_path / "x.csv"
    p.write_bytes("\ufeffclick,n,site\r\n1,2.5,a\r\n0,-3,\r\n1,1e2,b".encode())
    (b,) = list(read_click_log(p, ColumnSchema("click", ["n"], ["site"], sep=",", header=True, log_transform=False), 8))
    assert b.labels.tolist() == [1.0, 0.0, 1.0]
    assert b.dense[:, 0].tolist() == [2.5, -3.0, 100.0]
    s = feature_seed("site")
    assert b.sparse["site"].values.tolist() == [hash_feature("a", s), hash_feature("", s), hash_feature("b", s)]


def test_seeds_override_and_schema_errors(tmp_path: Path) -> None:
    p = write(tmp_path / "t.csv", [["y", "a", "b"], ["1", "x", "x"]], sep=",")
    schema = ColumnSchema("y", [], ["a", "b"], sep=",", header=True, seeds={"a": 42})
    (b,) = list(read_click_log(p, schema, 4))
    assert b.sparse["a"].values.tolist() == [hash_feature("x", 42)]
    assert b.sparse["b"].values.tolist() == [hash_feature("x", feature_seed("b"))]
    assert b.dense.shape == (1, 0)
    bad = [
        (ColumnSchema("y", [], ["a"], sep=",", header=True, seeds={"zz": 1}), "unknown features"),
        (ColumnSchema("y", [], ["nope"], sep=",", header=True), "'nope' not in"),
        (ColumnSchema("y", ["a"], ["a"], sep=",", header=True), "used twice"),
        (ColumnSchema(0, [], [0, 5], sep=","), "out of range"),
    ]
    for s, message in bad:
        with pytest.raises(ValueError, match=message):
            list(read_click_log(p, s, 4))
    with pytest.raises(ValueError, match="one ASCII character"):
        ColumnSchema(0, [], [1], sep="::")


@pytest.mark.parametrize(
    "line, message",
    [
        ("1\t2\tx\tq", r"bad\.tsv:3: 4 fields, expected 3"),
        ("1\t2", r"bad\.tsv:3: 2 fields, expected 3"),
        ("", r"bad\.tsv:3: 1 fields, expected 3"),
        ("1\t2x\tq", r"bad\.tsv:3: column 'n' \(field 2\): b'2x' is not a finite number"),
        ("1\tnan\tq", r"bad\.tsv:3: column 'n' \(field 2\)"),
        ("2\t2\tq", r"bad\.tsv:3: column 'y' \(field 1\): label b'2', expected 0 or 1"),
        ("\t2\tq", r"bad\.tsv:3: column 'y' \(field 1\): label b''"),
    ],
)
def test_malformed_rows_name_file_line_column(tmp_path: Path, line: str, message: str) -> None:
    p = tmp_path / "bad.tsv"
    p.write_text("y\tn\tc\n1\t2\tq\n" + line + "\n0\t1\tq\n")
    schema = ColumnSchema("y", ["n"], ["c"], header=True)
    for chunk_bytes in (3, 1 << 20):
        with pytest.raises(ValueError, match=message):
            list(read_click_log(p, schema, 1, chunk_bytes=chunk_bytes))
    # skip counts data rows; the line number stays the physical one
    for chunk_bytes in (3, 1 << 20):
        with pytest.raises(ValueError, match=r"bad\.tsv:3:"):
            list(read_click_log(p, schema, 1, skip=1, chunk_bytes=chunk_bytes))
    assert len(list(read_click_log(p, schema, 1, limit=1))) == 1  # stops before the bad row


def test_bad_lines_skip_leaves_out_every_malformed_line_and_counts_it(tmp_path: Path) -> None:
    bad = ["1\t2\tx\tq", "1\t2", "", "1\t2x\tq", "2\t2\tq", "\t2\tq", "0\tinf\tq"]
    lines = ["y\tn\tc"]
    for i in range(40):
        lines.append(bad[i // 5] if i % 5 == 2 and i // 5 < len(bad) else f"{i % 2}\t{i}\tv{i}")
    p = tmp_path / "bad.tsv"
    p.write_text("\n".join(lines) + "\n")
    schema = ColumnSchema("y", ["n"], ["c"], header=True, log_transform=False)
    want = [i for i in range(40) if not (i % 5 == 2 and i // 5 < len(bad))]
    with pytest.raises(DataError, match=r"bad\.tsv:4: 4 fields") as first:
        list(read_click_log(p, schema, 8))
    assert (first.value.path, first.value.line) == (str(p), 4)
    for chunk_bytes in (5, 64, 1 << 20):
        skipped = BadLines()
        rows = list(read_click_log(p, schema, 8, chunk_bytes=chunk_bytes, bad_lines=skipped))
        assert torch.cat([b.dense[:, 0] for b in rows]).tolist() == want, chunk_bytes
        assert skipped.count == len(bad) and skipped.first == [4, 9, 14, 19, 24], chunk_bytes
        assert str(skipped) == "7 malformed lines skipped (first at lines 4, 9, 14, 19, 24, ...)"
    again = BadLines()
    whole = load_click_log(p, schema, bad_lines=again)
    load_click_log(p, schema, bad_lines=again)  # a second pass counts no line twice
    assert len(whole) == len(want) and again.count == len(bad)
    p.write_text("y\tn\tc\n1\t2\n")
    with pytest.raises(DataError, match=r"no data rows \(1 malformed line skipped \(first at line 2\)\)"):
        load_click_log(p, schema, bad_lines=BadLines())


def test_label_threshold_order_by_and_the_whole_log(tmp_path: Path) -> None:
    p = write(
        tmp_path / "u.data",
        [["7", "1", "4", "30"], ["8", "2", "3", "10"], ["7", "2", "5", "20"], ["9", "1", "1", "10"]],
    )
    schema = ColumnSchema.movielens()
    log = load_click_log(p, schema)
    # sorted by timestamp, stably (the two rows at t=10 keep their file order)
    assert log.labels.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert log.keys[0].tolist() == [hash_feature(u, feature_seed("user_id")) for u in ("8", "9", "7", "7")]
    assert log.features == ("user_id", "item_id") and log.dense.shape == (4, 0)
    head, tail = log[:3], log[3:]
    assert len(head) == 3 and len(tail) == 1 and tail.labels.tolist() == [1.0]
    assert [b.batch_size for b in head.batches(2)] == [2, 1]
    assert [b.labels.tolist() for b in log.batches(1, rank=1, world_size=2)] == [[0.0], [1.0]]
    assert log.batches(1).__next__().sparse["item_id"].values.tolist() == [hash_feature("2", feature_seed("item_id"))]
    with pytest.raises(ValueError, match="use load_click_log"):
        next(read_click_log(p, schema, 4))
    unsorted = ColumnSchema(2, [], [0, 1], label_threshold=4)
    (b,) = list(read_click_log(p, unsorted, 8))
    assert b.labels.tolist() == [1.0, 0.0, 1.0, 0.0]  # file order; >= 4 is positive
    p.write_text("7\t1\tfour\t3\n")
    with pytest.raises(ValueError, match=r"u\.data:1: column 'rating' \(field 3\): b'four' is not a finite number"):
        load_click_log(p, schema)
    p.write_text("7\t1\t4\t\n")
    with pytest.raises(ValueError, match=r"u\.data:1: column 'timestamp' \(order_by\) is empty"):
        load_click_log(p, schema)
    p.write_text("")
    with pytest.raises(ValueError, match="no data rows"):
        load_click_log(p, schema)


def test_empty_and_header_only(tmp_path: Path) -> None:
    (tmp_path / "e").write_text("")
    (tmp_path / "h").write_text("y,c\n")
    assert list(read_click_log(tmp_path / "e", ColumnSchema(0, [], [1]), 4)) == []
    assert list(read_click_log(tmp_path / "h", ColumnSchema("y", [], ["c"], sep=",", header=True), 4)) == []
    with pytest.raises(ValueError, match="expected a header"):
        list(read_click_log(tmp_path / "e", ColumnSchema("y", [], ["c"], header=True), 4))


# --- the real samples


@pytest.mark.skipif(not CRITEO.exists(), reason=f"{CRITEO} not present")
def test_real_criteo_sample() -> None:
    batches = list(read_click_log(CRITEO, ColumnSchema.criteo(), batch_size=4096))
    assert [b.batch_size for b in batches] == [4096, 4096, 1808]
    assert labels_of(batches).sum() == 2182
    for i in range(26):
        keys = cat(batches, f"C{i + 1}")
        assert len(np.unique(keys)) == CRITEO_DISTINCT[i] + (CRITEO_EMPTY[i] > 0), f"C{i + 1}"
    with CRITEO.open() as f:
        first = f.readline().rstrip("\n").split("\t")
    assert batches[0].sparse["C1"].values[0].item() == hash_feature(first[14], feature_seed("C1"))
    assert batches[0].dense[0, 0].item() == pytest.approx(math.log1p(int(first[1])))
    tail = list(read_click_log(CRITEO, ColumnSchema.criteo(), 1000, skip=9500, limit=1000))
    assert torch.cat([b.labels for b in tail]).equal(torch.from_numpy(labels_of(batches)[9500:]))


@pytest.mark.skipif(not MOVIELENS.exists(), reason=f"{MOVIELENS} not present")
def test_real_movielens_sample() -> None:
    log = load_click_log(MOVIELENS, ColumnSchema.movielens())
    assert len(log) == 100_000 and int(log.labels.sum()) == 34174 + 21201  # ratings 4 and 5
    assert len(np.unique(log.keys[0])) == 943 and len(np.unique(log.keys[1])) == 1682
    # the last 20% in time order is the baseline's test split: positive rate 0.5652
    assert float(log[80_000:].labels.mean()) == pytest.approx(0.5652, abs=5e-5)


@pytest.mark.skipif(not AVAZU.exists(), reason=f"{AVAZU} not present")
def test_real_avazu_sample() -> None:
    batches = list(read_click_log(AVAZU, ColumnSchema.avazu(), batch_size=4096))
    assert sum(b.batch_size for b in batches) == 9999
    assert labels_of(batches).sum() == 1706
    assert batches[0].dense.shape == (4096, 0)
    assert {f: len(np.unique(cat(batches, f))) for f in AVAZU_DISTINCT} == AVAZU_DISTINCT
    assert "hour" not in batches[0].sparse and "id" not in batches[0].sparse


def test_avazu_preset_small_csv(tmp_path: Path) -> None:
    header = (
        "id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,"
        "device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21"
    )
    row = (
        "1000009418151094273,1,14102100,1005,0,1fbe01fe,f3845767,28905ebd,ecad2386,7801e8d9,07d7df22,"
        "a99f214a,ddd2926e,44956a24,1,2,15706,320,50,1722,0,35,-1,79"
    )
    p = tmp_path / "a.csv"
    p.write_text(header + "\r\n" + row + "\r\n")
    (b,) = list(read_click_log(p, ColumnSchema.avazu(), 8))
    assert b.labels.tolist() == [1.0]
    names, values = header.split(","), row.split(",")
    assert list(b.sparse) == [n for n in names if n not in ("id", "click", "hour")]
    for n, v in zip(names, values):
        if n in b.sparse:
            assert b.sparse[n].values.tolist() == [hash_feature(v, feature_seed(n))], n


# --- synthetic data with a planted model


def test_synthetic_deterministic_and_shaped() -> None:
    def stream(seed: int) -> list[Batch]:
        return list(synthetic_criteo(1000, 256, seed=seed))

    a, b, c = stream(1), stream(1), stream(2)
    assert [x.batch_size for x in a] == [256, 256, 256, 232]
    for x, y in zip(a, b):
        assert x.dense.equal(y.dense) and x.labels.equal(y.labels)
        assert all(x.sparse[f].values.equal(y.sparse[f].values) for f in x.sparse)
    assert not a[0].dense.equal(c[0].dense)
    x = a[0]
    assert x.dense.shape == (256, 13) and x.dense.dtype == torch.float32 and bool((x.dense >= 0).all())
    assert list(x.sparse) == [f"C{i}" for i in range(1, 27)]
    assert all(j.offsets.equal(torch.arange(257)) for j in x.sparse.values())
    # C9 has 3 ids; its keys are hash_features of them under the reader's seed for "C9"
    keys = set(torch.cat([y.sparse["C9"].values for y in a]).tolist())
    assert keys <= set(hash_features(np.arange(3), feature_seed("C9")).tolist())
    small = next(synthetic_criteo(10, 10, num_dense=0, vocab_sizes=[5], interaction=None))
    assert small.dense.shape == (10, 0) and list(small.sparse) == ["C1"]


def test_synthetic_rank_sharding() -> None:
    whole = list(synthetic_criteo(1100, 100, seed=5))
    shards = [list(synthetic_criteo(1100, 100, seed=5, rank=r, world_size=3)) for r in range(3)]
    assert [len(s) for s in shards] == [4, 4, 3]
    for r, s in enumerate(shards):
        for k, batch in enumerate(s):
            assert batch.dense.equal(whole[r + 3 * k].dense)  # disjoint slices of one stream
    rows = {tuple(row) for s in shards for b in s for row in b.dense.tolist()}
    assert len(rows) == sum(b.batch_size for s in shards for b in s)  # no sample twice
    with pytest.raises(ValueError):
        next(synthetic_criteo(10, 10, rank=3, world_size=3))


def test_synthetic_planted_model() -> None:
    batches = list(synthetic_criteo(100_000, 4096, seed=11))
    assert all(isinstance(b, SyntheticBatch) for b in batches)
    y = labels_of(batches)
    logits = torch.cat([b.logits for b in batches if isinstance(b, SyntheticBatch)]).numpy()
    assert 0.23 < y.mean() < 0.27
    assert 0.78 < auc(y, logits) < 0.85
    assert auc(y, logits) > auc(y, batches_dense_sum(batches)) + 0.1  # the sparse part carries most signal
    # Zipf: the most frequent id of a 1M-vocab feature takes about 1/H(1e6, 1.05) of the samples
    keys = np.unique(torch.cat([b.sparse["C3"].values for b in batches]).numpy(), return_counts=True)[1]
    p0 = 1 / np.sum(np.arange(1, 1_000_001) ** -1.05)
    assert abs(keys.max() / 100_000 - p0) < 0.01
    other = list(synthetic_criteo(20_000, 4096, seed=12, model_seed=1))
    assert 0.22 < labels_of(other).mean() < 0.28


def batches_dense_sum(batches: Sequence[Batch]) -> np.ndarray:
    return torch.cat([b.dense.sum(1) for b in batches]).numpy()


# --- metrics


def brute_auc(y: list[int], s: list[float]) -> float:
    pairs = [(a, b) for a, b in itertools.product(range(len(y)), repeat=2) if y[a] == 1 and y[b] == 0]
    return sum(1.0 if s[a] > s[b] else 0.5 if s[a] == s[b] else 0.0 for a, b in pairs) / len(pairs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(-3, 3)), min_size=2, max_size=40))
def test_auc_matches_brute_force(data: list[tuple[int, int]]) -> None:
    y, s = [d[0] for d in data], [d[1] / 2 for d in data]  # few distinct scores: many ties
    if 0 < sum(y) < len(y):
        assert auc(y, s) == pytest.approx(brute_auc(y, s), abs=1e-12)
        assert auc(torch.tensor(y, dtype=torch.float32), torch.tensor(s)) == pytest.approx(brute_auc(y, s))


def test_auc_and_logloss_edges() -> None:
    assert auc([0, 1], [0.2, 0.9]) == 1.0 and auc([1, 0], [0.2, 0.9]) == 0.0
    for bad in (([1, 1], [0.1, 0.2]), ([0, 1], [0.1]), ([0, 2], [0.1, 0.2]), ([0, 1], [0.1, math.nan])):
        with pytest.raises(ValueError):
            auc(*bad)
    assert logloss([1, 0], [0.9, 0.2]) == pytest.approx(-(math.log(0.9) + math.log(0.8)) / 2)
    assert math.isfinite(logloss([1, 0], [0.0, 1.0]))  # clipped, not inf
    assert logloss([1, 0], [0.0, 1.0]) == pytest.approx(-math.log(1e-7), rel=1e-6)
    with pytest.raises(ValueError):
        logloss([], [])
