"""Reproducibility: one worker's run depends only on its seed, in sync and pipelined mode.

Pipelined mode looks up step t + 1 while step t computes; which pushes that lookup sees
must follow from the step numbers alone (exactly those through t - 1 - staleness), not
from which thread wins. The first test makes the race likely by delaying lookups at
random; the second runs the trainer twice as the examples do.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from client import PSClient
from deploy.train import run
from worker import DistributedEmbedding, EmbeddingTableConfig, FeatureConfig, JaggedIds
from worker.trainer import TrainerConfig

VOCAB, DIM, BATCH, STEPS = 30, 4, 32, 24


def train_with_jitter(addresses: list[str], mode: str, jitter_seed: int, table: str) -> tuple[np.ndarray, list[float]]:
    """A small model trained for STEPS steps; lookups and pushes are delayed at random (by ``jitter_seed``)."""
    rng = np.random.default_rng(0)
    batches = [
        {"f": JaggedIds.from_lengths(torch.from_numpy(rng.integers(0, VOCAB, 2 * BATCH)), torch.full((BATCH,), 2))}
        for _ in range(STEPS)
    ]
    labels = [torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32)) for _ in range(STEPS)]
    delays = random.Random(jitter_seed)
    with PSClient(addresses) as client:
        for name in ("lookup_many", "push_many"):
            real = getattr(client, name)

            def slow(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
                time.sleep(delays.random() * 0.01)
                return _real(*args, **kwargs)

            setattr(client, name, slow)
        tables = [EmbeddingTableConfig(table, DIM, "adagrad", params={"lr": 0.5})]
        emb = DistributedEmbedding(tables, [FeatureConfig("f", table)], client, mode=mode)  # type: ignore[arg-type]
        torch.manual_seed(0)
        head = torch.nn.Linear(DIM, 1)
        opt = torch.optim.SGD(head.parameters(), lr=0.1)
        losses = []
        emb.prefetch(batches[0])
        for t, (b, y) in enumerate(zip(batches, labels)):
            if t + 1 < STEPS:
                emb.prefetch(batches[t + 1])
            loss = F.binary_cross_entropy_with_logits(head(emb(b)["f"]).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        emb.close()
        rows = client.lookup(table, np.arange(VOCAB))
    return rows, losses


@pytest.mark.parametrize("mode", ["pipelined", "sync"])
def test_timing_does_not_change_what_a_step_sees(addresses: list[str], mode: str) -> None:
    first = train_with_jitter(addresses, mode, jitter_seed=1, table="a")
    second = train_with_jitter(addresses, mode, jitter_seed=2, table="b")
    assert first[1] == second[1]  # every step's loss, to the bit
    np.testing.assert_array_equal(first[0], second[0])


@pytest.mark.parametrize("mode", ["pipelined", "sync"])
def test_two_runs_with_one_seed_give_the_same_model(tmp_path: Path, mode: str) -> None:
    common: dict[str, Any] = dict(train_samples=40_000, eval_samples=8_000, progress=False, mode=mode, seed=3)
    a = run(TrainerConfig(output_dir=tmp_path / "a", **common))
    b = run(TrainerConfig(output_dir=tmp_path / "b", **common))
    assert a["dense_digests"] == b["dense_digests"]
    assert a["final"]["auc"] == b["final"]["auc"] and a["final"]["logloss"] == b["final"]["logloss"]


def test_a_run_in_process_gives_back_torch_threads(tmp_path: Path) -> None:
    """Local shards take cores from the trainer's torch threads for the run; afterwards the
    process computes with its own count again (an evaluation or a model served in the same
    process would otherwise differ in the last bit from one at the usual count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(64)  # more than any machine has beside its local shards
    try:
        run(TrainerConfig(output_dir=tmp_path, train_samples=2_000, eval_samples=500, progress=False))
        assert torch.get_num_threads() == 64
    finally:
        torch.set_num_threads(before)
