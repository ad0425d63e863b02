"""Helpers of the ``ps-infer`` tests: a real ``ps-infer`` process started and stopped, requests
of raw synthetic values, and the trained model scored in this process for comparison
(``test_infer``, and the elastic serving proof, use them)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from client import PSClient
from protos.keys import hash_features
from worker.config import EmbeddingTableConfig, FeatureConfig
from worker.data import Batch, feature_seed
from worker.embedding import DistributedEmbedding
from worker.jagged import JaggedIds
from worker.models import DLRM
from worker.trainer import predict

REPO = Path(__file__).resolve().parents[2]
CRITEO = REPO.parent / "shared" / "data" / "criteo_kaggle_train_head10k.txt"
CAT = [f"C{i}" for i in range(1, 27)]
DENSE = [f"I{j}" for j in range(1, 14)]
F32 = npt.NDArray[np.float32]


@dataclass
class Trained:
    addresses: list[str]
    run: Path
    shard_pids: list[int] = field(default_factory=list)


@dataclass
class Infer:
    proc: subprocess.Popen[bytes]
    address: str
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def start_infer(trained: Trained, root: Path, name: str, *extra: str) -> Infer:
    """A real ``ps-infer`` process on 127.0.0.1 port 0; returns once it wrote its port file."""
    return await_infer(*spawn_infer(trained, root, name, *extra))


def spawn_infer(trained: Trained, root: Path, name: str, *extra: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Start ``ps-infer`` (``start_infer``) without waiting: its process, port file and log.
    No drain on SIGTERM unless ``extra`` asks for one: these tests stop it at their end,
    with nobody to move away (``test_sigterm_drains_first`` tests the drain)."""
    if not any(a.startswith("--drain-s") for a in extra):
        extra = ("--drain-s=0", *extra)
    port_file, log = root / f"{name}.port", root / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker.serving",
                f"--model={trained.run}",
                f"--ps={','.join(trained.addresses)}",
                "--listen=127.0.0.1:0",
                f"--port-file={port_file}",
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    return proc, port_file, log


def await_infer(proc: subprocess.Popen[bytes], port_file: Path, log: Path) -> Infer:
    """The ``Infer`` of a spawned ``ps-infer`` once it wrote its port file (fails if it exits first)."""
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"ps-infer did not start (exit {proc.wait()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return Infer(proc, f"127.0.0.1:{port_file.read_text().strip()}", log)


def stop_infer(infer: Infer) -> None:
    """SIGTERM; it must exit 0."""
    infer.proc.send_signal(signal.SIGTERM)
    try:
        code = infer.proc.wait(60)
    except subprocess.TimeoutExpired:
        infer.proc.kill()
        pytest.fail(f"ps-infer ignored SIGTERM:\n{infer.tail()}")
    assert code == 0, f"ps-infer exited {code}:\n{infer.tail()}"


def raw_rows(n: int, seed: int) -> tuple[dict[str, npt.NDArray[np.int64]], dict[str, npt.NDArray[np.float64]]]:
    """Raw synthetic values: ids per categorical column (mostly ones training saw), counts per dense column."""
    rng = np.random.default_rng(seed)
    ids = {c: rng.zipf(1.3, n).astype(np.int64) - 1 for c in CAT}
    counts = {d: np.floor(rng.lognormal(1.0, 1.2, n)) for d in DENSE}
    return ids, counts


def in_process(
    trained: Trained, ids: Mapping[str, npt.NDArray[np.int64]], counts: Mapping[str, npt.NDArray[np.float64]]
) -> F32:
    """The trained model in this process, on the keys and dense values the generator would make."""
    manifest = json.loads((trained.run / "manifest.json").read_text())
    tables = [
        EmbeddingTableConfig(t["name"], t["dim"], t["optimizer"], t["initializer"], t["seed"], t["params"])
        for t in manifest["tables"]
    ]
    features = [FeatureConfig(f["name"], f["table"], f["pooling"]) for f in manifest["features"]]
    model = DLRM(len(DENSE), CAT, manifest["dim"], wide=[c + ".wide" for c in CAT])
    model.load_state_dict(torch.load(trained.run / "dense.pt"))
    n = len(ids[CAT[0]])
    offsets = torch.arange(n + 1)
    sparse = {c: JaggedIds(torch.from_numpy(hash_features(ids[c], feature_seed(c))), offsets) for c in CAT}
    dense = torch.from_numpy(np.stack([np.log1p(counts[d]) for d in DENSE], 1).astype(np.float32))
    with PSClient(trained.addresses) as client:
        emb = DistributedEmbedding(tables, features, client)
        try:
            _, probs = predict(emb, model, [Batch(dense, sparse, torch.zeros(n))], torch.device("cpu"))
        finally:
            emb.close()
    out: F32 = probs.numpy()
    return out


def requests_of(
    ids: Mapping[str, Any], counts: Mapping[str, Any], sizes: list[int], context: tuple[str, ...] = ("C1", "I1")
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Split rows into requests of ``sizes``; the ``context`` columns become one value per request."""
    out = []
    lo = 0
    for n in sizes:
        cols = {k: v[lo : lo + n] for k, v in {**ids, **counts}.items()}
        out.append(({k: cols[k][0] for k in context}, {k: v for k, v in cols.items() if k not in context}))
        lo += n
    return out


def with_shared_context(
    ids: dict[str, Any], counts: dict[str, Any], sizes: list[int], context: tuple[str, ...] = ("C1", "I1")
) -> None:
    """Make the ``context`` columns constant within each request's rows (in place)."""
    lo = 0
    for n in sizes:
        for k in context:
            col = ids if k in ids else counts
            col[k][lo : lo + n] = col[k][lo]
        lo += n
