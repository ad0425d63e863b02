"""Train a recommendation model whose embeddings live on parameter-server shards.

The dense tower runs under ``DistributedDataParallel`` (gloo on CPU, nccl with CUDA);
each worker pushes its own sparse gradients to the shards. ``train(config, addresses)``
trains against running shards; ``python -m worker.trainer --addresses ...`` is its
command line (``ps-launch`` passes the addresses in ``TRAINER_ADDRESSES``). Starting
shards for a run is ``deploy``'s job: ``python -m deploy.train`` (what the examples
use) starts them on 127.0.0.1 when no addresses are given.

Note on scale: DDP averages dense gradients over workers, while each worker pushes the
sparse gradients of its own batch, so with W workers the shards take W updates per
step (as in PERSIA and HugeCTR); the sparse learning rate is per worker batch.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import itertools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from client import PSClient
from worker.config import EmbeddingTableConfig, FeatureConfig, parse_config
from worker.data import Batch, ColumnSchema, auc, logloss, read_click_log
from worker.embedding import DistributedEmbedding
from worker.models import DLRM, DeepFM
from worker.synthetic import synthetic_criteo

__all__ = ["Dist", "TrainerConfig", "evaluate", "init_distributed", "main", "parse", "report", "train"]

log = logging.getLogger(__name__)
ENV_PREFIX = "TRAINER_"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class TrainerConfig:
    """One training run (immutable; ``--help`` lists every field)."""

    addresses: tuple[str, ...] = field(
        default=(), metadata=_help("shard addresses in shard order, comma-separated; empty: start local shards")
    )
    num_shards: int = field(default=2, metadata=_help("shards to start when no addresses are given"))
    data: str = field(
        default="synthetic", metadata=_help("'synthetic' (Criteo-like, planted model) or a click-log path")
    )
    schema: str = field(default="criteo", metadata=_help("layout of a click-log file: criteo or avazu"))
    model: str = field(default="dlrm", metadata=_help("dlrm or deepfm"))
    dim: int = field(default=16, metadata=_help("embedding dim of every table"))
    batch_size: int = field(default=1024, metadata=_help("samples per step per worker"))
    train_samples: int = field(default=200_000, metadata=_help("synthetic samples to train on (all workers together)"))
    eval_samples: int = field(default=20_000, metadata=_help("synthetic samples to evaluate on"))
    train_fraction: float = field(
        default=0.8, metadata=_help("click-log files: the first fraction trains, the rest evaluates")
    )
    epochs: int = field(default=1, metadata=_help("passes over the training data"))
    sparse_optimizer: str = field(
        default="adagrad", metadata=_help("optimizer the shards run: sgd, adagrad, adam, ftrl")
    )
    sparse_lr: float = field(default=0.1, metadata=_help("learning rate of the sparse optimizer"))
    dense_lr: float = field(default=2e-3, metadata=_help("Adam learning rate of the dense tower"))
    mode: str = field(default="pipelined", metadata=_help("pipelined (lookups ahead, async pushes) or sync (exact)"))
    staleness: int = field(default=1, metadata=_help("pipelined mode: steps a looked-up row may lag behind"))
    eval_every: int = field(default=0, metadata=_help("evaluate every N steps (0: only at the end)"))
    output_dir: Path = field(default=Path("runs/latest"), metadata=_help("where the dense model and manifest go"))
    seed: int = field(default=0, metadata=_help("seed of data order and dense initialisation"))
    progress: bool = field(default=True, metadata=_help("show a progress bar on rank 0"))
    log_level: str = field(default="INFO", metadata=_help("DEBUG, INFO, WARNING or ERROR"))

    def __post_init__(self) -> None:
        checks = [
            (self.model in ("dlrm", "deepfm"), f"model={self.model!r}: expected dlrm or deepfm"),
            (self.mode in ("sync", "pipelined"), f"mode={self.mode!r}: expected sync or pipelined"),
            (self.schema in ("criteo", "avazu"), f"schema={self.schema!r}: expected criteo or avazu"),
            (self.dim >= 1 and self.batch_size >= 1 and self.epochs >= 1, "dim, batch_size and epochs must be >= 1"),
            (self.num_shards >= 1, f"num_shards={self.num_shards}: must be >= 1"),
            (0 < self.train_fraction < 1, f"train_fraction={self.train_fraction}: must be in (0, 1)"),
            (
                self.data == "synthetic" or Path(self.data).is_file(),
                f"data={self.data!r}: not 'synthetic' and no such file",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass
class Dist:
    """This process's place in the job: rank, world size, and the device it trains on."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def init_distributed() -> Dist:
    """Join the torchrun job (gloo on CPU, nccl with CUDA) if there is one; idempotent."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world == 1:
        return Dist(device=torch.device("cuda") if cuda else torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return Dist(dist.get_rank(), world, device)


def _data(config: TrainerConfig, d: Dist) -> tuple[Iterator[Batch], list[Batch], int]:
    """(training batches of this worker, evaluation batches, training samples of all workers)."""
    if config.data == "synthetic":
        # Every worker takes the same number of steps, or DDP's allreduce would wait forever.
        steps = math.ceil(config.train_samples / config.batch_size) // d.world
        train: Iterator[Batch] = itertools.chain.from_iterable(
            itertools.islice(synthetic_criteo(config.train_samples, config.batch_size, seed=config.seed + 1000 * e,
                                              rank=d.rank, world_size=d.world), steps)
            for e in range(config.epochs))  # fmt: skip
        held_out = list(synthetic_criteo(config.eval_samples, config.batch_size, seed=config.seed + 7_777_777))
        return train, held_out, steps * d.world * config.batch_size * config.epochs
    schema = ColumnSchema.criteo() if config.schema == "criteo" else ColumnSchema.avazu()
    rows = _count_lines(Path(config.data)) - (1 if schema.header else 0)
    n_train = int(rows * config.train_fraction)
    steps = math.ceil(n_train / config.batch_size) // d.world  # equal on every worker (see above)

    def mine() -> Iterator[Batch]:
        for _ in range(config.epochs):
            batches = read_click_log(config.data, schema, config.batch_size, limit=n_train)
            yield from itertools.islice(itertools.islice(batches, d.rank, None, d.world), steps)

    held_out = list(read_click_log(config.data, schema, config.batch_size, skip=n_train))
    return mine(), held_out, min(n_train, steps * d.world * config.batch_size) * config.epochs


def _count_lines(path: Path) -> int:
    count, last = 0, b"\n"
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def evaluate(
    emb: DistributedEmbedding, model: torch.nn.Module, batches: Sequence[Batch], device: torch.device
) -> dict[str, float]:
    """AUC and logloss of ``model`` on ``batches`` (no pushes; rows as the shards hold them now)."""
    emb.eval()
    model.eval()
    labels, probs = [], []
    with torch.no_grad():
        for b in batches:
            logits = model(b.dense.to(device), emb(b.sparse))
            labels.append(b.labels)
            probs.append(torch.sigmoid(logits).cpu())
    emb.train()
    model.train()
    y, p = torch.cat(labels), torch.cat(probs)
    return {"auc": auc(y, p), "logloss": logloss(y, p), "samples": float(len(y))}


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.state_dict().values():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(config: TrainerConfig, addresses: Sequence[str], d: Dist | None = None) -> dict[str, Any]:
    """Train ``config`` on the cluster at ``addresses``; returns the metrics (also written to ``output_dir``).

    Raises the client's ``PSError`` subclasses if the shards fail, ``ValueError`` for
    bad data. Blocks until done; collective across all workers under ``torchrun``
    (``d`` from ``init_distributed()``; the caller owns the process group).
    """
    d = d or init_distributed()
    torch.manual_seed(config.seed)
    train_batches, held_out, total = _data(config, d)
    first = next(train_batches, None)
    if first is None:
        raise ValueError(f"no training steps: {total} samples in batches of {config.batch_size} over {d.world} workers")
    features = list(first.sparse)
    num_dense = first.dense.shape[1]
    tables = [EmbeddingTableConfig(f, config.dim, config.sparse_optimizer, seed=i, params={"lr": config.sparse_lr})
              for i, f in enumerate(features)]  # fmt: skip
    feature_cfgs = [FeatureConfig(f, f) for f in features]
    model: torch.nn.Module = (DLRM if config.model == "dlrm" else DeepFM)(num_dense, features, config.dim).to(d.device)
    metrics: dict[str, Any] = {"config": {k: str(v) for k, v in dataclasses.asdict(config).items()}, "evals": []}

    with PSClient(addresses) as client:
        emb = DistributedEmbedding(tables, feature_cfgs, client, mode=config.mode,  # type: ignore[arg-type]
                                   staleness=config.staleness, device=d.device)  # fmt: skip
        try:
            if d.rank == 0:
                emb.create_tables()
            if d.world > 1:
                dist.barrier()
            metrics.update(_loop(config, d, emb, model, first, train_batches, held_out, total, metrics["evals"]))
            final = evaluate(emb, model, held_out, d.device) if d.rank == 0 else {}
        finally:
            emb.close()
        digests: list[Any] = [_digest(model)] * d.world
        if d.world > 1:
            dist.all_gather_object(digests, _digest(model))
        shard_stats = client.stats() if d.rank == 0 else []
    metrics.update(final=final, dense_digests=digests)
    if d.rank == 0:
        _save(config, model, tables, feature_cfgs, num_dense, list(addresses), shard_stats, metrics)
        log.info("final AUC %.4f logloss %.4f (%d eval samples), %.0f samples/s",
                 final["auc"], final["logloss"], final["samples"], metrics["samples_per_s"])  # fmt: skip
    return metrics


def _loop(config: TrainerConfig, d: Dist, emb: DistributedEmbedding, model: torch.nn.Module, first: Batch,
          rest: Iterator[Batch], held_out: list[Batch], total: int, evals: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The training steps: prefetch the next batch, forward, backward (pushes), dense step."""
    dense = DistributedDataParallel(model) if d.world > 1 else model
    optimizer = torch.optim.Adam(model.parameters(), lr=config.dense_lr)
    phases = dict.fromkeys(("data", "lookup", "forward", "backward", "step", "eval"), 0.0)
    bar = _progress(config, d, math.ceil(total / (config.batch_size * d.world)))
    started = time.perf_counter()
    cur: Batch | None = first
    emb.prefetch(first.sparse)
    step, samples, losses = 0, 0, []
    while cur is not None:
        t0 = time.perf_counter()
        nxt = next(rest, None)
        t1 = time.perf_counter()
        if nxt is not None:
            emb.prefetch(nxt.sparse)
        out = emb(cur.sparse)
        t2 = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(dense(cur.dense.to(d.device), out), cur.labels.to(d.device))
        t3 = time.perf_counter()
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        t4 = time.perf_counter()
        optimizer.step()
        t5 = time.perf_counter()
        for k, a, b in zip(
            ("data", "lookup", "forward", "backward", "step"), (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)
        ):
            phases[k] += b - a
        step += 1
        samples += cur.batch_size
        losses.append(float(loss.detach()))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}",
                            samples_s=f"{samples * d.world / (time.perf_counter() - started):,.0f}")  # fmt: skip
        if config.eval_every and step % config.eval_every == 0 and d.rank == 0:
            t6 = time.perf_counter()
            evals.append({"step": step, **evaluate(emb, model, held_out, d.device)})
            phases["eval"] += time.perf_counter() - t6
        cur = nxt
    emb.flush()
    train_s = time.perf_counter() - started - phases["eval"]
    if bar is not None:
        bar.close()
    # DDP's reducer keeps gloo/nccl work objects alive in reference cycles; if they are
    # only collected at interpreter exit, gloo's threads can abort the process.
    del dense, optimizer
    gc.collect()
    return {"steps": step, "worker_samples": samples, "train_s": train_s, "samples_per_s": samples * d.world / train_s,
            "phases_s": phases, "mean_loss_last_20": sum(losses[-20:]) / max(1, len(losses[-20:]))}  # fmt: skip


def _progress(config: TrainerConfig, d: Dist, total: int) -> Any:
    if d.rank != 0 or not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)


def _save(config: TrainerConfig, model: torch.nn.Module, tables: list[EmbeddingTableConfig],
          features: list[FeatureConfig], num_dense: int, addresses: list[str], shard_stats: list[dict[str, Any]],
          metrics: dict[str, Any]) -> None:  # fmt: skip
    out = config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out / "dense.pt")
    manifest = {
        "model": config.model, "dim": config.dim, "num_dense": num_dense, "num_shards": len(addresses),
        "tables": [dataclasses.asdict(t) | {"params": dict(t.params)} for t in tables],
        "features": [dataclasses.asdict(f) for f in features],
        "shard_rows": [sum(t["rows"] for t in s["tables"]) for s in shard_stats],
    }  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))


def parse(argv: Sequence[str] | None = None) -> TrainerConfig:
    """The ``TrainerConfig`` from flags, ``TRAINER_*`` variables and ``--config``; exits 2 on a bad setting."""
    try:
        config = parse_config(TrainerConfig, sys.argv[1:] if argv is None else argv, os.environ, ENV_PREFIX, "trainer")
    except ValueError as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(level=config.log_level.upper(), format="ts=%(asctime)s level=%(levelname)s rank=" +
                        os.environ.get("RANK", "0") + " logger=%(name)s msg=%(message)s")  # fmt: skip
    if int(os.environ.get("RANK", "0")) == 0:
        log.info("config %s", " ".join(f"{k}={v}" for k, v in dataclasses.asdict(config).items()))
    return config


def report(metrics: dict[str, Any]) -> None:
    """Print the final line: AUC, logloss, throughput (rank 0 only has the final metrics)."""
    if metrics.get("final"):
        f = metrics["final"]
        print(f"AUC {f['auc']:.4f}  logloss {f['logloss']:.4f}  ({int(f['samples'])} held-out samples, "
              f"{metrics['samples_per_s']:,.0f} samples/s)")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m worker.trainer``: train against running shards (``--addresses`` or ``TRAINER_ADDRESSES``).

    To have the shards started for you, use ``python -m deploy.train`` (or the examples).
    """
    config = parse(argv)
    if not config.addresses:
        print("trainer: no shard addresses: pass --addresses (ps-launch sets TRAINER_ADDRESSES), "
              "or run `python -m deploy.train`, which starts local shards", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    d = init_distributed()
    try:
        metrics = train(config, config.addresses, d)
    finally:
        if d.world > 1:
            dist.destroy_process_group()
    report(metrics)
    return metrics


if __name__ == "__main__":
    main()
