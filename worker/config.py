"""What a model's embeddings are: tables (created on the shards) and the features that read them.

Example:
    >>> user = EmbeddingTableConfig("user", dim=16, optimizer="adagrad", params={"lr": 0.05})
    >>> FeatureConfig("user_id", table="user", pooling="sum").table
    'user'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["EmbeddingTableConfig", "FeatureConfig", "Pooling", "check_features"]

Pooling = Literal["sum", "mean", "none"]


@dataclass(frozen=True)
class EmbeddingTableConfig:
    """A table to create on every shard (see ``PSClient.create_table`` for the options).

    ``optimizer``/``initializer`` None and absent ``params`` take the shards' defaults.
    """

    name: str
    dim: int
    optimizer: str | None = None
    initializer: str | None = None
    seed: int = 0
    params: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim={self.dim}, must be >= 1")


@dataclass(frozen=True)
class FeatureConfig:
    """A sparse input feature: its ids are keys of ``table``; ``pooling`` reduces each bag.

    ``sum``/``mean`` give ``[batch, dim]``; ``none`` gives the unpooled ``[num_ids, dim]`` rows.
    """

    name: str
    table: str
    pooling: Pooling = "sum"

    def __post_init__(self) -> None:
        if self.pooling not in ("sum", "mean", "none"):
            raise ValueError(f"feature {self.name!r}: pooling={self.pooling!r}, expected sum, mean or none")


def check_features(tables: Sequence[EmbeddingTableConfig], features: Sequence[FeatureConfig]) -> None:
    """Raise ``ValueError`` for duplicate names or a feature naming an unknown table."""
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"tables: duplicate names in {names}")
    fnames = [f.name for f in features]
    if len(set(fnames)) != len(fnames):
        raise ValueError(f"features: duplicate names in {fnames}")
    for f in features:
        if f.table not in names:
            raise ValueError(f"feature {f.name!r}: table {f.table!r} is not among the tables {names}")
