"""What the PSClient unit tests share: three real ``Shard``s of ``N`` behind
``tests.fakes.InProcessTransport`` (the fixtures ``shards``, ``transport`` and ``ps`` are
in this folder's conftest), fast retries, and the rows a shard would hold."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from client import (
    ClientConfig,
)
from ps.shard import Shard
from ps.table import TableSpec
from ps.table.initializers import initial_rows
from tests.fakes import InProcessTransport

F32 = npt.NDArray[np.float32]
N = 3
DIM = 4
# Fast retries: the backoff sleeps stay in the milliseconds.
FAST = ClientConfig(backoff_initial_s=0.001, backoff_max_s=0.002, tune_malloc=False)
KEYS = np.concatenate([np.arange(-50, 250), [2**63 - 1, -(2**63)]]).astype(np.int64)


def addresses(n: int = N) -> list[str]:
    return [f"inproc:{i}" for i in range(n)]


def spec_of(shards: list[Shard], table: str = "t") -> TableSpec:
    return shards[0].table(table).spec


def initial(spec: TableSpec, keys: npt.ArrayLike) -> F32:
    return initial_rows(spec.initializer, spec.seed, keys, spec.dim)


def stored_keys(shard: Shard, table: str = "t") -> list[int]:
    return sorted(shard.table(table).export().keys.tolist())


def requests_per_shard(transport: InProcessTransport, method: str) -> list[int]:
    return [transport.count(method, s) for s in range(N)]
