"""The serving benchmark's ``infer`` part: ``ps-infer`` end to end against an in-process
predictor holding the same rows in RAM (``worker.predictor.Predictor`` over ``RamRows``).
Skipped while ``worker.serving`` is missing. ``bench_serving.py`` runs it; see its docstring.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: client/, worker/
sys.path.insert(1, str(Path(__file__).resolve().parent))  # serving_parts, beside this file

from serving_parts import (  # noqa: E402
    CANDIDATES,
    CONCURRENCY,
    DIM,
    FEATURES,
    INFER_GOAL,
    SHARDS,
    Keys,
    Processes,
    Rows,
    Setup,
    run_threads,
    summarize,
)

from client import PSClient  # noqa: E402

# -- part 2: ps-infer ----------------------------------------------------------------------


class RamRows:
    """Rows held in this process, answering ``lookup_many`` as a serving cluster would
    (a key it does not hold reads as zeros). Built by ``RecordingClient.ram_rows``."""

    def __init__(self, rows: Mapping[str, tuple[Keys, Rows]], tables: Any) -> None:
        self._tables = tables
        self._rows: dict[str, tuple[Keys, Rows]] = {}
        for name, (keys, values) in rows.items():
            order = np.argsort(keys, kind="stable")
            padded = np.vstack([values[order], np.zeros((1, values.shape[1]), np.float32)])  # last: the zero row
            self._rows[name] = (keys[order], padded)

    def tables(self) -> Any:
        return self._tables

    def lookup_many(
        self, requests: Mapping[str, npt.ArrayLike], *, out: Mapping[str, Rows] | None = None, **_: Any
    ) -> dict[str, Rows]:
        found = {}
        for name, k in requests.items():
            keys, rows = self._rows[name]
            q = np.asarray(k, np.int64)
            idx = np.minimum(np.searchsorted(keys, q), len(keys) - 1)
            idx[keys[idx] != q] = len(keys)
            target = (out or {}).get(name)
            found[name] = rows[idx] if target is None else np.take(rows, idx, axis=0, out=target)
        return found

    def lookup(self, table: str, keys: npt.ArrayLike, **kw: Any) -> Rows:
        return self.lookup_many({table: keys}, **kw)[table]


class RecordingClient:
    """A ``PSClient`` that also keeps every (table, key, row) its lookups returned."""

    def __init__(self, client: PSClient) -> None:
        self._client = client
        self.seen: dict[str, dict[int, Rows]] = {}
        self.keys_per_call: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)  # anything else the predictor calls: the real client's

    def lookup_many(self, requests: Mapping[str, npt.ArrayLike], **kw: Any) -> dict[str, Rows]:
        got = self._client.lookup_many(requests, **kw)
        self.keys_per_call.append(sum(len(np.asarray(k)) for k in requests.values()))
        for name, keys in requests.items():
            seen = self.seen.setdefault(name, {})
            for k, row in zip(np.asarray(keys, np.int64).tolist(), got[name]):
                seen[k] = row.copy()
        return got

    def lookup(self, table: str, keys: npt.ArrayLike, **kw: Any) -> Rows:
        return self.lookup_many({table: keys}, **kw)[table]

    def ram_rows(self) -> RamRows:
        rows = {n: (np.fromiter(s, np.int64, len(s)), np.stack(list(s.values()))) for n, s in self.seen.items() if s}
        return RamRows(rows, self._client.admin.tables())


def infer_requests(run_dir: Path, n: int, seed: int = 7) -> list[bytes]:
    """``n`` serialized ``PredictRequest``s of ``CANDIDATES`` candidates for the model in ``run_dir``,
    every column a candidate column: integer ids drawn Zipf(1.05) over Criteo's vocab sizes, as the
    synthetic training stream draws them (so most rows exist), and lognormal counts for the dense
    columns. With 26 categorical columns that is the 2,600 keys of the lookup part."""
    from protos.columns import encode_request
    from worker.export import load_model
    from worker.synthetic import CRITEO_VOCAB_SIZES

    model = load_model(run_dir)
    rng = np.random.default_rng(seed)
    cdfs = {}
    for i, (column, kind) in enumerate(model.categorical.items()):
        if kind != "int64":
            raise ValueError(f"column {column!r} takes {kind} values: this part sends the synthetic data's int64 ids")
        c = np.cumsum(np.arange(1, CRITEO_VOCAB_SIZES[i % 26] + 1, dtype=np.float64) ** -1.05)
        cdfs[column] = c / c[-1]
    out = []
    for _ in range(n):
        columns: dict[str, Any] = {
            name: np.minimum(np.searchsorted(cdf, rng.random(CANDIDATES), side="right"), len(cdf) - 1).astype(np.int64)
            for name, cdf in cdfs.items()
        }
        columns |= {name: np.floor(rng.lognormal(1.0, 1.2, CANDIDATES)) for name in model.dense}
        out.append(encode_request({}, columns).SerializeToString())
    return out


def in_process_predictor(run_dir: Path, rows: Any) -> Callable[[bytes], Any]:
    """``worker.predictor.Predictor`` of the model in ``run_dir`` reading rows from ``rows``
    (anything with ``PSClient.lookup_many``), as a function of a serialized ``PredictRequest``
    returning its scores: what ps-infer does for one request, without gRPC and micro-batching."""
    from protos import infer_pb2
    from protos.columns import decode_request
    from worker.predictor import Predictor

    predictor = Predictor.load(run_dir, rows)

    def predict(body: bytes) -> Rows:
        request = decode_request(infer_pb2.PredictRequest.FromString(body))
        return predictor.score([predictor.encode(*request)])[0]

    return predict


def infer_part(setup: Setup, procs: Processes) -> dict[str, Any]:
    """``ps-infer`` end to end vs an in-process predictor holding the same rows in RAM.

    A short synthetic DLRM training run (dim 64, 26 categorical and 13 dense columns) on 2
    training shards with data dirs; the shards stopped and their data dirs served
    (``--mode serve``); ``ps-infer --model RUN --ps A,B`` on them (its defaults: micro-batching,
    torch's default threads). The in-process predictor is ``worker.predictor.Predictor`` (the
    one ps-infer runs) over a ``RamRows`` of every row the requests touch, recorded through the
    serving shards once, so both score with the same rows (checked). Requests are serialized
    before timing; ps-infer is called through a gRPC stub with identity serializers, the
    in-process predictor on the bytes (parse, encode, score: what ps-infer does per request).
    Both at concurrency 1 and 8 (threads). Goal: ps-infer requests/s >= 0.5x in-process at
    each concurrency.
    """
    for module in ("worker.serving", "worker.predictor"):
        if importlib.util.find_spec(module) is None:
            return {"skipped": f"ps-infer not available (no {module})"}
    import grpc

    from protos import infer_pb2

    root = setup.tmp / "infer"
    data_args = ("--data-dir=" + str(root / "data-{shard}"),)
    train = [procs.shard(i, SHARDS, root, *data_args) for i in range(SHARDS)]
    run_dir, samples = root / "run", 8_192 if setup.quick else 100_000
    print(f"infer: training DLRM dim {DIM} on {samples:,} synthetic samples for a model to serve ...", file=sys.stderr)
    cmd = [
        sys.executable,
        "-m",
        "worker.trainer",
        "--addresses",
        ",".join(s.address for s in train),
        "--dim",
        str(DIM),
        "--train-samples",
        str(samples),
        "--eval-samples",
        "4096",
        "--epochs",
        "1",
        "--output-dir",
        str(run_dir),
        "--progress",
        "false",
    ]
    if procs.wait(procs.popen(cmd, root / "trainer.log"), 1200) != 0:
        raise RuntimeError(f"trainer failed:\n{(root / 'trainer.log').read_text(errors='replace')[-3000:]}")
    for s in train:
        procs.stop_shard(s)
    shards = [procs.shard(i, SHARDS, root, "--mode=serve", *data_args) for i in range(SHARDS)]
    addresses = [s.address for s in shards]
    infer_addr = procs.child(
        [
            sys.executable,
            "-m",
            "worker.serving",
            "--model",
            str(run_dir),
            "--ps",
            ",".join(addresses),
            "--listen",
            "127.0.0.1:0",
        ],
        root / "ps-infer",
    )
    requests = infer_requests(run_dir, 16 if setup.quick else 64)
    with PSClient(addresses) as client:
        recorder = RecordingClient(client)
        recording = in_process_predictor(run_dir, recorder)
        expected = [np.asarray(recording(r), np.float32) for r in requests]
        in_process = in_process_predictor(run_dir, recorder.ram_rows())
    channel = grpc.insecure_channel(infer_addr)
    stub = channel.unary_unary("/ps.v1.Predictor/Predict", None, None)

    def remote(body: bytes) -> Any:
        return np.frombuffer(infer_pb2.PredictResponse.FromString(stub(body, timeout=30)).scores, np.float32)

    try:
        for name, predict in (("ps-infer", remote), ("in-process", in_process)):
            if not np.allclose(np.asarray(predict(requests[0]), np.float32), expected[0], rtol=1e-4, atol=1e-5):
                raise RuntimeError(f"{name} scores request 0 differently from the predictor reading the shards")
        systems = {"ps-infer": remote, "in-process": in_process}
        cells: dict[str, dict[str, dict[str, float]]] = {name: {} for name in systems}
        for c in CONCURRENCY:
            for name, predict in systems.items():
                run_threads(lambda i, p=predict: p(requests[i % len(requests)]), c, setup.warmup_s)
                lat, wall = run_threads(lambda i, p=predict: p(requests[i % len(requests)]), c, setup.seconds)
                cells[name][str(c)] = summarize(lat, wall)
    finally:
        channel.close()
    goals = []
    for c in map(str, CONCURRENCY):
        ratio = cells["ps-infer"][c]["requests_per_s"] / cells["in-process"][c]["requests_per_s"]
        goals.append(
            {
                "goal": f"ps-infer requests/s vs in-process, concurrency {c}",
                "ratio": ratio,
                "target": f">= {INFER_GOAL}x",
                "pass": ratio >= INFER_GOAL,
            }
        )
    keys = float(np.mean(recorder.keys_per_call))
    lines = [
        f"Predict of {CANDIDATES} candidates x {FEATURES} features (dim {DIM}), 2 serving shards; "
        f"{keys:.0f} distinct keys looked up per request on average (Zipf ids repeat)"
    ]
    for name, by_c in cells.items():
        for c, x in by_c.items():
            lines.append(
                f"  {name:<11} concurrency {c}: p50 {x['p50_ms']:.2f} ms, p99 {x['p99_ms']:.2f} ms, "
                f"{x['requests_per_s']:.0f} requests/s"
            )
    lines += [f"  {g['goal']}: {g['ratio']:.2f}x (target {g['target']}): {g['pass']}" for g in goals]
    return {
        "cells": cells,
        "goals": goals,
        "train_samples": samples,
        "distinct_keys_per_request": keys,
        "report": lines,
    }
