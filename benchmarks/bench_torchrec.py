"""TorchRec's DLRM on the shards (``PSEmbeddingBagCollection``) against the same DLRM on TorchRec's
fused in-process module; and DCP checkpoints of N shards loaded into M.

1. Throughput. ``torchrec.models.dlrm.DLRM`` (26 Criteo-like sparse features, dim 16, 13 dense,
   batch 4096, Zipf(1.05) ids below each table's size, as ``bench_training.py`` makes them),
   trained with row-wise Adagrad on the tables and Adam on the dense tower, two ways on the same
   batches and cores:
   - ``ours``: ``PSEmbeddingBagCollection`` over 2 local shards, pipelined (the next KJT's lookup
     prefetched while this step computes), torch at the trainer's thread count beside its shards;
   - ``TorchRec``: ``FusedEmbeddingBagCollection`` with FBGEMM's CPU ``EXACT_ROWWISE_ADAGRAD``
     fused into backward, torch's default threads;
   - the floor: the same DLRM fed ready pooled values (no embedding work at all) at ours' thread
     count: what ours would reach if the embeddings cost nothing.
   Warm-up, then interleaved rounds (each waits for other processes to go quiet); the headline is
   the median round. Samples per CPU-second counts every process (the worker and both shards).
   Goals: >= 0.85x TorchRec's samples/s and >= 1.0x its samples per CPU-second.
2. DCP. A table of ``--dcp-rows`` rows (1M) on 2 shards sharing a checkpoint root is saved with
   ``torch.distributed.checkpoint`` as part of a model's state dict, then loaded into a new
   cluster of 3 shards; every row is compared bit for bit. The save is timed beside the shards'
   own checkpoint (``AdminClient.checkpoint``) of the same rows, the load beside ``dcp.load``'s
   reading of the small files.

Usage: ``python benchmarks/bench_torchrec.py [--quick] [--dcp-rows N]``
-> ``benchmarks/results/torchrec.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout
sys.path.insert(1, str(Path(__file__).resolve().parent))

from bench_training import FEATURES, NUM_DENSE, ROWS, git_state, load_torchrec, prepare, proc_cpu_s, wait_quiet  # noqa: E402
from training_report import BATCH, DIM, QUIET_CORES  # noqa: E402

from client import PSClient  # noqa: E402
from deploy.local import LocalCluster, threads_beside_local_shards  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SPARSE_LR, DENSE_LR = 0.05, 1e-3
GOAL, CPU_GOAL = 0.85, 1.0


@dataclass
class Run:
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    prefetch: Callable[[Any], None]
    finish: Callable[[], None]
    threads: int
    rounds: list[dict[str, float]] = field(default_factory=list)


def dlrm(torchrec: Any, ebc: Any) -> torch.nn.Module:
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(0)
    return DLRM(ebc, dense_in_features=NUM_DENSE, dense_arch_layer_sizes=[128, DIM], over_arch_layer_sizes=[128, 64, 1])


def configs(torchrec: Any) -> list[Any]:
    return [
        torchrec.EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=r, feature_names=[f])
        for f, r in zip(FEATURES, ROWS)
    ]


class _Ready(torch.nn.Module):
    """An embedding module that does no embedding work: one set of pooled values, their gradient
    computed and dropped (the floor: the dense tower alone)."""

    def __init__(self, torchrec: Any) -> None:
        super().__init__()
        self.configs = configs(torchrec)
        self.values = torch.randn(BATCH, DIM * len(FEATURES), requires_grad=True)
        self.keyed = torchrec.KeyedTensor

    def embedding_bag_configs(self) -> list[Any]:
        return self.configs

    def forward(self, kjt: Any) -> Any:
        self.values.grad = None
        return self.keyed(keys=FEATURES, length_per_key=[DIM] * len(FEATURES), values=self.values)


def run_round(r: Run, batches: list[Any], pids: list[int] | None) -> None:
    default = torch.get_num_threads()
    torch.set_num_threads(r.threads)
    cpu0, shards0 = time.process_time(), sum(proc_cpu_s(p) for p in (pids or [])[1:])
    t0 = time.perf_counter()
    r.prefetch(batches[0].kjt)
    for i, p in enumerate(batches):
        if i + 1 < len(batches):
            r.prefetch(batches[i + 1].kjt)
        logits = r.model(p.batch.dense, p.kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, p.batch.labels)
        r.optimizer.zero_grad()
        loss.backward()
        r.optimizer.step()
    r.finish()
    wall = time.perf_counter() - t0
    torch.set_num_threads(default)
    if pids is not None:
        cpu = time.process_time() - cpu0 + sum(proc_cpu_s(p) for p in pids[1:]) - shards0
        r.rounds.append({"samples_per_s": len(batches) * BATCH / wall, "samples_per_cpu_s": len(batches) * BATCH / cpu})


def throughput(torchrec: Any, quick: bool) -> dict[str, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    from worker.torchrec import PSEmbeddingBagCollection

    rounds, per_round, warmup = (3, 10, 5) if quick else (5, 40, 10)
    batches, _ = prepare(warmup + rounds * per_round, torchrec)
    with LocalCluster(2) as cluster, PSClient(cluster.addresses) as client:
        ebc = PSEmbeddingBagCollection(
            configs(torchrec), client, {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": SPARSE_LR}
        )
        ours_model = dlrm(torchrec, ebc)
        fused = FusedEmbeddingBagCollection(
            configs(torchrec), RowWiseAdagrad, {"lr": SPARSE_LR}, device=torch.device("cpu")
        )
        theirs_model = dlrm(torchrec, fused)
        floor_model = dlrm(torchrec, _Ready(torchrec))
        runs = [
            Run(
                "ours: PSEmbeddingBagCollection, 2 shards, pipelined",
                ours_model,
                torch.optim.Adam(ours_model.parameters(), lr=DENSE_LR),
                ebc.prefetch,
                ebc.flush,
                threads_beside_local_shards(),
            ),
            Run(
                f"ours, {torch.get_num_threads()} threads (torch default)",
                ours_model,
                torch.optim.Adam(ours_model.parameters(), lr=DENSE_LR),
                ebc.prefetch,
                ebc.flush,
                torch.get_num_threads(),
            ),
            Run(
                f"floor: the dense tower alone, {threads_beside_local_shards()} thread(s)",
                floor_model,
                torch.optim.Adam(floor_model.parameters(), lr=DENSE_LR),
                lambda kjt: None,
                lambda: None,
                threads_beside_local_shards(),
            ),
            Run(
                "TorchRec: FusedEmbeddingBagCollection (FBGEMM CPU)",
                theirs_model,
                torch.optim.Adam(
                    [p for n, p in theirs_model.named_parameters() if "embedding_bags" not in n], lr=DENSE_LR
                ),
                lambda kjt: None,
                lambda: None,
                torch.get_num_threads(),
            ),
        ]
        for r in runs:
            print(f"warming up {r.name} ...", file=sys.stderr)
            run_round(r, batches[:warmup], None)
        pids = [os.getpid(), *(s.proc.pid for s in cluster.shards)]
        budget = [60.0]
        for i in range(rounds):
            for r in runs if i % 2 == 0 else runs[::-1]:
                others = wait_quiet(pids, budget)
                run_round(r, batches[warmup + i * per_round : warmup + (i + 1) * per_round], pids)
                r.rounds[-1]["others_cores"] = others
                print(f"round {i + 1} {r.name}: {r.rounds[-1]['samples_per_s']:,.0f} samples/s", file=sys.stderr)
        ebc.close()
    out: dict[str, Any] = {}
    for r in runs:
        clean = [x for x in r.rounds if x["others_cores"] < QUIET_CORES] or r.rounds
        out[r.name] = {
            "samples_per_s": statistics.median(x["samples_per_s"] for x in clean),
            "samples_per_cpu_s": statistics.median(x["samples_per_cpu_s"] for x in clean),
            "rounds": r.rounds,
            "threads": r.threads,
        }
    ours, theirs = out[runs[0].name], out[runs[-1].name]
    return {
        "variants": out,
        "ratio": ours["samples_per_s"] / theirs["samples_per_s"],
        "floor_ratio": out[runs[2].name]["samples_per_s"] / theirs["samples_per_s"],
        "cpu_ratio": ours["samples_per_cpu_s"] / theirs["samples_per_cpu_s"],
        "steps_per_round": per_round,
        "rounds": rounds,
    }


def dcp_n_to_m(torchrec: Any, rows: int, tmp: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from worker.torchrec import PSEmbeddingBagCollection

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    config = [torchrec.EmbeddingBagConfig(name="big", embedding_dim=DIM, num_embeddings=rows, feature_names=["f"])]
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": SPARSE_LR}
    roots = ("--checkpoint-root", str(tmp / "checkpoints"))
    keys = np.arange(rows, dtype=np.int64)
    with LocalCluster(2, root=tmp / "two", extra_args=roots) as cluster, PSClient(cluster.addresses) as client:
        module = torch.nn.ModuleDict(
            {"ebc": PSEmbeddingBagCollection(config, client, fused), "head": torch.nn.Linear(DIM, 1)}
        )
        step = 1 << 16
        for lo in range(0, rows, step):  # every row created and pushed once: values and state both non-initial
            part = keys[lo : lo + step]
            client.push_many({"big": (part, np.ones((part.size, DIM), np.float32))})
        before = client.lookup_many({"big": keys})["big"]
        t0 = time.perf_counter()
        client.admin.checkpoint()
        own_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        dcp.save(module.state_dict(), checkpoint_id=str(tmp / "dcp"))
        save_s = time.perf_counter() - t0
        module["ebc"].close()
    with LocalCluster(3, root=tmp / "three", extra_args=roots) as cluster, PSClient(cluster.addresses) as client:
        module = torch.nn.ModuleDict(
            {"ebc": PSEmbeddingBagCollection(config, client, fused), "head": torch.nn.Linear(DIM, 1)}
        )
        state = module.state_dict()
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=str(tmp / "dcp"))
        read_s = time.perf_counter() - t0
        module.load_state_dict(state)
        load_s = time.perf_counter() - t0
        after = client.lookup_many({"big": keys})["big"]
        counted = sum(t["rows"] for s in client.admin.stats() for t in s["tables"])
        module["ebc"].close()
    return {
        "rows": rows,
        "bit_equal": bool(np.array_equal(before.view(np.uint32), after.view(np.uint32))),
        "rows_after": counted,
        "shards_own_checkpoint_s": own_s,
        "dcp_save_s": save_s,
        "dcp_load_s": load_s,
        "dcp_read_s": read_s,
    }


def report(res: dict[str, Any]) -> str:
    t = res["throughput"]
    lines = [f"TorchRec DLRM, batch {BATCH}, 26 tables dim {DIM}, row-wise Adagrad; median of clean rounds"]
    lines.append(f"{'variant':<54}{'samples/s':>11}{'per CPU-s':>11}{'threads':>8}")
    for name, v in t["variants"].items():
        lines.append(f"{name:<54}{v['samples_per_s']:>11,.0f}{v['samples_per_cpu_s']:>11,.0f}{v['threads']:>8}")
    ok = lambda x, g: "ok" if x >= g else "MISSED"  # noqa: E731
    lines.append(
        f"ours vs TorchRec: {t['ratio']:.2f}x samples/s (goal >= {GOAL}: {ok(t['ratio'], GOAL)}), "
        f"{t['cpu_ratio']:.2f}x per CPU-second (goal >= {CPU_GOAL}: {ok(t['cpu_ratio'], CPU_GOAL)}); "
        f"floor (no embedding work, ours' threads) {t['floor_ratio']:.2f}x"
    )
    d = res["dcp"]
    lines += [
        "",
        f"DCP, {d['rows']:,} rows dim {DIM}: saved from 2 shards, loaded into 3",
        f"every row bit-equal: {d['bit_equal']}; rows in the 3 shards: {d['rows_after']:,}",
        f"save {d['dcp_save_s']:.2f} s (the shards' own checkpoint of the same rows: {d['shards_own_checkpoint_s']:.2f} s)",
        f"load {d['dcp_load_s']:.2f} s (of which dcp.load reading the files: {d['dcp_read_s']:.3f} s)",
    ]
    return "\n".join(lines)


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    v = res["throughput"]["variants"]
    names = [n.split(":")[0] for n in v]
    a.bar(names, [x["samples_per_s"] for x in v.values()], color=["tab:blue", "gray"])
    a.set_ylabel("samples/s (TorchRec DLRM, 2 cores)")
    a.set_title(f"ours {res['throughput']['ratio']:.2f}x, {res['throughput']['cpu_ratio']:.2f}x per CPU-s")
    d = res["dcp"]
    b.bar(
        ["shards' checkpoint", "DCP save", "DCP load (3 shards)"],
        [d["shards_own_checkpoint_s"], d["dcp_save_s"], d["dcp_load_s"]],
    )
    b.set_ylabel("seconds")
    b.set_title(f"{d['rows']:,} rows, 2 -> 3 shards, bit-equal: {d['bit_equal']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps, 100K DCP rows")
    parser.add_argument("--dcp-rows", type=int, default=None, help="rows of the DCP part (default 1M, quick 100K)")
    args = parser.parse_args()
    torchrec, status = load_torchrec()
    if torchrec is None:
        raise SystemExit(f"TorchRec is not installed ({status}): the README's set-up line installs it")
    t0 = time.perf_counter()
    res: dict[str, Any] = {"torchrec": status, "git": git_state(), "nproc": len(os.sched_getaffinity(0))}
    res["throughput"] = throughput(torchrec, args.quick)
    with tempfile.TemporaryDirectory(prefix="bench-torchrec-") as tmp:
        res["dcp"] = dcp_n_to_m(torchrec, args.dcp_rows or (100_000 if args.quick else 1_000_000), Path(tmp))
    res["wall_s"] = time.perf_counter() - t0
    print(report(res))
    RESULTS.mkdir(exist_ok=True)
    name = "torchrec-quick" if args.quick else "torchrec"
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    try:
        chart(res, RESULTS / f"{name}.png")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG chart written")


if __name__ == "__main__":
    main()
