"""Training and inference in torch with embeddings on parameter-server shards."""

from __future__ import annotations

import protos  # noqa: F401 -- first: it sets gRPC's log level before gRPC loads (protos/__init__.py)
from worker.config import EmbeddingTableConfig, FeatureConfig
from worker.embedding import DistributedEmbedding
from worker.jagged import JaggedIds
from worker.predictor import Predictor

# worker.serving (ps-infer, PredictClient) is not imported here: ``python -m worker.serving``
# runs it as a script.
__all__ = ["DistributedEmbedding", "EmbeddingTableConfig", "FeatureConfig", "JaggedIds", "Predictor"]
