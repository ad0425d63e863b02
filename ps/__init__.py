"""One parameter-server shard: tables of embedding rows, their optimizers, and the gRPC server.

Run it with ``ps-server`` (or ``python -m ps``); embed it with ``build_server``.
Never imports ``client``, ``worker`` or torch.
"""

from __future__ import annotations

from ps.config import ServerConfig, TableSpec, load_config
from ps.errors import (
    InvalidRequest,
    NotConfigured,
    OutOfCapacity,
    RequestTooLarge,
    ShardError,
    ShardMismatch,
    ShuttingDown,
    TableExists,
    UnknownTable,
    WrongMode,
    WrongShard,
)
from ps.initializers import InitializerKind, InitializerParams
from ps.optimizers import OptimizerKind, OptimizerParams
from ps.server import PSServer, build_server
from ps.shard import Shard
from ps.table import Table

__all__ = [
    "InitializerKind",
    "InitializerParams",
    "InvalidRequest",
    "NotConfigured",
    "OptimizerKind",
    "OptimizerParams",
    "OutOfCapacity",
    "PSServer",
    "RequestTooLarge",
    "ServerConfig",
    "Shard",
    "ShardError",
    "ShardMismatch",
    "ShuttingDown",
    "Table",
    "TableExists",
    "TableSpec",
    "UnknownTable",
    "WrongMode",
    "WrongShard",
    "build_server",
    "load_config",
]
