"""Dense parts of common recommendation models, on top of pooled embeddings.

Each model takes ``dense`` features ``[B, num_dense]`` and the pooled embeddings
``{feature: [B, dim]}`` (all the same ``dim``) and returns logits ``[B]``. The
embeddings themselves come from a ``DistributedEmbedding`` (or, for comparison, from
local ``nn.EmbeddingBag``s): these modules hold only dense parameters, so they are
what ``DistributedDataParallel`` wraps.

Example:
    >>> m = DLRM(num_dense=3, features=["a", "b"], dim=4, bottom=[8], top=[8])
    >>> m(torch.zeros(2, 3), {"a": torch.zeros(2, 4), "b": torch.zeros(2, 4)}).shape
    torch.Size([2])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = ["DLRM", "DeepFM", "mlp"]


def mlp(sizes: Sequence[int], *, last_relu: bool = False) -> nn.Sequential:
    """Linear layers ``sizes[0] -> ... -> sizes[-1]`` with ReLU between them."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM (Naumov et al., 2019): bottom MLP on dense features, pairwise dot products
    between it and every embedding, top MLP on the dots plus the bottom output."""

    def __init__(self, num_dense: int, features: Sequence[str], dim: int, bottom: Sequence[int] = (64, 32),
                 top: Sequence[int] = (64, 32)) -> None:  # fmt: skip
        super().__init__()
        self.features = list(features)
        # A log without dense columns (Avazu) has no bottom MLP: only embeddings interact.
        self.bottom = mlp([num_dense, *bottom, dim], last_relu=True) if num_dense else None
        n = len(self.features) + (1 if num_dense else 0)
        self.register_buffer("pairs", torch.triu_indices(n, n, offset=1), persistent=False)
        self.top = mlp([(dim if num_dense else 0) + n * (n - 1) // 2, *top, 1])

    def forward(self, dense: torch.Tensor, emb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        vectors = [emb[f] for f in self.features]
        x = self.bottom(dense) if self.bottom is not None else None
        stacked = torch.stack(([x] if x is not None else []) + vectors, dim=1)  # [B, n, dim]
        dots = torch.bmm(stacked, stacked.transpose(1, 2))  # [B, n, n]
        i, j = self.get_buffer("pairs")
        pairs = dots[:, i, j]
        out: torch.Tensor = self.top(torch.cat([x, pairs], dim=1) if x is not None else pairs).squeeze(1)
        return out


class DeepFM(nn.Module):
    """DeepFM (Guo et al., 2017): a factorization machine over the field embeddings (and
    a projection of the dense features) plus an MLP over their concatenation.

    The FM's first-order term uses a learned per-field linear map of each embedding, so
    no second table per feature is needed.
    """

    def __init__(self, num_dense: int, features: Sequence[str], dim: int, hidden: Sequence[int] = (64, 32)) -> None:
        super().__init__()
        self.features = list(features)
        self.dense_proj = nn.Linear(num_dense, dim) if num_dense else None
        n = len(self.features) + (1 if num_dense else 0)
        self.first_order = nn.Linear(n * dim, 1)
        self.deep = mlp([n * dim, *hidden, 1])

    def forward(self, dense: torch.Tensor, emb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        head = [self.dense_proj(dense)] if self.dense_proj is not None else []
        fields = torch.stack(head + [emb[f] for f in self.features], dim=1)  # [B, n, dim]
        flat = fields.flatten(1)
        # 0.5 * ((sum v)^2 - sum v^2): all pairwise dot products in O(n * dim).
        second = 0.5 * (fields.sum(1).pow(2) - fields.pow(2).sum(1)).sum(1)
        out: torch.Tensor = self.first_order(flat).squeeze(1) + second + self.deep(flat).squeeze(1)
        return out
