"""Training-throughput benchmark: DLRM with its embeddings on the shards vs. embeddings in the worker.

Does training through the parameter server keep up with keeping the tables in the worker? The
goals: ours, pipelined, reaches >= 0.8x the samples/s of the faster in-process baseline, and
>= 0.9x its samples per CPU-second (all processes: the worker and both shards).
Every variant trains the same model on the same pre-generated batches: 26 sparse features (one
table each, dim 16, Zipf(1.05) keys over Criteo's vocab sizes), 13 dense ones, batch 4096,
``worker.models.DLRM(13, features, 16)`` with its default MLPs; dense Adam lr 1e-3, sparse
Adagrad lr 0.05. Variants:
1. Ours: 2 ``python -m ps`` shards (``LocalCluster(2)``) + this process as the worker, through
   ``DistributedEmbedding`` in ``mode="pipelined"`` (``prefetch(next)`` before ``forward(cur)``,
   the loop of ``worker/trainer.py``), and in ``mode="sync"``; and pipelined with torch limited to 1
   intra-op thread, leaving a core to the client's threads and the shards (for information; the
   goal is judged on the default). Also: the shards' counters per step
   (``AdminClient.stats()``), their CPU time (``/proc/<pid>/stat``) and the wall time of the client's
   ``lookup_many``/``push_many`` calls (they run on the pipeline's background threads).
2. (a) In-process: 26 ``nn.EmbeddingBag(min(vocab, 1M), 16, mode="sum", sparse=True)`` (key %
   rows: collisions do not matter for throughput) + ``torch.optim.Adagrad`` on the sparse grads.
3. (b) TorchRec, if it imports: ``FusedEmbeddingBagCollection`` (fbgemm's CPU TBE kernel with the
   ``EXACT_ADAGRAD`` update fused into backward) fed a ``KeyedJaggedTensor``.
4. The floor: the dense tower alone, at ours' thread count, fed ready pooled tensors (their
   gradients computed, as ours needs): what ours would reach if the embeddings cost nothing.
The batches (and the ids/KJTs of the baselines) are made before timing, so data generation does
not dominate; its cost per batch is reported separately, since the trainer does it inline. Each
variant warms up, then runs ``--steps`` steps in 5 interleaved rounds (3 with ``--quick``); a
round's wall time includes its first lookup and the final ``flush()`` of pushes. The cores are
shared with other jobs: before each round we wait (a bounded time) for other processes to go
quiet and record the cores they used during it (``/proc/stat`` minus our processes); rounds where
they used >= 0.2 cores are left out (and a round stops after 8 s, 4 s with ``--quick``: contention
can slow one down 50x); the headline is the median clean round. Samples per
CPU-second (our processes' CPU, spin-waiting OpenMP threads included) says what a sample costs.
TorchRec comes with the dev set-up (the ``torchrec`` extra, FBGEMM's CPU build through
``./deploy/fbgemm-gpu-cpu``; see the README); without it that variant is skipped.
On a machine with more cores, ``--worker-cpus 0-1 --shard-cpus 2-5`` pins this process (every
variant, TorchRec's included, and torch's threads, which default to the worker's cores) and the
shards to CPUs of their own: the deployment a parameter server exists for, shards beside the worker.
Usage: ``python benchmarks/bench_training.py [--quick] [--steps N] [--worker-cpus L --shard-cpus L]``
-> ``benchmarks/results/training.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout
sys.path.insert(1, str(Path(__file__).resolve().parent))  # training_report, beside this file

from training_report import (  # noqa: E402
    BATCH,
    COMPACT,
    COMPACT_GOAL,
    CPU_GOAL,
    DIM,
    FLOOR,
    GOAL,
    PHASES,
    QUIET_CORES,
    SHARDS,
    chart,
    report,
)

from client import ClientConfig, PSClient  # noqa: E402
from deploy.local import LocalCluster, threads_beside_local_shards  # noqa: E402
from worker.config import EmbeddingTableConfig, FeatureConfig  # noqa: E402
from worker.data import Batch  # noqa: E402
from worker.embedding import DistributedEmbedding  # noqa: E402
from worker.models import DLRM  # noqa: E402
from worker.synthetic import CRITEO_VOCAB_SIZES, synthetic_criteo  # noqa: E402
from worker.trainer import dense_adam  # noqa: E402

NUM_DENSE, ZIPF, MAX_ROWS = 13, 1.05, 1_000_000
DENSE_LR, SPARSE_LR = 1e-3, 0.05
FEATURES = [f"C{i + 1}" for i in range(len(CRITEO_VOCAB_SIZES))]
ROWS = [min(v, MAX_ROWS) for v in CRITEO_VOCAB_SIZES]
RESULTS = REPO / "benchmarks" / "results"
Pooled = dict[str, torch.Tensor]
Counters = dict[str, float]


@dataclass(frozen=True)
class Prepared:
    """One batch as every variant takes it: ours the keys, the baselines ``key % rows`` (and a KJT)."""

    batch: Batch
    local_ids: list[torch.Tensor]  # per feature, views into one [26 * B] tensor
    offsets: torch.Tensor  # arange(B): one id per sample
    kjt: Any  # torchrec.KeyedJaggedTensor, or None without torchrec


@dataclass
class Variant:
    """A way to embed a batch, plus the dense tower and optimizers it trains with; totals of its timed rounds."""

    name: str
    embed: Callable[[Prepared], Pooled]
    model: DLRM
    optimizers: list[torch.optim.Optimizer]
    prefetch: Callable[[Prepared], None] = lambda p: None
    finish: Callable[[], None] = lambda: None
    probe: Callable[[], Counters] = dict  # cumulative counters, read around each timed round
    threads: int | None = None  # torch intra-op threads for this variant (None: torch's default)
    rounds: list[dict[str, Any]] = field(default_factory=list)  # timed rounds: times, phases, probe() deltas


def proc_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15 of proc(5)


def busy_cpu_s() -> float:
    """CPU seconds the whole machine spent not idle (all processes, ours and others')."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def wait_quiet(pids: list[int], budget: list[float], window_s: float = 0.5) -> float:
    """Wait (out of ``budget[0]`` seconds) until other processes use < 0.2 cores; returns the cores they used."""
    while True:
        ours0, busy0, t0 = sum(map(proc_cpu_s, pids)), busy_cpu_s(), time.perf_counter()
        time.sleep(window_s)
        wall = time.perf_counter() - t0
        others = max(0.0, busy_cpu_s() - busy0 - sum(map(proc_cpu_s, pids)) + ours0) / wall
        if others < QUIET_CORES or budget[0] <= 0:
            return others
        budget[0] -= wall


def git_state() -> dict[str, Any]:
    """The commit measured, and the files changed on top of it (the working tree is what runs)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "changed": git("status", "--porcelain").splitlines()}


def load_torchrec() -> tuple[ModuleType | None, str]:
    """(torchrec, how it was loaded) or (None, the exact import error)."""
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # torchrec's import warns via fx
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fbgemm_gpu
            import torchrec
            import torchrec.modules.fused_embedding_modules
    except Exception as exc:  # noqa: BLE001 - any failure to load means: skip, and say why
        return None, f"{type(exc).__name__}: {exc}"
    return torchrec, f"torchrec {torchrec.__version__}, fbgemm_gpu {fbgemm_gpu.__version__}"


def prepare(n: int, torchrec: ModuleType | None) -> tuple[list[Prepared], float]:
    """``n`` distinct batches, and the mean seconds ``synthetic_criteo`` took per batch (after the first)."""
    stream = synthetic_criteo(
        n * BATCH, BATCH, seed=1, num_dense=NUM_DENSE, vocab_sizes=CRITEO_VOCAB_SIZES, zipf_alpha=ZIPF
    )
    rows = torch.tensor(ROWS).repeat_interleave(BATCH)
    offsets, lengths = torch.arange(BATCH), torch.ones(len(FEATURES) * BATCH, dtype=torch.int32)
    out, gen_s = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        b = next(stream)
        gen_s.append(time.perf_counter() - t0)
        local = torch.remainder(torch.cat([b.sparse[f].values for f in FEATURES]), rows)
        kjt = None
        if torchrec is not None:
            kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=local, lengths=lengths)
        out.append(Prepared(b, list(torch.split(local, BATCH)), offsets, kjt))
    return out, float(np.mean(gen_s[1:] or gen_s))


def dense_tower() -> DLRM:
    torch.manual_seed(0)  # every variant starts from the same dense weights
    return DLRM(NUM_DENSE, FEATURES, DIM)


def timed(fn: Callable[..., Any], total: list[float]) -> Callable[..., Any]:
    """``fn`` that adds its wall seconds to ``total[0]`` and counts calls in ``total[1]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t0
            total[1] += 1

    return wrapper


def ours(
    mode: str,
    cluster: LocalCluster,
    closers: list[Callable[[], None]],
    threads: int | None = None,
    label: str = "",
    dtype: str = "float32",
) -> Variant:
    """``dtype``: how the tables store values and state, and the rows' and gradients' wire type."""
    client = PSClient(cluster.addresses, ClientConfig(transport_dtype=dtype)).start()  # type: ignore[arg-type]
    closers.append(client.close)
    lookups, pushes = [0.0, 0.0], [0.0, 0.0]  # instrumentation only: the pipeline calls these on its threads
    client.lookup_many = timed(client.lookup_many, lookups)  # type: ignore[method-assign]
    client.push_many = timed(client.push_many, pushes)  # type: ignore[method-assign]
    prefix = f"{mode}{threads or ''}{dtype}_"  # own tables per variant: each starts empty, counters stay apart
    tables = [
        EmbeddingTableConfig(
            prefix + f, DIM, "adagrad", seed=i, params={"lr": SPARSE_LR}, storage_dtype=dtype, state_dtype=dtype
        )
        for i, f in enumerate(FEATURES)
    ]
    emb = DistributedEmbedding(tables, [FeatureConfig(f, prefix + f) for f in FEATURES], client, mode=mode)  # type: ignore[arg-type]
    emb.create_tables()
    closers.insert(0, emb.close)
    model = dense_tower()

    def probe() -> Counters:
        c: Counters = {
            "client_lookup_s": lookups[0],
            "client_lookup_calls": lookups[1],
            "client_push_s": pushes[0],
            "client_push_calls": pushes[1],
        }
        for s in cluster.shards:
            c[f"shard{s.index}_cpu_s"] = proc_cpu_s(s.proc.pid)
        for st in client.admin.stats():
            mine = [t for t in st["tables"] if t["name"].startswith(prefix)]
            for k in ("lookups", "pushes", "rows_created"):
                c[f"shard{st['shard']}_{k}"] = sum(t[k] for t in mine)
        return c

    name = label or f"ours {mode}"
    return Variant(
        name,
        lambda p: emb(p.batch.sparse),
        model,
        [dense_optimizer(model)],
        prefetch=lambda p: emb.prefetch(p.batch.sparse),
        finish=emb.flush,
        probe=probe,
        threads=threads,
    )


def sparse_alone(cluster: LocalCluster, batches: list[Prepared], warmup: int, per_round: int, rounds: int) -> Any:
    """Seconds per step of the sparse traffic alone, float32 and 16-bit (tables, state and
    wire), rounds interleaved: each step's lookups, then its pushes (the rows as gradients),
    with no dense tower. 16 bits cannot make a whole step faster than they make this."""
    clients: dict[str, PSClient] = {}
    for dtype in ("float32", "bfloat16"):
        client = PSClient(cluster.addresses, ClientConfig(transport_dtype=dtype)).start()  # type: ignore[arg-type]
        for i, f in enumerate(FEATURES):
            params = {"lr": SPARSE_LR, "storage_dtype": dtype, "state_dtype": dtype}
            client.create_table(f"alone_{dtype}_{f}", DIM, optimizer="adagrad", seed=i, **params)  # type: ignore[arg-type]
        clients[dtype] = client

    def steps(dtype: str, first: int, n: int) -> float:
        client = clients[dtype]
        t0 = time.perf_counter()
        for p in batches[first : first + n]:
            keys = {f"alone_{dtype}_{f}": p.batch.sparse[f].values.numpy() for f in FEATURES}
            rows = client.lookup_many(keys)
            client.push_many({t: (k, rows[t]) for t, k in keys.items()})
        return (time.perf_counter() - t0) / n

    try:
        for dtype in clients:
            steps(dtype, 0, warmup)
        times: dict[str, list[float]] = {d: [] for d in clients}
        for r in range(rounds):
            for dtype in sorted(clients, reverse=r % 2 == 1):  # each goes first in every other round
                times[dtype].append(steps(dtype, warmup + r * per_round, per_round))
    finally:
        for client in clients.values():
            client.close()
    ms = {d: 1e3 * float(np.median(t)) for d, t in times.items()}
    return {"ms_per_step": ms, "ratio": ms["float32"] / ms["bfloat16"]}


def in_process() -> Variant:
    # torch's default, said out loud, or sparse Adagrad warns on every run.
    torch.sparse.check_sparse_tensor_invariants.disable()  # type: ignore[no-untyped-call]
    bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(r, DIM, mode="sum", sparse=True) for r in ROWS)
    model = dense_tower()

    def embed(p: Prepared) -> Pooled:
        return {f: bag(ids, p.offsets) for f, bag, ids in zip(FEATURES, bags, p.local_ids)}

    opts = [torch.optim.Adagrad(bags.parameters(), lr=SPARSE_LR), dense_optimizer(model)]
    return Variant("(a) in-process", embed, model, opts)


def torchrec_fused(torchrec: ModuleType) -> Variant:
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    configs = [
        torchrec.EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=r, feature_names=[f])
        for f, r in zip(FEATURES, ROWS)
    ]
    # torch.optim.Adagrad maps to fbgemm's EmbOptimType.EXACT_ADAGRAD, applied inside backward.
    ebc = FusedEmbeddingBagCollection(configs, torch.optim.Adagrad, {"lr": SPARSE_LR}, device=torch.device("cpu"))
    model = dense_tower()
    return Variant("(b) TorchRec", lambda p: ebc(p.kjt).to_dict(), model, [dense_optimizer(model)])


def dense_alone(threads: int) -> Variant:
    """The dense tower on ready pooled tensors (one set, reused): no embedding work at all."""
    pooled = {f: torch.randn(BATCH, DIM).requires_grad_() for f in FEATURES}

    def embed(p: Prepared) -> Pooled:
        for t in pooled.values():
            t.grad = None  # backward stores the gradient instead of adding to the last one
        return pooled

    model = dense_tower()
    return Variant(
        f"{FLOOR}, {threads} thread{'s' if threads > 1 else ''}",
        embed,
        model,
        [dense_optimizer(model)],
        threads=threads,
    )


def dense_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Every variant's dense optimizer, as the trainer builds it (``worker.trainer``)."""
    return dense_adam(model.parameters(), DENSE_LR)


def run_round(
    v: Variant,
    batches: list[Prepared],
    start: int,
    steps: int,
    pids: list[int] | None = None,
    max_s: float = float("inf"),
) -> None:
    """Up to ``steps`` training steps of ``v`` on ``batches[start:]`` (cycling), the trainer's loop;
    fewer if it runs past ``max_s`` (contention can slow a round down 50x). Timed (kept in
    ``v.rounds``) when ``pids`` (this process and the shards) is given."""
    seq = [batches[(start + i) % len(batches)] for i in range(steps)]
    before, cpu0, default_threads = v.probe(), time.process_time(), torch.get_num_threads()
    torch.set_num_threads(v.threads or default_threads)
    ours0, busy0 = sum(map(proc_cpu_s, pids or [])), busy_cpu_s()
    t_start = time.perf_counter()
    v.prefetch(seq[0])
    phases = dict.fromkeys(PHASES, 0.0)
    done = 0
    for i, p in enumerate(seq):
        t0 = time.perf_counter()
        last = i + 1 == steps or t0 - t_start > max_s  # decided before prefetching a batch we would not train on
        if not last:
            v.prefetch(seq[i + 1])
        t1 = time.perf_counter()
        pooled = v.embed(p)
        t2 = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(v.model(p.batch.dense, pooled), p.batch.labels)
        t3 = time.perf_counter()
        for o in v.optimizers:
            o.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # ours: the push is submitted in here
        t4 = time.perf_counter()
        for o in v.optimizers:
            o.step()
        t5 = time.perf_counter()
        for k, a, b in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
            phases[k] += b - a
        done += 1
        if last:
            break
    v.finish()
    wall_s, cpu_s = time.perf_counter() - t_start, time.process_time() - cpu0
    torch.set_num_threads(default_threads)
    if pids is None:
        return
    others_cores = max(0.0, busy_cpu_s() - busy0 - sum(map(proc_cpu_s, pids)) + ours0) / wall_s
    after = v.probe()
    v.rounds.append(
        {
            "steps": done,
            "wall_s": wall_s,
            "worker_cpu_s": cpu_s,
            "samples_per_s": done * BATCH / wall_s,
            "others_cores": others_cores,
            "phases_s": phases,
            "counters": {k: after[k] - before[k] for k in after},
        }
    )


def summarize(v: Variant) -> dict[str, Any]:
    """Figures over the clean rounds (all rounds if none was clean); the headline is their median."""
    clean = [r for r in v.rounds if r["others_cores"] < QUIET_CORES]
    rounds = clean or v.rounds
    steps, wall = sum(r["steps"] for r in rounds), sum(r["wall_s"] for r in rounds)
    per_step = {k: 1e3 * sum(r["phases_s"][k] for r in rounds) / steps for k in PHASES}
    s: dict[str, Any] = {
        "samples_per_s": float(np.median([r["samples_per_s"] for r in rounds])),
        "clean_rounds": len(clean),
        "samples_per_s_clean_rounds": steps * BATCH / wall,
        "steps": steps,
        "wall_s": wall,
        "round_samples_per_s": [r["samples_per_s"] for r in v.rounds],
        "round_others_cores": [r["others_cores"] for r in v.rounds],
        "phases_ms_per_step": per_step,
        "wall_ms_per_step": 1e3 * wall / steps,
        "worker_cpu_ms_per_step": 1e3 * sum(r["worker_cpu_s"] for r in rounds) / steps,
    }
    if rounds[0]["counters"]:
        c = {k: sum(r["counters"][k] for r in rounds) for k in rounds[0]["counters"]}
        s["per_step"] = {k: x / steps for k, x in c.items() if not k.startswith("client")}
        s["shard_cpu_ms_per_step"] = [1e3 * c[f"shard{i}_cpu_s"] / steps for i in range(SHARDS)]
        s["client_lookup_ms_per_call"] = 1e3 * c["client_lookup_s"] / max(1.0, c["client_lookup_calls"])
        s["client_push_ms_per_call"] = 1e3 * c["client_push_s"] / max(1.0, c["client_push_calls"])
    cpu = s["worker_cpu_ms_per_step"] + sum(s.get("shard_cpu_ms_per_step", []))
    s["cpu_ms_per_step"], s["cores_busy"] = cpu, cpu / s["wall_ms_per_step"]
    s["samples_per_cpu_s"] = BATCH / cpu * 1e3  # what a sample costs in CPU
    return s


def cpu_list(text: str) -> set[int]:
    """``"0-1,4"`` -> ``{0, 1, 4}`` (the notation of ``taskset -c``)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` to ``cpus``; threads it starts later inherit the mask."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # the thread ended since the listing


def main(
    quick: bool, steps: int | None, worker_cpus: set[int] | None = None, shard_cpus: set[int] | None = None
) -> None:
    if worker_cpus and shard_cpus and worker_cpus & shard_cpus:
        raise SystemExit(f"--worker-cpus and --shard-cpus share CPUs {sorted(worker_cpus & shard_cpus)}")
    if worker_cpus:
        pin(os.getpid(), worker_cpus)
        torch.set_num_threads(len(worker_cpus))
    steps = steps or (60 if quick else 400)
    rounds, warmup, quiet_budget, max_round_s = (3, 5, [10.0], 4.0) if quick else (5, 10, [60.0], 8.0)
    per_round = max(1, steps // rounds)
    t_start = time.perf_counter()
    torchrec, status = load_torchrec()
    machine: dict[str, Any] = {
        "nproc": len(os.sched_getaffinity(0)),
        "worker_cpus": sorted(worker_cpus or []),
        "shard_cpus": sorted(shard_cpus or []),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "git": git_state(),
    }
    res: dict[str, Any] = {
        "quick": quick,
        "warmup_steps": warmup,
        "timed_steps": per_round * rounds,
        "rounds": rounds,
        "batch": BATCH,
        "dim": DIM,
        "rows": ROWS,
        "machine": machine,
        "loadavg_start": os.getloadavg(),
        "torchrec": {
            "skipped": torchrec is None,
            "status": status,
            "sparse_optimizer": "fbgemm EXACT_ADAGRAD via FusedEmbeddingBagCollection" if torchrec else None,
        },
    }
    print(f"torchrec: {status}\ngenerating {warmup + per_round * rounds} batches ...", file=sys.stderr)
    batches, gen_s = prepare(warmup + per_round * rounds, torchrec)
    res["datagen_ms_per_batch"] = 1e3 * gen_s
    closers: list[Callable[[], None]] = []
    with LocalCluster(SHARDS) as cluster:
        if shard_cpus:
            for s in cluster.shards:
                pin(s.proc.pid, shard_cpus)
        try:
            # Ours runs with the thread count the trainer picks when its shards share the
            # machine (deploy.train); the torch default is shown beside it.
            policy, default = threads_beside_local_shards(), torch.get_num_threads()
            variants = [
                ours("pipelined", cluster, closers, threads=policy),
                ours("sync", cluster, closers, threads=policy),
                ours("pipelined", cluster, closers, threads=policy, label=COMPACT, dtype="bfloat16"),
                ours(
                    "pipelined",
                    cluster,
                    closers,
                    threads=default,
                    label=f"ours pipelined, {default} threads ({'every worker CPU' if worker_cpus else 'torch default'})",
                ),
                in_process(),
            ]
            if torchrec is not None:
                variants.append(torchrec_fused(torchrec))
            variants.append(dense_alone(policy))
            for v in variants:
                print(f"warming up {v.name} ...", file=sys.stderr)
                run_round(v, batches, 0, warmup)
            pids = [os.getpid(), *(s.proc.pid for s in cluster.shards)]
            for r in range(rounds):
                for v in variants:
                    wait_quiet(pids, quiet_budget)
                    run_round(v, batches, warmup + r * per_round, per_round, pids, max_round_s)
                    print(
                        f"round {r + 1}/{rounds} {v.name}: {v.rounds[-1]['samples_per_s']:,.0f} samples/s "
                        f"(other processes: {v.rounds[-1]['others_cores']:.2f} cores)",
                        file=sys.stderr,
                    )
            print("timing the sparse traffic alone ...", file=sys.stderr)
            alone = sparse_alone(cluster, batches, warmup, per_round, rounds)
        finally:
            for close in closers:
                close()
    res["variants"] = {v.name: summarize(v) for v in variants}
    baselines = [n for n in res["variants"] if n.startswith("(")]
    res["best_baseline"] = max(baselines, key=lambda n: res["variants"][n]["samples_per_s"], default=None)
    best, ours_p = res["variants"][res["best_baseline"]], res["variants"]["ours pipelined"]
    res["ratio"] = ours_p["samples_per_s"] / best["samples_per_s"]
    res["goal"], res["pass"] = GOAL, res["ratio"] >= GOAL
    res["cpu_ratio"] = ours_p["samples_per_cpu_s"] / best["samples_per_cpu_s"]
    res["cpu_goal"], res["cpu_pass"] = CPU_GOAL, res["cpu_ratio"] >= CPU_GOAL
    compact = res["variants"][COMPACT]["samples_per_s"] / ours_p["samples_per_s"]
    res["compact"] = {"ratio": compact, "goal": COMPACT_GOAL, "pass": compact >= COMPACT_GOAL, "sparse_alone": alone}
    floor = next(n for n in res["variants"] if n.startswith(FLOOR))
    res["floor"] = {"variant": floor, "ratio": res["variants"][floor]["samples_per_s"] / best["samples_per_s"]}
    res["loadavg_end"], res["wall_s"] = os.getloadavg(), time.perf_counter() - t_start
    res["quiet_wait_budget_left_s"] = quiet_budget[0]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "training.json").write_text(json.dumps(res, indent=1, default=str))
    try:
        chart(res, RESULTS / "training.png")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG chart written")
    print(report(res))
    print(
        f"\n{ {k: x for k, x in machine.items() if k != 'git'} }\ncommit {machine['git']['commit'][:12]} + "
        f"{len(machine['git']['changed'])} changed files\nloadavg {res['loadavg_start'][0]:.2f} -> {res['loadavg_end'][0]:.2f}; "
        f"wall {res['wall_s']:.0f} s; wrote {RESULTS}/training.{{json,png}}"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="60 timed steps per variant in 3 rounds (~1 min)")
    p.add_argument(
        "--steps", type=int, help="timed steps per variant, split over the rounds (default 400; 60 with --quick)"
    )
    p.add_argument("--worker-cpus", type=cpu_list, help="CPUs of this process, e.g. 0-1 (default: all it may use)")
    p.add_argument("--shard-cpus", type=cpu_list, help="CPUs of the shards, e.g. 2-5 (default: the worker's)")
    a = p.parse_args()
    main(a.quick, a.steps, a.worker_cpus, a.shard_cpus)
