"""``JaggedIds``: the ids of one sparse feature for a batch, as values + offsets.

Sample ``i`` owns ``values[offsets[i]:offsets[i+1]]`` (possibly none), with optional
per-id ``weights`` of the same length as ``values``. This is the input layout of
``torch.nn.EmbeddingBag`` (``input`` + ``offsets`` + ``per_sample_weights``), with
the end offset included so that the batch size is explicit.

Example:
    >>> j = JaggedIds.from_lists([[3, 4], [], [5]])
    >>> j.batch_size, j.values.tolist(), j.offsets.tolist(), j.lengths().tolist()
    (3, [3, 4, 5], [0, 2, 2, 3], [2, 0, 1])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["JaggedIds"]


@dataclass(frozen=True)
class JaggedIds:
    """Jagged int64 ids of one feature for a batch (see the module docstring).

    Validated on construction; raises ``ValueError`` naming the field. Tensors are
    not copied: the caller must not modify them afterwards.
    """

    values: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        v, o, w = self.values, self.offsets, self.weights
        if v.dim() != 1 or v.dtype != torch.int64:
            raise ValueError(f"values: {v.dtype}{list(v.shape)}, expected a 1-D int64 tensor")
        if o.dim() != 1 or o.dtype != torch.int64 or o.numel() < 1:
            raise ValueError(f"offsets: {o.dtype}{list(o.shape)}, expected a 1-D int64 tensor of batch_size + 1")
        if int(o[0]) != 0 or int(o[-1]) != v.numel():
            raise ValueError(
                f"offsets: must start at 0 and end at len(values)={v.numel()}, got {int(o[0])}..{int(o[-1])}"
            )
        if o.numel() > 1 and bool((o[1:] < o[:-1]).any()):
            raise ValueError("offsets: must be non-decreasing")
        if w is not None and (w.dim() != 1 or w.numel() != v.numel() or not w.is_floating_point()):
            raise ValueError(f"weights: {w.dtype}{list(w.shape)}, expected float [{v.numel()}] like values")

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> torch.Tensor:
        """Ids per sample, int64 ``[batch_size]``."""
        return self.offsets[1:] - self.offsets[:-1]

    @classmethod
    def from_lists(cls, ids: Sequence[Sequence[int]], weights: Sequence[Sequence[float]] | None = None) -> JaggedIds:
        """From one list of ids per sample (for tests and small inputs)."""
        lengths = torch.tensor([len(x) for x in ids], dtype=torch.int64)
        values = torch.tensor([k for x in ids for k in x], dtype=torch.int64)
        w = None if weights is None else torch.tensor([v for x in weights for v in x], dtype=torch.float32)
        return cls.from_lengths(values, lengths, w)

    @classmethod
    def from_lengths(
        cls, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None
    ) -> JaggedIds:
        """From values and the number of ids of each sample."""
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths.to(torch.int64), 0, out=offsets[1:])
        return cls(values, offsets, weights)

    def to(self, device: torch.device | str) -> JaggedIds:
        """The same ids on ``device``."""
        return JaggedIds(
            self.values.to(device), self.offsets.to(device), None if self.weights is None else self.weights.to(device)
        )
