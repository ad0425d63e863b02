"""Parity: training through the shards equals training the same model locally.

One worker, sync mode, real shards. The local twin keeps each table as an
``nn.Parameter`` started from the same deterministic initial rows and pooled with the
same ``embedding_bag`` call an ``nn.EmbeddingBag`` makes, and trains it with the
``torch.optim`` optimizer the shards run. Pipelined mode's fused sum pooling is held to
the same run through ``embedding_bag``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from client import PSClient
from ps.table import InitializerParams
from ps.table.initializers import initial_rows
from tests.twins import RowwiseAdagrad
from worker import DistributedEmbedding, EmbeddingTableConfig, FeatureConfig, JaggedIds

VOCAB, DIM, BATCH, STEPS = 40, 8, 16, 12
FEATURES = [  # two features share table "a"; "b" has per-id weights; "c" is unpooled
    FeatureConfig("f_sum", "a", "sum"),
    FeatureConfig("f_mean", "a", "mean"),
    FeatureConfig("f_weighted", "b", "sum"),
    FeatureConfig("f_rows", "b", "none"),
]


def make_batches(seed: int) -> list[dict[str, JaggedIds]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        batch = {}
        for f in FEATURES:
            lengths = torch.from_numpy(rng.integers(0, 4, BATCH))  # empty bags included
            values = torch.from_numpy(rng.integers(0, VOCAB, int(lengths.sum())))
            weights = torch.from_numpy(rng.random(len(values)).astype(np.float32)) if f.name == "f_weighted" else None
            batch[f.name] = JaggedIds.from_lengths(values, lengths, weights)
        out.append(batch)
    return out


class Tower(torch.nn.Module):
    """Dense part: pooled features plus the sum of the unpooled rows per sample -> one logit."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4 * DIM, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, emb: dict[str, torch.Tensor], batch: dict[str, JaggedIds]) -> torch.Tensor:
        lengths = batch["f_rows"].lengths()
        owner = torch.repeat_interleave(torch.arange(BATCH), lengths)
        rows_sum = torch.zeros(BATCH, DIM).index_add(0, owner, emb["f_rows"] * 2.0)
        x = torch.cat([emb["f_sum"], emb["f_mean"], emb["f_weighted"], rows_sum], dim=1)
        return self.mlp(x).squeeze(1)


def local_embeddings(weights: dict[str, torch.nn.Parameter], batch: dict[str, JaggedIds]) -> dict[str, torch.Tensor]:
    out = {}
    for f in FEATURES:
        ids, w = batch[f.name], weights[f.table]
        if f.pooling == "none":
            out[f.name] = w.index_select(0, ids.values)
        else:
            out[f.name] = F.embedding_bag(
                ids.values, w, ids.offsets[:-1], mode=f.pooling, per_sample_weights=ids.weights
            )
    return out


@pytest.mark.parametrize(
    ("optimizer", "params", "torch_opt", "rtol"),
    [
        # SGD: the shard's kernel matches torch's fused multiply-add, bit for bit.
        ("sgd", {"lr": 0.5}, lambda p: torch.optim.SGD(p, lr=0.5), 0.0),
        # Adagrad: torch's float32 sqrt is off by up to ~0.75 ulp (see test_optimizers.py), so
        # rows may differ in the last bit and the dense weights by the same relative amount.
        (
            "adagrad",
            {"lr": 0.3, "initial_accumulator_value": 0.1},
            lambda p: torch.optim.Adagrad(p, lr=0.3, initial_accumulator_value=0.1),
            2e-6,
        ),
        # Row-wise Adagrad: the twin is the kernel's float32 operations in numpy, bit for bit.
        ("rowwise_adagrad", {"lr": 0.3}, lambda p: RowwiseAdagrad(p, lr=0.3), 0.0),
    ],
)
def test_parity_sync_training_matches_local_embedding_bag(
    addresses: list[str], optimizer: str, params: dict[str, float], torch_opt: Any, rtol: float
) -> None:
    tables = [
        EmbeddingTableConfig("a", DIM, optimizer, seed=1, params=params),
        EmbeddingTableConfig("b", DIM, optimizer, seed=2, params=params),
    ]
    batches = make_batches(7)
    labels = [torch.from_numpy(np.random.default_rng(s).integers(0, 2, BATCH).astype(np.float32)) for s in range(STEPS)]

    with PSClient(addresses) as client:
        torch.manual_seed(0)
        tower = Tower()
        emb = DistributedEmbedding(tables, FEATURES, client, mode="sync")
        dense_opt = torch.optim.SGD(tower.parameters(), lr=0.1)
        for batch, y in zip(batches, labels):
            loss = F.binary_cross_entropy_with_logits(tower(emb(batch), batch), y)
            dense_opt.zero_grad()
            loss.backward()
            dense_opt.step()
        emb.close()
        keys = np.arange(VOCAB)
        ps_rows = client.lookup_many({"a": keys, "b": keys})

    torch.manual_seed(0)
    twin = Tower()
    weights = {
        t.name: torch.nn.Parameter(torch.from_numpy(initial_rows(InitializerParams(), t.seed, keys, DIM)))
        for t in tables
    }
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    sparse_opt = torch_opt(list(weights.values()))
    for batch, y in zip(batches, labels):
        loss = F.binary_cross_entropy_with_logits(twin(local_embeddings(weights, batch), batch), y)
        twin_opt.zero_grad()
        sparse_opt.zero_grad()
        loss.backward()
        twin_opt.step()
        sparse_opt.step()

    for name, w in weights.items():
        np.testing.assert_allclose(ps_rows[name], w.detach().numpy(), rtol=rtol, atol=0 if rtol == 0 else 1e-7)
        assert not np.allclose(
            ps_rows[name], initial_rows(InitializerParams(), tables[0 if name == "a" else 1].seed, keys, DIM)
        )
    for p, q in zip(tower.parameters(), twin.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=rtol * 5, atol=0 if rtol == 0 else 1e-6)


def test_pipelined_fused_pooling_trains_like_embedding_bag(addresses: list[str]) -> None:
    """Pipelined sum pooling runs in one node (worker/pooling.py); the same run through
    ``embedding_bag`` ends with the same rows and dense weights, up to float rounding."""
    features = [FeatureConfig("x", "a"), FeatureConfig("y", "a"), FeatureConfig("z", "b")]  # "a" read twice
    rng = np.random.default_rng(3)
    batches = []
    for _ in range(STEPS):
        batch = {}
        for f in features:
            lengths = torch.from_numpy(rng.integers(0, 4, BATCH))  # empty bags included
            batch[f.name] = JaggedIds.from_lengths(
                torch.from_numpy(rng.integers(0, VOCAB, int(lengths.sum()))), lengths
            )
        batches.append(batch)
    finals = []
    with PSClient(addresses) as client:
        for fused in (True, False):
            tables = [
                EmbeddingTableConfig(f"{t}_{fused}", DIM, "adagrad", seed=i, params={"lr": 0.3})
                for i, t in enumerate("ab")
            ]
            emb = DistributedEmbedding(tables, [FeatureConfig(f.name, f"{f.table}_{fused}") for f in features], client)
            assert emb._fusable  # the default for sum pooling on CPU
            emb._fusable = fused
            torch.manual_seed(0)
            tower = torch.nn.Linear(3 * DIM, 1)
            opt = torch.optim.SGD(tower.parameters(), lr=0.1)
            emb.prefetch(batches[0])
            for t, batch in enumerate(batches):
                if t + 1 < STEPS:
                    emb.prefetch(batches[t + 1])
                out = emb(batch)
                loss = tower(torch.cat([out["x"], out["y"], out["z"]], 1)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            emb.close()
            keys = np.arange(VOCAB)
            rows = client.lookup_many({f"a_{fused}": keys, f"b_{fused}": keys})
            finals.append((list(rows.values()), [p.detach().clone() for p in tower.parameters()]))
    (rows_fused, dense_fused), (rows_bag, dense_bag) = finals
    for a, b in zip(rows_fused + dense_fused, rows_bag + dense_bag):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    initial = initial_rows(InitializerParams(), 0, np.arange(VOCAB), DIM)
    assert not np.allclose(rows_fused[0], initial)  # it trained
