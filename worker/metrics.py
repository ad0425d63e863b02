"""Evaluation metrics: ``auc`` (ROC, by ranks) and ``logloss``, numpy only.

Example:
    >>> auc([0, 1, 0, 1], [0.1, 0.9, 0.3, 0.2])
    0.75
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["auc", "logloss"]

F64 = npt.NDArray[np.float64]


def _flat(x: npt.ArrayLike | torch.Tensor, name: str) -> F64:
    a = np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float64).reshape(-1)
    if not np.isfinite(a).all():
        raise ValueError(f"{name}: contains NaN or Inf")
    return a


def auc(labels: npt.ArrayLike | torch.Tensor, scores: npt.ArrayLike | torch.Tensor) -> float:
    """ROC AUC by ranks (Mann-Whitney U), tied scores sharing their average rank.

    ``labels`` are 0/1; ``scores`` any finite reals of the same length. O(n log n),
    numpy only. Raises ``ValueError`` for mismatched lengths, non-0/1 labels, NaN, or
    when only one class is present (AUC is undefined).

    >>> auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]), auc([0, 1], [0.5, 0.5])
    (0.75, 0.5)
    """
    y, s = _flat(labels, "labels"), _flat(scores, "scores")
    if y.shape != s.shape or not np.isin(y, (0.0, 1.0)).all():
        raise ValueError(f"labels: {y.shape[0]} values, scores: {s.shape[0]}; labels must be 0/1")
    pos = y == 1.0
    npos, nneg = int(pos.sum()), int(y.shape[0] - pos.sum())
    if npos == 0 or nneg == 0:
        raise ValueError(f"AUC undefined with {npos} positives and {nneg} negatives")
    order = np.argsort(s, kind="stable")
    ss = s[order]
    first = np.concatenate(([True], ss[1:] != ss[:-1]))
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], ss.shape[0])
    ranks = np.empty_like(s)
    ranks[order] = ((starts + ends + 1) / 2.0)[np.cumsum(first) - 1]  # 1-based average rank of each tie group
    return float((ranks[pos].sum() - npos * (npos + 1) / 2.0) / (npos * nneg))


def logloss(labels: npt.ArrayLike | torch.Tensor, probs: npt.ArrayLike | torch.Tensor, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy, probabilities clipped to ``[eps, 1 - eps]``.

    Raises ``ValueError`` for mismatched lengths, an empty input, or NaN.

    >>> round(logloss([1, 0], [0.9, 0.2]), 4)
    0.1643
    """
    y, p = _flat(labels, "labels"), np.clip(_flat(probs, "probs"), eps, 1.0 - eps)
    if y.shape != p.shape or y.shape[0] == 0:
        raise ValueError(f"labels: {y.shape[0]} values, probs: {p.shape[0]}; need equal, non-empty")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))
