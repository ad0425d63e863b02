"""The cluster map a shard routes by and live resharding: the checks every request passes,
the phases of a reshard, and the rows that move out of an old owner and into a new one.
"""

from __future__ import annotations

from ps.elastic.cluster import ClusterMap, MoveState, Route
from ps.elastic.intake import grpc_identify, grpc_move_stream
from ps.elastic.moveout import move_batches
from ps.elastic.reshard import Reshard, ReshardParts, ReshardSettings

__all__ = [
    "ClusterMap",
    "MoveState",
    "Reshard",
    "ReshardParts",
    "ReshardSettings",
    "Route",
    "grpc_identify",
    "grpc_move_stream",
    "move_batches",
]
