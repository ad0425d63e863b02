"""TorchRec's DLRM with its embedding tables on parameter-server shards: one line changed.

The model, the data and the loop are TorchRec's: ``torchrec.models.dlrm.DLRM`` over 26 sparse
features, batches from ``torchrec.datasets.random.RandomRecDataset``, a torch optimizer on the
dense parameters. The one changed line builds ``PSEmbeddingBagCollection`` where TorchRec's
``EmbeddingBagCollection`` was; the tables then live on the shards, grow with the ids they see,
and train with the shards' row-wise Adagrad. The run ends with ``torch.distributed.checkpoint``
saving the dense model and the tables together; ``--resume`` loads that checkpoint into a new
cluster, of another size if ``--num-shards`` says so, and trains on.

    python examples/torchrec_dlrm.py                               # 2 local shards, 200 steps, saves
    python examples/torchrec_dlrm.py --resume --num-shards 3       # loads into 3 shards, trains on

Local shards share ``OUT/checkpoints`` as their checkpoint root (DCP's checkpoint refers to a
checkpoint the shards write there); ``--addresses`` trains against running shards instead.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagConfig
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.random import RandomRecDataset
from torchrec.models.dlrm import DLRM

from client import PSClient
from deploy import LocalCluster
from worker.torchrec import PSEmbeddingBagCollection


def train(args: argparse.Namespace, client: PSClient) -> None:
    tables = [
        EmbeddingBagConfig(name=f"t_{name}", embedding_dim=16, num_embeddings=args.hash_size, feature_names=[name])
        for name in DEFAULT_CAT_NAMES
    ]
    # ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))  # TorchRec, in this process
    ebc = PSEmbeddingBagCollection(
        tables, client, {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=[64, 16],
        over_arch_layer_sizes=[64, 32, 1],
    )
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    checkpoint = args.out / "dcp"
    if args.resume:
        state = model.state_dict()
        dcp.load(state, checkpoint_id=str(checkpoint))
        model.load_state_dict(state)
        print(f"loaded {checkpoint} into {client.num_shards} shards")
    data = iter(
        RandomRecDataset(
            keys=DEFAULT_CAT_NAMES,
            batch_size=args.batch_size,
            hash_size=args.hash_size,
            ids_per_feature=2,
            num_dense=len(DEFAULT_INT_NAMES),
            manual_seed=args.seed,
        )
    )
    loss_fn = torch.nn.BCEWithLogitsLoss()
    batch, start, recent = next(data), time.perf_counter(), []
    for step in range(1, args.steps + 1):
        following = next(data)
        ebc.prefetch(following.sparse_features)  # the next lookup runs while this step computes
        logits = model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = loss_fn(logits, batch.labels.float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        recent.append(loss.item())  # RandomRecDataset repeats its batches: the loss falls as they are learnt
        if step % 50 == 0 or step == args.steps:
            rate = step * args.batch_size / (time.perf_counter() - start)
            print(f"step {step}: loss {sum(recent) / len(recent):.4f}, {rate:,.0f} samples/s")
            recent = []
        batch = following
    dcp.save(model.state_dict(), checkpoint_id=str(checkpoint))
    rows = sum(t["rows"] for s in client.admin.stats() for t in s["tables"])
    print(f"saved {checkpoint}: the dense model, and {rows:,} rows as the shards' own checkpoint")
    ebc.close()


def main() -> None:
    # One process, no process group: DCP says it saves as a single process, which is the intent here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--hash-size", type=int, default=100_000, help="ids per feature drawn in [0, hash_size)")
    parser.add_argument("--num-shards", type=int, default=2, help="local shards to start")
    parser.add_argument("--addresses", default=None, help="running shards, comma-separated, in shard order")
    parser.add_argument(
        "--out", type=Path, default=Path("runs/torchrec_dlrm"), help="the DCP checkpoint and shard files"
    )
    parser.add_argument("--resume", action="store_true", help="load OUT/dcp first (any shard count)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out = args.out.absolute()
    if args.resume and not (args.out / "dcp").is_dir():
        parser.error(f"--resume: no checkpoint at {args.out / 'dcp'}; run once without --resume first")
    if args.addresses:
        with PSClient(args.addresses.split(",")) as client:
            train(args, client)
        return
    roots = ("--checkpoint-root", str(args.out / "checkpoints"))
    with LocalCluster(
        num_shards=args.num_shards, root=args.out / f"shards-{time.time_ns()}", extra_args=roots
    ) as cluster:
        print(f"started {args.num_shards} shards: {', '.join(cluster.addresses)}")
        with PSClient(cluster.addresses) as client:
            train(args, client)


if __name__ == "__main__":
    main()
