"""Sparse tables through ``torch.distributed.checkpoint`` (``worker.torchrec.checkpoint``), on real shards.

A TorchRec DLRM on ``PSEmbeddingBagCollection`` trains through 2 shards and is saved with DCP
(the rows as the shards' own checkpoint under a root they share); a fresh model over 3 shards
loads it: dense weights and every row are bit-equal, and the new cluster holds no other row.
Skipped where TorchRec is not installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torchrec = pytest.importorskip("torchrec", reason="TorchRec not installed (the README's set-up line installs it)")

import torch.distributed.checkpoint as dcp  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig  # noqa: E402
from torchrec.datasets.random import RandomRecDataset  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402

from client import InvalidRequestError, PSClient  # noqa: E402
from tests.integration.shards import RunningShard, start_shard, stop_shard  # noqa: E402
from worker.torchrec import PSEmbeddingBagCollection  # noqa: E402

KEYS = ["c0", "c1"]
VOCAB, DIM = 5_000, 8
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}


def tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=DIM, num_embeddings=VOCAB, feature_names=[k]) for k in KEYS]


def model(client: PSClient, seed: int, configs: list[EmbeddingBagConfig] | None = None, **kw: Any) -> DLRM:
    ebc = PSEmbeddingBagCollection(configs or tables(), client, kw.pop("fused", FUSED), **kw)
    torch.manual_seed(seed)
    return DLRM(ebc, dense_in_features=4, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])


def cluster(n: int, root: Path, checkpoints: Path) -> list[RunningShard]:
    return [start_shard(i, n, root / f"x{n}", "--checkpoint-root", str(checkpoints)) for i in range(n)]


def ebc_of(m: DLRM) -> PSEmbeddingBagCollection:
    ebc = m.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, PSEmbeddingBagCollection)
    return ebc


def train(m: DLRM, steps: int) -> np.ndarray:
    data = iter(RandomRecDataset(KEYS, 256, hash_size=VOCAB, ids_per_feature=3, num_dense=4, manual_seed=1))
    opt = torch.optim.Adagrad(m.parameters(), lr=0.05)
    seen = []
    for _ in range(steps):
        b = next(data)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            m(b.dense_features, b.sparse_features).squeeze(-1), b.labels.float()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append(b.sparse_features.values().numpy())
    return np.unique(np.concatenate(seen))


def rows_and_count(client: PSClient, keys: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    count: dict[str, int] = {}
    for shard in client.admin.stats():
        for t in shard["tables"]:
            count[t["name"]] = count.get(t["name"], 0) + int(t["rows"])
    return client.lookup_many({f"t_{k}": keys for k in KEYS}), count


def test_dcp_saved_from_two_shards_loads_into_three(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    shards = cluster(2, tmp_path, checkpoints)
    try:
        with PSClient([s.address for s in shards]) as client:
            trained = model(client, seed=0)
            keys = train(trained, 6)
            dcp.save(trained.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
            dense = {n: p.detach().clone() for n, p in trained.named_parameters()}
            assert set(dense) == {n for n, _ in trained.named_parameters()}
            # Counted before the lookups below, which create the rows of keys never trained.
            _, count_before = rows_and_count(client, np.empty(0, np.int64))
            probe = np.concatenate([keys, [VOCAB + 7]])  # and one key nobody trained
            before, _ = rows_and_count(client, probe)
            ebc_of(trained).close()
    finally:
        for s in shards:
            stop_shard(s)
    assert count_before["t_c0"] > 0 and count_before["t_c1"] > 0

    shards = cluster(3, tmp_path, checkpoints)
    try:
        with PSClient([s.address for s in shards]) as client:
            fresh = model(client, seed=1)
            assert not torch.equal(next(fresh.parameters()), next(iter(dense.values())))
            state = fresh.state_dict()
            dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
            fresh.load_state_dict(state)
            for n, p in fresh.named_parameters():
                torch.testing.assert_close(p, dense[n], rtol=0, atol=0, msg=n)
            _, count_after = rows_and_count(client, np.empty(0, np.int64))
            assert count_after == count_before  # every saved row, and no other
            after, _ = rows_and_count(client, probe)
            for t in before:
                np.testing.assert_array_equal(after[t], before[t])
            # Loaded rows train on: the optimizer state came with them.
            train(fresh, 2)
            ebc_of(fresh).close()
    finally:
        for s in shards:
            stop_shard(s)


def test_load_refuses_a_module_built_otherwise(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    shards = cluster(2, tmp_path, checkpoints)
    try:
        with PSClient([s.address for s in shards]) as client:
            saved = model(client, seed=0)
            train(saved, 1)
            torch.save(saved.state_dict(), tmp_path / "model.pt")
            state = torch.load(tmp_path / "model.pt", weights_only=False)
            saved_tables = state["sparse_arch.embedding_bag_collection._extra_state"]
            ebc = PSEmbeddingBagCollection(tables(), client, FUSED)
            with pytest.raises(ValueError, match="the state dict holds str, not a saved PS module's tables"):
                ebc.load_state_dict({"_extra_state": "nonsense"})
            sgd = PSEmbeddingBagCollection(
                [EmbeddingBagConfig(name="t_sgd", embedding_dim=DIM, num_embeddings=VOCAB, feature_names=["c0"])],
                client,
                {"optimizer": EmbOptimType.EXACT_SGD},
            )
            with pytest.raises(ValueError, match=r"holds tables \['t_c0', 't_c1'\], not \['t_sgd'\]"):
                sgd.load_state_dict({"_extra_state": saved_tables})
            renamed = copy.deepcopy(saved_tables)
            renamed.tables["t_sgd"] = renamed.tables["t_c0"]
            with pytest.raises(ValueError, match="table 't_sgd' was saved as"):
                sgd.load_state_dict({"_extra_state": renamed})
            sgd.close()
            # A checkpoint name no shard holds: the shard's error names the part it looked for.
            with pytest.raises(InvalidRequestError, match="part shard-00000-of-00002 is not under"):
                client.admin.load_checkpoint("no-such", 2, ["t_c0"])
            # Another shard count without every part under each root: it says what to do.
            with pytest.raises(InvalidRequestError, match="shard-00000-of-00003.*a --checkpoint-root all shards share"):
                client.admin.load_checkpoint("no-such", 3, ["t_c0"])
            ebc.close()
            ebc_of(saved).close()
    finally:
        for s in shards:
            stop_shard(s)


def test_torchrec_state_dict_loads_into_torchrec_ebc(tmp_path: Path) -> None:
    shards = [start_shard(i, 2, tmp_path) for i in range(2)]
    try:
        with PSClient([s.address for s in shards]) as client:
            trained = model(client, seed=0, fused={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
            train(trained, 3)
            ebc = ebc_of(trained)
            exported = ebc.torchrec_state_dict()
            assert sorted(exported) == ["embedding_bags.t_c0.weight", "embedding_bags.t_c1.weight"]
            local = EmbeddingBagCollection(copy.deepcopy(tables()))
            local.load_state_dict(exported)
            batch = next(
                iter(RandomRecDataset(KEYS, 64, hash_size=VOCAB, ids_per_feature=3, num_dense=4))
            ).sparse_features
            with torch.no_grad():
                torch.testing.assert_close(ebc(batch).values(), local(batch).values(), rtol=0, atol=0)
            prefixed = ebc.torchrec_state_dict("sparse_arch.embedding_bag_collection.")
            assert set(prefixed) == {f"sparse_arch.embedding_bag_collection.{k}" for k in exported}
            ebc.close()
    finally:
        for s in shards:
            stop_shard(s)
