"""Running the parameter server: local shard processes and serving replicas, ``ps-launch``,
``ps-admin`` (the Kubernetes manifests are in ``deploy/k8s``)."""

from __future__ import annotations

import protos  # noqa: F401 -- first: it sets gRPC's log level before gRPC loads (protos/__init__.py)
from deploy.local import LocalCluster, ShardProcess, ShardStartError
from deploy.replicas import ServingReplicas

__all__ = ["LocalCluster", "ServingReplicas", "ShardProcess", "ShardStartError"]
