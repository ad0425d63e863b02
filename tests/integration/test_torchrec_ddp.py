"""Two workers under ``torch.distributed`` (gloo), each a TorchRec DLRM on ``PSEmbeddingBagCollection``
with its dense part in ``DistributedDataParallel``, saving one DCP checkpoint together; a single
process loads it into 3 shards. The shards write one checkpoint of their own, not one per rank, and
every row comes back bit-equal. Skipped where TorchRec is not installed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

torchrec = pytest.importorskip("torchrec", reason="TorchRec not installed (the README's set-up line installs it)")

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec import EmbeddingBagConfig  # noqa: E402
from torchrec.datasets.random import RandomRecDataset  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402

from client import PSClient  # noqa: E402
from tests.integration.shards import start_shard, stop_shard  # noqa: E402
from worker.torchrec import PSEmbeddingBagCollection  # noqa: E402

KEYS, VOCAB, DIM, WORKERS = ["c0", "c1"], 400, 8, 2


def build(client: PSClient) -> DLRM:
    tables = [
        EmbeddingBagConfig(name=f"t_{k}", embedding_dim=DIM, num_embeddings=VOCAB, feature_names=[k]) for k in KEYS
    ]
    ebc = PSEmbeddingBagCollection(
        tables, client, {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    )
    torch.manual_seed(0)
    return DLRM(ebc, dense_in_features=4, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])


def worker(rank: int, addresses: list[str], store: str, checkpoint: str) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORKERS)
    torch.set_num_threads(1)
    with PSClient(addresses) as client:
        model = build(client)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adagrad(ddp.parameters(), lr=0.05)
        data = iter(RandomRecDataset(KEYS, 64, hash_size=VOCAB, ids_per_feature=2, num_dense=4, manual_seed=rank))
        for _ in range(5):
            b = next(data)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                ddp(b.dense_features, b.sparse_features).squeeze(-1), b.labels.float()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        dcp.save(model.state_dict(), checkpoint_id=checkpoint)
        model.sparse_arch.embedding_bag_collection.close()
    dist.destroy_process_group()


def test_two_workers_save_one_checkpoint_that_loads_into_three_shards(tmp_path: Path) -> None:
    roots = ("--checkpoint-root", str(tmp_path / "checkpoints"))
    keys = np.arange(VOCAB, dtype=np.int64)
    checkpoint = str(tmp_path / "dcp")
    shards = [start_shard(i, 2, tmp_path / "two", *roots) for i in range(2)]
    try:
        addresses = [s.address for s in shards]
        mp.start_processes(
            worker, args=(addresses, str(tmp_path / "store"), checkpoint), nprocs=WORKERS, start_method="spawn"
        )
        with PSClient(addresses) as client:
            rows = sum(t["rows"] for s in client.admin.stats() for t in s["tables"])
            before = client.lookup_many({f"t_{k}": keys for k in KEYS})
    finally:
        for s in shards:
            stop_shard(s)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["000001"]  # one, for both ranks

    shards = [start_shard(i, 3, tmp_path / "three", *roots) for i in range(3)]
    try:
        with PSClient([s.address for s in shards]) as client:
            model = build(client)
            state = model.state_dict()
            dcp.load(state, checkpoint_id=checkpoint)
            model.load_state_dict(state)
            assert sum(t["rows"] for s in client.admin.stats() for t in s["tables"]) == rows
            after = client.lookup_many({f"t_{k}": keys for k in KEYS})
            model.sparse_arch.embedding_bag_collection.close()
    finally:
        for s in shards:
            stop_shard(s)
    for t in before:
        np.testing.assert_array_equal(after[t], before[t])
