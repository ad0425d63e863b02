"""``DistributedEmbedding``: a drop-in for a dict of ``nn.EmbeddingBag`` whose rows live on the shards.

Forward looks up the batch's unique keys of every table (one RPC per shard for all
features), then pools each feature with ``torch.nn.functional.embedding_bag`` over
those rows: the same operation ``nn.EmbeddingBag`` runs, so outputs and gradients match
a local model exactly. Backward sums the gradient of each unique key (autograd does)
and pushes it; the table's optimizer runs on the shards. In pipelined mode on CPU, when
every feature is sum-pooled without per-id weights, all features pool in one node with
compiled loops instead (``worker/pooling.py``): the same sums, gradients equal up to
float rounding, and a step 14% faster on the DLRM benchmark.

Modes:
* ``sync``: each step's push is applied before the next lookup starts, and each
  table's keys are visited in ascending order, so training is bit-for-bit what a
  local ``nn.EmbeddingBag`` with the same optimizer does (parity tests, debugging);
* ``pipelined`` (default): ``prefetch(next_batch)`` dedups, routes and looks up the next
  batch on a background thread while this one computes, pushes run in the background,
  and the rows of step t reflect exactly
  the pushes of steps up to t - 1 - ``staleness`` (default 1): one worker's run is
  reproducible to the bit in both modes.

Example (needs running shards; see examples/ and the README):
    emb = DistributedEmbedding(
        tables=[EmbeddingTableConfig("user", 16, optimizer="adagrad")],
        features=[FeatureConfig("user_id", "user")],
        client=PSClient(addresses),
    )
    pooled = emb({"user_id": JaggedIds.from_lists([[1, 2], [3]])})["user_id"]   # [2, 16]
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from client import PSClient, TablePlan
from client.batching import dedup
from worker.autograd import rows_with_push
from worker.config import EmbeddingTableConfig, FeatureConfig, check_features
from worker.jagged import JaggedIds
from worker.pooling import SumFeature, TableGrads, pool_and_push, sum_pool
from worker.prefetch import Rows, SparsePipeline, Updates

__all__ = ["DistributedEmbedding"]

Mode = Literal["sync", "pipelined"]
_NO_KEYS = np.empty(0, dtype=np.int64)


_Pooled = tuple[list[SumFeature], list[npt.NDArray[np.float32]]]  # the features, their sums
_Prefetched = tuple[Mapping[str, JaggedIds], "Future[_Plan]", "Future[Rows]", "Future[_Pooled] | None"]


@dataclass(frozen=True)
class _Plan:
    """One batch's lookup: unique keys per table (routed to shards once, for the lookup
    and the push) and, per feature, indices into them."""

    unique: dict[str, TablePlan]
    index: dict[str, npt.NDArray[np.int64]]  # feature -> positions into its table's unique keys


class DistributedEmbedding(torch.nn.Module):
    """Embedding bags for many features and tables, stored on parameter-server shards.

    ``forward(batch)`` takes ``{feature: JaggedIds}`` and returns ``{feature: tensor}``:
    ``[batch, dim]`` for sum/mean pooling, ``[num_ids, dim]`` for ``pooling="none"``.
    Tables are created on first use (idempotent). Outputs live on ``device``.

    Not thread-safe: one training loop per module. Raises the client's ``PSError``
    subclasses for shard failures (a background push failure at the next call) and
    ``ValueError`` for batches that do not match the features.
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingTableConfig],
        features: Sequence[FeatureConfig],
        client: PSClient,
        *,
        mode: Mode = "pipelined",
        staleness: int = 1,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        check_features(tables, features)
        if mode not in ("sync", "pipelined"):
            raise ValueError(f"mode={mode!r}: expected 'sync' or 'pipelined'")
        if mode == "pipelined" and staleness < 1:
            raise ValueError(f"staleness={staleness}: pipelined mode needs >= 1 (use mode='sync' for 0)")
        self.tables = {t.name: t for t in tables}
        self.features = {f.name: f for f in features}
        # Per table, the features that read it (tables nobody reads are left out).
        self._readers: dict[str, list[str]] = {}
        for f in features:
            self._readers.setdefault(f.table, []).append(f.name)
        self.client = client
        self.mode = mode
        self.device = torch.device(device)
        self._pipeline = SparsePipeline(client, 0 if mode == "sync" else staleness)
        self._prefetched: deque[_Prefetched] = deque()
        self._created = False
        self._step = 0
        self._hold = False  # hold_next_push() was called
        self._held: tuple[int, int | None, Updates] | None = None
        # Pipelined sum pooling on CPU runs in one node (worker/pooling.py); this tensor
        # ties that node into the graph.
        self._fusable = mode == "pipelined" and self.device.type == "cpu" and all(f.pooling == "sum" for f in features)
        self._anchor = torch.zeros((), requires_grad=True)
        # Evaluation reads rows through this, if set: e.g. as a serving shard of another
        # storage type would return them (``protos.rowtypes.as_served``).
        self.eval_rows: Callable[[npt.NDArray[np.float32]], npt.NDArray[np.float32]] | None = None

    # -- public ---------------------------------------------------------------------
    def create_tables(self) -> None:
        """Create every table on the shards (idempotent; forward does it on first use)."""
        for t in self.tables.values():
            self.client.create_table(t.name, t.dim, **t.options())
        self._created = True

    def prefetch(self, batch: Mapping[str, JaggedIds]) -> None:
        """Start looking up ``batch`` for a later ``forward(batch)`` (same object), in pipelined mode.

        In sync mode this does nothing: the lookup must wait for the current step's push.
        Features that do not match raise ``ValueError`` here; anything else wrong with the
        batch is found on the lookup thread and raised by ``forward(batch)``.
        """
        self._pipeline.check()
        if self.mode == "sync":
            return
        self._ensure_tables()
        self._check_features(batch)
        # The batch is deduplicated and routed on the lookup thread, just before its lookup:
        # off the training thread, whose core the dense tower needs (DLRM: ~3 ms a step).
        plan: Future[_Plan] = Future()

        def keys() -> dict[str, TablePlan]:
            try:
                plan.set_result(self._plan(batch))
            except BaseException as exc:
                plan.set_exception(exc)
                raise
            return plan.result().unique

        step = self._step + len(self._prefetched)
        future = self._pipeline.lookup(step, keys)
        pooled: Future[_Pooled] | None = None
        if self._fused(batch):
            # The sums too are made on the lookup thread, as soon as the rows are in.
            pooled = Future()
            future.add_done_callback(functools.partial(self._pool_sums, batch, plan, pooled))
        self._prefetched.append((batch, plan, future, pooled))

    def forward(self, batch: Mapping[str, JaggedIds], *, seq: int | None = None) -> dict[str, torch.Tensor]:
        """Pooled rows of ``batch``; in training, backward pushes their gradients.

        ``seq`` (>= 1) names this step's push for exactly-once (``PSClient.push_many``): a
        process that trains the same batch again with the same client id and seq, say
        after a restart, has its push recognised as a duplicate if the shards applied
        the first. The caller numbers its steps without gaps per client id: every table
        is pushed under every seq, with no keys where the step has none, and a step whose
        graph is freed without a backward pushes nothing under its seq. None: the client
        numbers the pushes itself.
        """
        self._pipeline.check()
        self._ensure_tables()
        training = self.training and torch.is_grad_enabled()
        if not training:
            # Evaluation: read what the shards hold after every push so far, and leave the
            # training steps and their prefetched lookups alone.
            plan = self._plan(batch)
            rows = self._pipeline.lookup(None, plan.unique).result()
            read = self.eval_rows or (lambda r: r)
            tensors = [torch.from_numpy(read(rows[t])).to(self.device, non_blocking=True) for t in plan.unique]
            return self._pool_all(batch, plan, dict(zip(plan.unique, tensors)))
        step = self._step
        pooled = None
        if self._prefetched and self._prefetched[0][0] is batch:
            _, planned, future, pooled = self._prefetched.popleft()
            plan = planned.result()
        else:
            # Prefetched for other batches: the loop changed course. Those steps never run,
            # and this lookup sees every push so far (which ones it would see otherwise
            # depends on how far the discarded lookups got).
            changed_course = bool(self._prefetched)
            while self._prefetched:
                self._pipeline.discard(self._prefetched.popleft()[2])
            plan = self._plan(batch)
            future = self._pipeline.lookup(step, plan.unique, sees_all=changed_course)
        rows = future.result()
        self._step += 1
        names = list(plan.unique)
        pushed = [False]
        sink = _PushSink(self, step, seq, names, [plan.unique[t] for t in names], pushed)
        # When autograd frees this step's graph without a backward (skipped or failed
        # step), the step can push nothing more: later lookups must not wait for it.
        weakref.finalize(sink, self._settle, step, seq, pushed)
        if self._fused(batch):
            sums, outputs = pooled.result() if pooled is not None else (self._sums(batch, plan), None)
            return dict(
                zip(self.features, pool_and_push([rows[t] for t in names], sums, sink, self._anchor, pooled=outputs))
            )
        tensors = [torch.from_numpy(rows[t]).to(self.device, non_blocking=True) for t in names]
        tensors = list(rows_with_push(tensors, sink))
        return self._pool_all(batch, plan, dict(zip(names, tensors)))

    def _fused(self, batch: Mapping[str, JaggedIds]) -> bool:
        """Whether ``batch`` pools in one compiled node (``worker/pooling.py``)."""
        return self._fusable and all(batch[n].weights is None for n in self.features)

    def _sums(self, batch: Mapping[str, JaggedIds], plan: _Plan) -> list[SumFeature]:
        position = {t: i for i, t in enumerate(plan.unique)}
        return [
            SumFeature(position[f.table], plan.index[n], _host_ids(batch[n].offsets)) for n, f in self.features.items()
        ]

    def _pool_sums(
        self, batch: Mapping[str, JaggedIds], plan: Future[_Plan], out: Future[_Pooled], lookup: Future[Rows]
    ) -> None:
        """On the lookup thread, once ``lookup`` is done: the features and their sums, into ``out``."""
        try:
            rows, p = lookup.result(), plan.result()
            sums = self._sums(batch, p)
            out.set_result((sums, sum_pool([rows[t] for t in p.unique], sums)))
        except BaseException as exc:  # raised where forward(batch) reads it
            out.set_exception(exc)

    def _pool_all(
        self, batch: Mapping[str, JaggedIds], plan: _Plan, by_table: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return {
            name: self._pool(name, batch[name], by_table[f.table], plan.index[name])
            for name, f in self.features.items()
        }

    def push_nothing(self, seq: int) -> None:
        """Push no keys under ``seq`` for every table, now (blocks until acknowledged): a
        step that has no batch to train keeps the seqs of its client id without gaps."""
        self._pipeline.check()
        self._ensure_tables()
        self.client.push_many(self._no_keys(), seq=seq)

    def hold_next_push(self) -> None:
        """Sync mode: keep the next step's push instead of sending it, until ``send_held()``.

        For a write-ahead checkpoint: the step's dense update and its sparse gradients
        (``held_push()``) are made durable together before the push leaves, so a process
        killed at any moment resumes with dense weights that match the rows on the shards.
        ``send_held()`` must come before the next step's lookup.
        """
        if self.mode != "sync":
            raise ValueError("hold_next_push: only sync mode sends a step's push before the next lookup")
        self._hold = True

    def held_push(self) -> tuple[int | None, dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]]] | None:
        """The held push as ``(seq, {table: (keys, gradients)})`` (None: none held), what
        ``PSClient.push_many(updates, seq=seq)`` sends again after a restart."""
        if self._held is None:
            return None
        _, seq, updates = self._held
        return seq, {t: (k.keys if isinstance(k, TablePlan) else np.asarray(k), g) for t, (k, g) in updates.items()}

    def send_held(self) -> None:
        """Send the held push (if any) and wait until the shards applied it."""
        self._hold = False
        if self._held is not None:
            step, seq, updates = self._held
            self._held = None
            self._pipeline.push(step, updates, wait=True, seq=seq)

    def push_latency(self) -> dict[str, float]:
        """Acknowledged pushes so far: how many, their mean and max latency in seconds, and
        how many shard requests the shards had applied before (``push_duplicates``: pushes
        a resumed run sent again)."""
        p = self._pipeline
        return {
            "pushes": p.push_count,
            "push_mean_s": p.push_s / max(1, p.push_count),
            "push_max_s": p.push_max_s,
            "push_duplicates": p.push_duplicates,
        }

    def flush(self) -> None:
        """Block until every push so far is applied; raise a background failure if there was one."""
        self._pipeline.flush()

    def close(self) -> None:
        """Flush and stop the background threads (the client stays open)."""
        self._pipeline.close()

    # -- internals ------------------------------------------------------------------
    def _ensure_tables(self) -> None:
        if not self._created:
            self.create_tables()

    def _check_features(self, batch: Mapping[str, JaggedIds]) -> None:
        missing = [f for f in self.features if f not in batch]
        extra = [f for f in batch if f not in self.features]
        if missing or extra:
            raise ValueError(f"batch features: missing {missing}, unexpected {extra}; expected {list(self.features)}")

    def _plan(self, batch: Mapping[str, JaggedIds]) -> _Plan:
        self._check_features(batch)
        unique: dict[str, TablePlan] = {}
        index: dict[str, npt.NDArray[np.int64]] = {}
        for table, feats in self._readers.items():
            parts = [_host_ids(batch[n].values) for n in feats]
            ids = np.concatenate(parts) if len(parts) > 1 else parts[0]
            if self.mode == "sync":
                # Ascending keys make embedding_bag's backward add up duplicate ids in the
                # same order as over a local [vocab, dim] weight: bit-exact parity.
                keys, inverse = dedup(ids)
                order = np.argsort(keys, kind="stable")
                rank = np.empty_like(order)
                rank[order] = np.arange(order.shape[0])
                keys, inverse = keys[order], rank[inverse]
                unique[table] = self.client.plan(table, keys)
            else:
                # One dedup: the plan's own, kept for the pooling index.
                plan = self.client.plan(table, ids)
                unique[table], inverse = plan.of_unique(), plan.inverse
            lo = 0
            for n, p in zip(feats, parts):
                index[n] = inverse[lo : lo + p.shape[0]]
                lo += p.shape[0]
        return _Plan(unique, index)

    def _pool(self, name: str, ids: JaggedIds, rows: torch.Tensor, ids_at: npt.NDArray[np.int64]) -> torch.Tensor:
        pooling = self.features[name].pooling
        index = torch.from_numpy(ids_at).to(self.device, non_blocking=True)
        if pooling == "none":
            return rows.index_select(0, index)
        weights = None if ids.weights is None else ids.weights.to(self.device, rows.dtype)
        if weights is not None and pooling != "sum":
            raise ValueError(
                f"feature {name!r}: per-id weights need pooling='sum' (as nn.EmbeddingBag), got {pooling!r}"
            )
        offsets = ids.offsets.to(self.device)
        return F.embedding_bag(index, rows, offsets[:-1], mode=pooling, per_sample_weights=weights)

    def _push(
        self,
        step: int,
        seq: int | None,
        names: list[str],
        unique: list[TablePlan],
        grads: TableGrads | Callable[[], TableGrads],
    ) -> None:
        """Push ``grads`` (per table, or a function the push thread calls for them)."""

        def updates() -> Updates:
            found = grads() if callable(grads) else grads
            out: Updates = {
                t: (keys, g.detach().to("cpu", torch.float32).contiguous().numpy())
                for t, keys, g in zip(names, unique, found)
                if g is not None
            }
            # A numbered push names every table, so each table's seqs stay without gaps.
            return out if seq is None else self._no_keys() | out

        if self._hold:
            self._hold = False
            self._held = (step, seq, updates())
            return
        self._pipeline.push(step, updates if callable(grads) else updates(), wait=self.mode == "sync", seq=seq)

    def _no_keys(self) -> Updates:
        """An entry without keys for every table."""
        return {t: (_NO_KEYS, np.empty((0, c.dim), np.float32)) for t, c in self.tables.items()}

    def _settle(self, step: int, seq: int | None, pushed: list[bool]) -> None:
        """``step``'s graph is gone: it pushes nothing more (a numbered step that never
        pushed pushes no keys under its seq, so the seqs stay without gaps)."""
        if seq is None or pushed[0] or self._pipeline.closed:
            self._pipeline.settle(step)
        else:
            self._pipeline.push(step, self._no_keys(), wait=False, seq=seq)


def _host_ids(values: torch.Tensor) -> npt.NDArray[np.int64]:
    """Ids as a numpy array; no torch call for a CPU tensor (each would let go of the GIL)."""
    return (values if values.device.type == "cpu" else values.cpu()).numpy()


class _PushSink:
    """Called by autograd with one step's row gradients; its lifetime is the step's graph."""

    __slots__ = ("module", "step", "seq", "names", "unique", "pushed", "__weakref__")

    def __init__(
        self,
        module: DistributedEmbedding,
        step: int,
        seq: int | None,
        names: list[str],
        unique: list[TablePlan],
        pushed: list[bool],
    ) -> None:
        self.module, self.step, self.seq, self.names, self.unique, self.pushed = (
            module,
            step,
            seq,
            names,
            unique,
            pushed,
        )

    def __call__(self, grads: TableGrads | Callable[[], TableGrads]) -> None:
        self.pushed[0] = True
        self.module._push(self.step, self.seq, self.names, self.unique, grads)
