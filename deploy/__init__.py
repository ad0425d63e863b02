"""Running the parameter server: local shard processes and serving replicas, ``ps-launch``,
``ps-admin`` (the Kubernetes manifests are in ``deploy/k8s``)."""

from __future__ import annotations

from deploy.local import LocalCluster, ShardProcess, ShardStartError
from deploy.replicas import ServingReplicas

__all__ = ["LocalCluster", "ServingReplicas", "ShardProcess", "ShardStartError"]
