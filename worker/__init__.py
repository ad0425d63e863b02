"""Training and inference in torch with embeddings on parameter-server shards."""

from __future__ import annotations

from worker.config import EmbeddingTableConfig, FeatureConfig
from worker.embedding import DistributedEmbedding
from worker.jagged import JaggedIds

__all__ = ["DistributedEmbedding", "EmbeddingTableConfig", "FeatureConfig", "JaggedIds"]
