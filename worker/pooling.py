"""Sum pooling of every feature in one autograd node, with numba kernels, for pipelined training.

``pool_and_push(rows, features, sink, anchor)`` returns, per feature, the sum of its ids'
rows per sample, as ``F.embedding_bag(mode="sum")`` does. Backward calls ``sink`` once with
``fold``, a function that returns every table's row gradient: each feature's output
gradient added into its table's rows (ids in batch order, features in order). The push
calls ``fold`` on its own thread, so the training thread's backward only hands the output
gradients over. One node and one compiled loop per feature replace an ``embedding_bag``
backward per feature (which sorts the ids first) and the push node: on the DLRM
benchmark's 26 features x 4,096 ids, dim 16, that was 10 ms of a 68 ms step on the
training thread.

The additions are not in ``embedding_bag``'s order (that follows an unstable sort), so
the bits differ from it in the last place; runs stay reproducible. Sync mode, whose
contract is bit-parity with ``nn.EmbeddingBag``, keeps ``embedding_bag``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import numpy.typing as npt
import torch

__all__ = ["SumFeature", "TableGrads", "pool_and_push", "sum_pool"]

TableGrads = Sequence[torch.Tensor | None]
GradSink = Callable[[Callable[[], TableGrads]], None]


@dataclass(frozen=True)
class SumFeature:
    """One sum-pooled feature: its table's position in ``rows``, and its ids as positions into
    that table's rows, sample ``b`` owning ``index[offsets[b]:offsets[b + 1]]``."""

    table: int
    index: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int64]


# Run by the lookup thread (``sum_pool`` of a prefetched batch): letting go of the GIL
# leaves it to the training thread.
@numba.njit(cache=True, nogil=True)
def _pool(rows: Any, index: Any, offsets: Any, out: Any) -> None:  # pragma: no cover - compiled
    dim = rows.shape[1]
    for b in range(out.shape[0]):
        for d in range(dim):
            out[b, d] = 0.0
        for j in range(offsets[b], offsets[b + 1]):
            r = index[j]
            for d in range(dim):
                out[b, d] += rows[r, d]


# Run by the push thread (``fold``): letting go of the GIL leaves it to the training thread.
@numba.njit(cache=True, nogil=True)
def _scatter(grad: Any, index: Any, offsets: Any, out: Any) -> None:  # pragma: no cover - compiled
    dim = out.shape[1]
    for b in range(grad.shape[0]):
        for j in range(offsets[b], offsets[b + 1]):
            r = index[j]
            for d in range(dim):
                out[r, d] += grad[b, d]


class _PoolAndPush(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        rows: list[npt.NDArray[np.float32]],
        features: list[SumFeature],
        sink: GradSink,
        pooled: list[npt.NDArray[np.float32]] | None,
    ) -> tuple[torch.Tensor, ...]:
        ctx.rows_shapes, ctx.features, ctx.sink = [r.shape for r in rows], features, sink
        ctx.set_materialize_grads(False)  # an unused feature's gradient stays None: nothing to add
        return tuple(torch.from_numpy(p) for p in (pooled if pooled is not None else sum_pool(rows, features)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        # Autograd hands these gradients over and never writes to them again: keeping
        # them for a later fold is safe.
        ctx.sink(
            functools.partial(_fold, ctx.rows_shapes, ctx.features, [g if g is None else g.detach() for g in grads])
        )
        return None, None, None, None, None


def _fold(shapes: list[tuple[int, int]], features: list[SumFeature], grads: list[torch.Tensor | None]) -> TableGrads:
    """Per table, the sum of its features' output gradients at their ids' rows (None: no gradient)."""
    tables: list[npt.NDArray[np.float32] | None] = [None] * len(shapes)
    for f, g in zip(features, grads):
        if g is None:
            continue
        acc = tables[f.table]
        if acc is None:
            acc = tables[f.table] = np.zeros(shapes[f.table], dtype=np.float32)
        _scatter(np.ascontiguousarray(g.numpy(), dtype=np.float32), f.index, f.offsets, acc)
    return [None if t is None else torch.from_numpy(t) for t in tables]


def sum_pool(rows: Sequence[npt.NDArray[np.float32]], features: Sequence[SumFeature]) -> list[npt.NDArray[np.float32]]:
    """Per feature, the ``[batch, dim]`` sums of its ids' rows (``rows[t]``: table ``t``'s rows)."""
    out = []
    for f in features:
        pooled = np.empty((f.offsets.shape[0] - 1, rows[f.table].shape[1]), dtype=np.float32)
        _pool(rows[f.table], f.index, f.offsets, pooled)
        out.append(pooled)
    return out


def pool_and_push(
    rows: Sequence[npt.NDArray[np.float32]],
    features: Sequence[SumFeature],
    sink: GradSink,
    anchor: torch.Tensor,
    *,
    pooled: list[npt.NDArray[np.float32]] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per feature, ``[batch, dim]`` sums of its rows (CPU, float32). ``rows[t]`` is table ``t``'s
    ``[n, dim]`` looked-up rows. ``anchor`` is any tensor that requires grad: it ties the
    outputs into the graph (and gets no gradient), so ``sink`` runs in backward. ``sink``
    gets ``fold``: called (once, on any thread), it returns each table's row gradient.
    ``pooled``: the sums, made before (``sum_pool(rows, features)``, e.g. on another thread)."""
    out: tuple[torch.Tensor, ...] = _PoolAndPush.apply(anchor, list(rows), list(features), sink, pooled)  # type: ignore[no-untyped-call]
    return out
