"""Running the parameter server: local shard processes and ``ps-launch`` (Kubernetes manifests come later)."""

from __future__ import annotations

from deploy.local import LocalCluster, ShardProcess, ShardStartError

__all__ = ["LocalCluster", "ShardProcess", "ShardStartError"]
