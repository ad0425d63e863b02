"""One model trained through one set of tables: ``TrainingPass`` (the step loop), and
``predict``/``evaluate`` of a model through its ``DistributedEmbedding``.

A pass holds the dense model (under DDP with several workers), its Adam, and the
``DistributedEmbedding`` of its tables (``prefix + "embedding"`` for every feature and,
for the first-order term, the dim-1 ``prefix + "wide"``), across epochs. ``epoch(plan,
...)`` trains this worker's micro-batches of one ``EpochPlan``, each pushed under its
seq; a step in which this worker has no micro-batch still joins DDP's allreduce with
zero gradients. ``worker.trainer`` runs the passes of a run (a probe, then the model).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from client import PSClient
from worker.config import EmbeddingTableConfig, FeatureConfig, TrainerConfig
from worker.data import Batch, auc, logloss
from worker.dataset import EpochPlan
from worker.distributed import Dist
from worker.embedding import DistributedEmbedding
from worker.export import probabilities
from worker.jagged import JaggedIds
from worker.models import DLRM, DeepFM
from worker.rare import RareValues

__all__ = ["WIDE", "TrainingPass", "dense_adam", "evaluate", "predict", "scores", "trainer_tables"]

log = logging.getLogger("worker.trainer")  # its progress lines are the trainer's

WIDE = ".wide"  # feature f + WIDE reads f's keys from the table "wide"
LOG_EVERY_S = 10.0  # seconds between progress log lines (samples/s, lookup wait, push latency)


# Where torch has a fused Adam kernel for every parameter dtype the towers use.
_FUSED_ADAM_DEVICES = frozenset({"cpu", "cuda"})


def dense_adam(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Adam:
    """The dense tower's Adam: torch's fused kernel (one call for every parameter) where
    the device has one. The per-parameter loop launches ~10 ops per tensor, each letting
    go of the GIL and waiting to take it back from the embedding pipeline's threads: on
    the DLRM benchmark (2 cores) its step took 2.9 ms beside the shards, 0.85 ms alone.
    Decided here: torch checks the devices only at the first ``step()``."""
    params = list(params)
    fused = bool(params) and all(p.is_floating_point() and p.device.type in _FUSED_ADAM_DEVICES for p in params)
    return torch.optim.Adam(params, lr=lr, fused=True if fused else None)


def _inputs(sparse: Mapping[str, JaggedIds], features: Sequence[str], rare: RareValues | None) -> dict[str, JaggedIds]:
    """The batch as ``DistributedEmbedding`` wants it: feature ``f + WIDE`` reads ``f``'s ids
    as they are (a weight per value), the embeddings read them with ``rare`` values shared."""
    out = {f: sparse[f.removesuffix(WIDE)] for f in features if f.endswith(WIDE)}
    for f in features:
        if not f.endswith(WIDE):
            out[f] = sparse[f] if rare is None else rare.ids(f, sparse[f])
    return out


def trainer_tables(config: TrainerConfig, prefix: str = "") -> list[EmbeddingTableConfig]:
    """The tables a run of ``config`` trains: ``prefix + "embedding"`` (every feature's rows)
    and, with ``config.wide``, the dim-1 ``prefix + "wide"`` (first-order weights).

    >>> [(t.name, t.dim) for t in trainer_tables(TrainerConfig(dim=8), "probe.")]
    [('probe.embedding', 8), ('probe.wide', 1)]
    """
    lifecycle = {"admit_after": float(config.admit_after)} if config.admit_after > 1 else {}
    decay = {"weight_decay": config.sparse_weight_decay} if config.sparse_weight_decay else {}
    # One table holds every feature's rows: keys are hashed with a seed per feature, so
    # they never collide, and a step's lookup is one entry per table, not per feature
    # (at small batches the per-table work, not the bytes, bounds the step time).
    tables = [
        EmbeddingTableConfig(
            prefix + "embedding",
            config.dim,
            config.sparse_optimizer,
            seed=2 * config.seed,
            params={"lr": config.sparse_lr, **decay, **lifecycle},
            storage_dtype=config.storage_dtype,
            state_dtype=config.state_dtype,
        )
    ]
    if config.wide:
        tables.append(
            EmbeddingTableConfig(
                prefix + "wide",
                1,
                config.sparse_optimizer,
                "zeros",
                seed=2 * config.seed + 1,
                params={"lr": config.wide_lr, **lifecycle},
                storage_dtype=config.storage_dtype,
                state_dtype=config.state_dtype,
            )
        )
    return tables


class TrainingPass:
    """A model, its tables (named ``prefix + feature``) and the step loop, kept across epochs."""

    def __init__(
        self,
        config: TrainerConfig,
        d: Dist,
        client: PSClient,
        features: list[str],
        num_dense: int,
        prefix: str = "",
        dense_state: Mapping[str, Any] | None = None,
        rare: RareValues | None = None,
    ) -> None:
        """``dense_state``: the ``model``, ``optimizer`` and ``rng`` state of a checkpoint to resume from;
        ``rare``: the vocabulary of the rows this pass trains on (None: every value its own row)."""
        self.config, self.d, self.num_dense, self.rare = config, d, num_dense, rare
        dense_state = dense_state or {}
        self.tables = trainer_tables(config, prefix)
        self.features = [FeatureConfig(f, prefix + "embedding") for f in features]
        wide = [f + WIDE for f in features] if config.wide else []
        self.features += [FeatureConfig(w, prefix + "wide") for w in wide]
        torch.manual_seed(config.seed)  # the probe and the real model start alike
        model_cls = DLRM if config.model == "dlrm" else DeepFM
        self.model: torch.nn.Module = model_cls(num_dense, features, config.dim, wide=wide).to(d.device)
        if "model" in dense_state:
            self.model.load_state_dict(dense_state["model"])
        self.emb = DistributedEmbedding(
            self.tables,
            self.features,
            client,
            mode=config.mode,  # type: ignore[arg-type]
            staleness=config.staleness,
            device=d.device,
        )
        if d.rank == 0:
            self.emb.create_tables()
        if d.world > 1:
            dist.barrier()
        self.dense = DistributedDataParallel(self.model) if d.world > 1 else self.model
        self.optimizer = dense_adam(self.model.parameters(), config.dense_lr)
        if "optimizer" in dense_state:
            self.optimizer.load_state_dict(dense_state["optimizer"])
        if "rng" in dense_state:
            torch.set_rng_state(dense_state["rng"])
        self.phases = dict.fromkeys(("data", "lookup", "forward", "backward", "step", "eval"), 0.0)
        self.steps, self.samples, self.train_s = 0, 0, 0.0
        self._logged_at = time.perf_counter()
        self.losses: list[float] = []
        self.evals: list[dict[str, Any]] = []
        self.skip_nonfinite = False  # a batch whose loss is NaN or Inf is not trained (online runs)
        self.skipped = 0

    def epoch(
        self,
        plan: EpochPlan,
        batches: Iterator[Batch],
        bar: Any,
        held_out: Sequence[Batch] = (),
        after_step: Callable[[int], None] | None = None,
    ) -> None:
        """Train this worker's micro-batches of ``plan`` (``batches``, in its order): prefetch
        the next one, forward, backward (pushes under the micro-batch's seq), dense step.
        ``after_step(position)`` runs after each step (position: see ``EpochPlan.position``)."""
        names = [f.name for f in self.features]
        started = time.perf_counter()
        eval_s = self.phases["eval"]

        def take(step: int) -> tuple[Batch | None, dict[str, JaggedIds]]:
            if step >= plan.steps or plan.index(step) is None:
                return None, {}
            batch = next(batches, None)  # None: a streamed log that ran short
            return (batch, _inputs(batch.sparse, names, self.rare)) if batch is not None else (None, {})

        cur, cur_in = take(0)
        if cur is not None:
            self.emb.prefetch(cur_in)
        for step in range(plan.steps):
            t0 = time.perf_counter()
            nxt, nxt_in = take(step + 1)
            t1 = time.perf_counter()
            self.phases["data"] += t1 - t0
            if nxt is not None:
                self.emb.prefetch(nxt_in)
            index = plan.index(step)
            if cur is not None and index is not None:
                active = plan.active(step)
                self._step(cur, cur_in, plan.seq(index), plan.world / active if active < plan.world else None, t1)
            else:
                self._idle_step(None if index is None else plan.seq(index))
            self.steps += 1
            now = time.perf_counter()
            if bar is None and now - self._logged_at >= LOG_EVERY_S:  # a bar says it all, in one line
                self._logged_at = now
                self._log_progress(self.train_s + now - started)
            if bar is not None:
                recent = self.losses[-20:]
                rate = self.samples * self.d.world / max(1e-9, self.train_s + now - started)
                bar.set_postfix(
                    loss=f"{sum(recent) / max(1, len(recent)):.4f}",
                    samples_s=f"{rate:,.0f}",
                    lookup_wait_s=f"{self.phases['lookup']:.1f}",
                )
                bar.update(1)
            if self.config.eval_every and held_out and self.steps % self.config.eval_every == 0 and self.d.rank == 0:
                t6 = time.perf_counter()
                self.evals.append({"step": self.steps, **self.evaluate(held_out)})
                self.phases["eval"] += time.perf_counter() - t6
            if after_step is not None:
                after_step(plan.position(step))
            cur, cur_in = nxt, nxt_in
        self.emb.flush()
        self.train_s += time.perf_counter() - started - (self.phases["eval"] - eval_s)

    def inputs(self, batch: Batch) -> dict[str, JaggedIds]:
        """``batch`` as the embeddings read it (what ``prefetch`` and ``train`` take)."""
        return _inputs(batch.sparse, [f.name for f in self.features], self.rare)

    def prefetch(self, inputs: dict[str, JaggedIds]) -> None:
        self.emb.prefetch(inputs)

    def train(self, batch: Batch, inputs: dict[str, JaggedIds], seq: int, scale: float | None = None) -> torch.Tensor:
        """Train one batch outside an ``EpochPlan`` (a stream's): its push as ``seq``; ``scale``
        as ``_step`` takes it. Returns the logits the model gave the batch before it trained
        on it (detached)."""
        logits = self._step(batch, inputs, seq, scale, time.perf_counter())
        self.steps += 1
        return logits

    def _step(
        self, batch: Batch, inputs: dict[str, JaggedIds], seq: int, scale: float | None, t1: float
    ) -> torch.Tensor:
        """One micro-batch: lookup, forward, backward (its push as ``seq``), dense step; the
        logits (detached). ``scale``: multiplies the loss when only some workers train this
        step, so DDP's average over all of them is the average over those. ``t1``: when the
        lookup phase began (the next batch's prefetch counts in it)."""
        out = self.emb(inputs, seq=seq)
        t2 = time.perf_counter()
        logits: torch.Tensor = self.dense(batch.dense.to(self.d.device), out)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(self.d.device))
        if self.skip_nonfinite and not bool(torch.isfinite(loss)):
            # Not trained: the graph goes without a backward, so the step pushes no keys
            # under its seq (DistributedEmbedding); the online guard counts it.
            self.skipped += 1
            return logits.detach()
        t3 = time.perf_counter()
        self.optimizer.zero_grad()
        (loss if scale is None else loss * scale).backward()  # type: ignore[no-untyped-call]
        t4 = time.perf_counter()
        self.optimizer.step()
        t5 = time.perf_counter()
        for k, a, b in zip(("lookup", "forward", "backward", "step"), (t1, t2, t3, t4), (t2, t3, t4, t5)):
            self.phases[k] += b - a
        self.samples += batch.batch_size
        self.losses.append(float(loss.detach()))
        return logits.detach()

    def _idle_step(self, seq: int | None) -> None:
        """A step without a micro-batch: DDP's allreduce needs every worker, so this one
        adds zero gradients (no lookup). ``seq``: a micro-batch the data did not have
        (a streamed log that ran short), pushed without keys so the seqs stay without gaps."""
        if seq is not None:
            self.emb.push_nothing(seq)
        dims = {f.name: self.emb.tables[f.table].dim for f in self.features}
        dense = torch.zeros(1, self.num_dense, device=self.d.device)
        out = {name: torch.zeros(1, dim, device=self.d.device) for name, dim in dims.items()}
        self.optimizer.zero_grad()
        (self.dense(dense, out).sum() * 0.0).backward()
        self.optimizer.step()

    def _log_progress(self, train_s: float) -> None:
        """One progress line: throughput, time waiting for rows, push latency."""
        push = self.emb.push_latency()
        log.info(
            "progress step=%d samples_per_s=%.0f lookup_wait_s=%.3f pushes=%d push_mean_ms=%.1f "
            "push_max_ms=%.1f loss_last_20=%.4f",
            self.steps,
            self.samples * self.d.world / max(1e-9, train_s),
            self.phases["lookup"],
            push["pushes"],
            1e3 * push["push_mean_s"],
            1e3 * push["push_max_s"],
            sum(self.losses[-20:]) / max(1, len(self.losses[-20:])),
        )

    def evaluate(self, batches: Sequence[Batch]) -> dict[str, float]:
        return evaluate(self.emb, self.model, batches, self.d.device, self.rare)

    def close(self) -> None:
        self.emb.close()
        # DDP's reducer keeps gloo/nccl work objects alive in reference cycles; if they are
        # only collected at interpreter exit, gloo's threads can abort the process.
        del self.dense, self.optimizer
        gc.collect()

    def stats(self) -> dict[str, Any]:
        recent = self.losses[-20:]
        return {
            "steps": self.steps,
            "worker_samples": self.samples,
            "train_s": self.train_s,
            "samples_per_s": self.samples * self.d.world / max(1e-9, self.train_s),
            "phases_s": self.phases,
            "lookup_wait_s": self.phases["lookup"],
            **self.emb.push_latency(),
            "mean_loss_last_20": sum(recent) / max(1, len(recent)),
        }


def predict(
    emb: DistributedEmbedding,
    model: torch.nn.Module,
    batches: Sequence[Batch],
    device: torch.device,
    rare: RareValues | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and predicted probabilities (``worker.export.probabilities`` of the logits, as
    the predictor computes them) of every sample of ``batches``, on CPU (no pushes; rows
    as the shards hold them now).

    Features of ``emb`` named ``f + ".wide"`` read the ids of feature ``f``; the others read
    them with ``rare`` values shared (the vocabulary the model trained with).
    """
    emb.eval()
    model.eval()
    labels, probs = [], []
    names = list(emb.features)
    with torch.no_grad():
        for b in batches:
            logits = model(b.dense.to(device), emb(_inputs(b.sparse, names, rare)))
            labels.append(b.labels)
            probs.append(probabilities(logits.cpu()))
    emb.train()
    model.train()
    return torch.cat(labels), torch.cat(probs)


def evaluate(
    emb: DistributedEmbedding,
    model: torch.nn.Module,
    batches: Sequence[Batch],
    device: torch.device,
    rare: RareValues | None = None,
) -> dict[str, float]:
    """AUC and logloss of ``model`` on ``batches`` (see ``predict``)."""
    return scores(*predict(emb, model, batches, device, rare))


def scores(y: torch.Tensor, p: torch.Tensor) -> dict[str, float]:
    return {"auc": auc(y, p), "logloss": logloss(y, p), "samples": float(len(y))}
