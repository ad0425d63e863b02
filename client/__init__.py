"""Talking to a parameter-server cluster: ``PSClient`` (lookups and pushes), ``AdminClient``
(tables, stats, checkpoints), ``PredictClient`` (``ps-infer``), and their errors, all
``PSError``. Never imports torch."""

from __future__ import annotations

import protos  # noqa: F401 -- first: it sets gRPC's log level before gRPC loads (protos/__init__.py)
from client.admin import AdminClient, CheckpointError, ShardByAddress
from client.client import LookupResult, PSClient, PushResult
from client.config import ClientConfig, TableConfig
from client.errors import (
    DeadlineExceededError,
    InternalServerError,
    InvalidRequestError,
    PermissionDeniedError,
    PreconditionError,
    PSError,
    ResourceExhaustedError,
    ShardUnavailableError,
    TableExistsError,
    TableNotFoundError,
    UnauthenticatedError,
    WrongShardError,
)
from client.predict import PredictClient, PredictError
from client.replicas import parse_addresses
from client.routing import TablePlan
from client.transport import GrpcTransport, Transport

__all__ = [
    "AdminClient",
    "CheckpointError",
    "ClientConfig",
    "DeadlineExceededError",
    "GrpcTransport",
    "InternalServerError",
    "InvalidRequestError",
    "LookupResult",
    "PSClient",
    "PSError",
    "PermissionDeniedError",
    "PreconditionError",
    "PredictClient",
    "PredictError",
    "PushResult",
    "ResourceExhaustedError",
    "ShardByAddress",
    "ShardUnavailableError",
    "TableConfig",
    "TableExistsError",
    "TableNotFoundError",
    "TablePlan",
    "Transport",
    "UnauthenticatedError",
    "WrongShardError",
    "parse_addresses",
]
