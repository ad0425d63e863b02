"""Running the parameter server: a local multi-shard launcher (Kubernetes manifests come later)."""

from __future__ import annotations

from deploy.local import LocalCluster, ShardProcess, ShardStartError

__all__ = ["LocalCluster", "ShardProcess", "ShardStartError"]
