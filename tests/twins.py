"""Local twins of optimizers torch does not have, for parity tests against the shards.

``rowwise_adagrad_step`` is row-wise Adagrad (``ps.table.optimizers``, ``ROWWISE_ADAGRAD``)
written out in numpy float32 operations in the kernel's order, so it matches the shards bit for
bit; ``RowwiseAdagrad`` runs it as a ``torch.optim.Optimizer`` over dense embedding weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

F32 = npt.NDArray[np.float32]


def rowwise_adagrad_step(
    values: F32, acc: F32, slots: npt.NDArray[np.int64], grads: F32, *, lr: float, eps: float, weight_decay: float = 0
) -> None:
    """One push of ``grads`` (one row per slot) onto ``values`` and ``acc`` ([rows, 1]), in place."""
    f = np.float32
    wd = f(weight_decay)
    p = values[slots]
    g = grads if wd == 0 else grads + wd * p
    square = np.zeros(len(slots), np.float32)
    for j in range(values.shape[1]):  # column order, one rounding per operation
        square = square + g[:, j] * g[:, j]
    a = acc[slots, 0] + square / f(values.shape[1])
    acc[slots, 0] = a
    step = f(lr) / (np.sqrt(a) + f(eps))
    keep = f(1) - step * wd if wd != 0 else np.ones_like(step)
    values[slots] = keep[:, None] * p - grads * step[:, None]


class RowwiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad over dense ``[rows, dim]`` weights, updating the rows whose gradient is
    not all zero (the rows a batch looked up, as a push names them; without weight decay a
    looked-up row with a zero gradient would not change either)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                acc = self.state[p].setdefault("acc", np.zeros((p.shape[0], 1), np.float32))
                grad = p.grad.numpy()
                slots = np.flatnonzero(np.abs(grad).sum(1) > 0)
                values = p.numpy()
                rowwise_adagrad_step(
                    values, acc, slots, np.ascontiguousarray(grad[slots]), lr=group["lr"], eps=group["eps"]
                )
