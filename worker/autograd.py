"""The bridge between torch autograd and the shards: rows in, gradients pushed in backward.

``rows_with_push(rows, on_backward)`` returns the looked-up row tensors as outputs of one
autograd node. When backward reaches it, it calls ``on_backward`` once with the gradient
of every table's rows (``None`` for a table that got none), so one push per step carries
all tables: one RPC per shard, as the forward lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["rows_with_push"]

GradSink = Callable[[Sequence[torch.Tensor | None]], None]


class _PushOnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, sink: GradSink, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.sink = sink
        # Unused tables get None instead of a zero gradient: nothing to push for them.
        ctx.set_materialize_grads(False)
        return tuple(r.view_as(r) for r in rows)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.sink(grads)
        # The row tensors are per-batch copies: their own .grad is never needed.
        return (None,) * (len(grads) + 1)


def rows_with_push(rows: Sequence[torch.Tensor], on_backward: GradSink) -> tuple[torch.Tensor, ...]:
    """``rows`` as differentiable tensors whose gradients go to ``on_backward`` (in backward).

    Each input must be a floating tensor; it is marked ``requires_grad``.
    """
    leaves = [r.requires_grad_() for r in rows]
    out: tuple[torch.Tensor, ...] = _PushOnBackward.apply(on_backward, *leaves)  # type: ignore[no-untyped-call]
    return out
