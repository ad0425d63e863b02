"""Values too rare to learn from: which keys of a feature share the feature's rare row.

Values found in fewer than ``min_count`` training rows, and values training never saw, are read
by the embeddings as one key per feature, ``rare_key(feature)``: one row trained on all of
them, instead of a row each that can only memorise its few labels or was never trained. The
first-order weights (the dim-1 table ``wide``) keep every value, as a hashed logistic
regression does: one weight learns from a few rows, where a dot product of two rarely trained
vectors is mostly noise (measured by ``benchmarks/quality_cv.py`` on every fifth of the Avazu
and MovieLens samples: sharing rare values in both tables fell up to 0.018 AUC below the hashed
LR on some fifths, sharing them in neither let DeepFM's pairwise term fall 0.038 below it).

Training keeps a log's keys as read and maps each batch as it goes to a table
(``RareValues.ids``); the predictor maps a request's keys with the same ``share_rare``.

Example:
    >>> vocab = {"C1": np.array([3, 7])}
    >>> RareValues(2, vocab).keys("C1", np.array([3, 4, 7])).tolist() == [3, rare_key("C1"), 7]
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from protos.keys import hash_feature
from worker.jagged import JaggedIds
from worker.schema import feature_seed

__all__ = ["RareValues", "rare_key", "share_rare"]

I64 = npt.NDArray[np.int64]


def rare_key(feature: str) -> int:
    """The key ``feature``'s rare values share (a value no text field holds, hashed with
    the feature's default seed).

    >>> rare_key("C1") == hash_feature(b"\\0rare", feature_seed("C1"))
    True
    """
    return hash_feature(b"\0rare", feature_seed(feature))


def share_rare(keys: I64, vocabulary: I64, rare: int) -> I64:
    """``keys`` with every key outside ``vocabulary`` (sorted) replaced by ``rare``; a new array.

    >>> share_rare(np.array([5, 1, 9]), np.array([1, 5]), -1).tolist()
    [5, 1, -1]
    """
    if vocabulary.shape[0] == 0:
        return np.full_like(keys, rare)
    at = np.minimum(np.searchsorted(vocabulary, keys), vocabulary.shape[0] - 1)
    out: I64 = np.where(vocabulary[at] == keys, keys, np.int64(rare))
    return out


class _Counted(Protocol):
    def frequent_keys(self, min_count: int) -> dict[str, I64]: ...


@dataclass(frozen=True)
class RareValues:
    """The training vocabulary of each feature (sorted keys found in at least ``min_count``
    training rows); any other key of a feature is read as ``rare_key(feature)``."""

    min_count: int
    vocabulary: Mapping[str, I64]

    @classmethod
    def counted(cls, rows: _Counted, min_count: int) -> RareValues | None:
        """The vocabulary of ``rows`` (a ``ClickLog``); None when ``min_count`` is 1 (every value keeps its row)."""
        return cls(min_count, rows.frequent_keys(min_count)) if min_count > 1 else None

    def keys(self, feature: str, keys: I64) -> I64:
        """``keys`` of ``feature`` as the embeddings read them (a feature without a vocabulary: unchanged)."""
        vocabulary = self.vocabulary.get(feature)
        return keys if vocabulary is None else share_rare(keys, vocabulary, rare_key(feature))

    def ids(self, feature: str, ids: JaggedIds) -> JaggedIds:
        """``ids`` of ``feature`` as the embeddings read them."""
        if feature not in self.vocabulary:
            return ids
        values = torch.from_numpy(self.keys(feature, ids.values.numpy()))
        return JaggedIds(values, ids.offsets, ids.weights)

    def rare_keys(self) -> dict[str, int]:
        """Every feature's rare key."""
        return {f: rare_key(f) for f in self.vocabulary}
