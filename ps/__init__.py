"""One parameter-server shard: tables of embedding rows, their optimizers, and the gRPC server.

Run it with ``ps-server`` (or ``python -m ps``); embed it with ``build_server``.
Never imports ``client``, ``worker`` or torch.

The shard is built in wings, each a subpackage entered through its ``__init__`` (its door),
each building on the ones before it:

* ``store``: rows as they travel and are stored, element types, the data dir and RocksDB;
* ``table``: one table: spec, key index, RAM and disk halves, optimizers, exactly-once ledgers;
* ``durability``: when pushes reach disk, checkpoints, rescue dumps;
* ``replication``: the change log, the ``Follow`` stream, a serving shard's source of rows;
* ``elastic``: the cluster map and live resharding;
* ``shard``: ``Shard``, which composes them: tables by name, mode, memory budget, upkeep;
* ``service``: the gRPC face: settings, servicer, server, ``Stats`` and metrics.

Beside them, ``errors`` (a failure, its status code), ``rwlock`` and ``yielding`` serve every wing.
"""

from __future__ import annotations

import protos  # noqa: F401 -- first: it sets gRPC's log level before gRPC loads (protos/__init__.py)
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
from ps.service import PSServer, ServerConfig, build_server, load_config
from ps.shard import Shard
from ps.table import InitializerKind, InitializerParams, OptimizerKind, OptimizerParams, Table, TableSpec

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
