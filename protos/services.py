"""The names of the system's gRPC services, read from the ``.proto`` files, and of the
health-check services a shard reports besides its own.

Every process that serves or checks them (``ps-server``, ``ps-infer``, ``ps-admin health``,
Kubernetes probes) takes the names from here.

Example:
    >>> PS_SERVICE, PREDICT_SERVICE, WRITES_HEALTH
    ('ps.v1.ParameterServer', 'ps.v1.Predictor', 'ps.v1.ParameterServer.Writes')
"""

from __future__ import annotations

from protos import infer_pb2, ps_pb2

__all__ = ["BACKGROUND_HEALTH", "FOLLOW_HEALTH", "PREDICT_SERVICE", "PS_SERVICE", "SHARD_HEALTH", "WRITES_HEALTH"]

PS_SERVICE: str = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name
"""A shard's service (``ps-server``)."""

PREDICT_SERVICE: str = infer_pb2.DESCRIPTOR.services_by_name["Predictor"].full_name
"""``ps-infer``'s service."""

WRITES_HEALTH = PS_SERVICE + ".Writes"
"""NOT_SERVING while a training shard refuses writes (storage failed). A serving shard
(read-only by mode) does not have it: a check answers NOT_FOUND."""

FOLLOW_HEALTH = PS_SERVICE + ".Follow"
"""A following serving shard's: SERVING while its change stream is open and it is not
too far behind its training shard."""

BACKGROUND_HEALTH = PS_SERVICE + ".Background"
"""NOT_SERVING while a background loop of the shard (evictor, interval flush, TTL sweep,
storage recovery) is failing; ``Stats.failing_loops`` says which."""

SHARD_HEALTH = ("", PS_SERVICE, WRITES_HEALTH, BACKGROUND_HEALTH, FOLLOW_HEALTH)
"""Every health service name a shard may report ("": the server as a whole)."""
