"""The sparse tables in a model's ``state_dict``: ``torch.distributed.checkpoint`` saves them
with the dense model, and loads them into a cluster of any size.

A module's tables are its *extra state* (``nn.Module.get_extra_state``): the entry
``<prefix>._extra_state`` of ``model.state_dict()``. Before it is saved that entry is a
``TablesState``: asking for the state dict flushes the module's pushes, and nothing more. When
the entry is serialized (DCP's ``save``, or ``torch.save``), the shards write a checkpoint of
their own (``AdminClient.checkpoint``: a consistent cut, hard links, no row through the worker),
and what is stored is a ``SavedTables``: that checkpoint's name, the shard count that wrote it,
and the tables' specs. ``load_state_dict`` of a state dict holding a ``SavedTables`` has every
shard load those rows (``AdminClient.load_checkpoint``), whatever the cluster's size now: a
shard reads every part under its checkpoint root, so the shards must share a root (or each
root must hold a copy of the checkpoint) when the count changes. With ``torch.distributed``
started, rank 0 loads and every rank waits for it.

``torchrec_state_dict`` exports tables small enough as TorchRec's own
``EmbeddingBagCollection`` state dict (``embedding_bags.<table>.weight``, one row per id in
``[0, num_embeddings)``), to go back to a local TorchRec model or its inference path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from google.protobuf import json_format

from client import PSClient
from client.tables import table_spec
from worker.config import EmbeddingTableConfig

__all__ = ["SavedTables", "TablesState", "load_tables", "torchrec_state_dict"]


@dataclass(frozen=True)
class SavedTables:
    """A module's tables as a checkpoint holds them: the shards' checkpoint ``checkpoint``,
    written by ``num_shards`` shards, and each table's spec (as JSON) when it was written."""

    checkpoint: str
    num_shards: int
    tables: dict[str, dict[str, Any]]


class TablesState:
    """The state-dict entry of tables not saved yet: serializing it has the shards write a
    checkpoint (once), and stores the ``SavedTables`` that names it."""

    def __init__(self, client: PSClient, tables: Sequence[EmbeddingTableConfig]) -> None:
        self._client, self._tables = client, list(tables)
        self._saved: SavedTables | None = None

    def save(self) -> SavedTables:
        """Have the shards write the checkpoint (the first time); what names it."""
        if self._saved is None:
            answers = self._client.admin.checkpoint()
            specs = {t.name: json_format.MessageToDict(_spec(t)) for t in self._tables}
            self._saved = SavedTables(str(answers[0]["name"]), len(answers), specs)
        return self._saved

    def __reduce__(self) -> tuple[type[SavedTables], tuple[Any, ...]]:
        return SavedTables, astuple(self.save())


def _spec(t: EmbeddingTableConfig) -> Any:
    return table_spec(t.name, t.dim, **t.options())


def load_tables(client: PSClient, tables: Sequence[EmbeddingTableConfig], state: object) -> None:
    """Load ``state`` (a state-dict entry) into the shards: a ``SavedTables`` is loaded; a
    ``TablesState`` never saved is this process's own, whose rows the shards hold already.
    ``ValueError`` naming what does not match."""
    if isinstance(state, TablesState):
        return
    if not isinstance(state, SavedTables):
        raise ValueError(f"sparse tables: the state dict holds {type(state).__name__}, not a saved PS module's tables")
    names = [t.name for t in tables]
    missing = [n for n in names if n not in state.tables]
    if missing:
        raise ValueError(
            f"sparse tables: checkpoint {state.checkpoint!r} holds tables {sorted(state.tables)}, not {missing}"
        )
    for t in tables:
        if json_format.MessageToDict(_spec(t)) != state.tables[t.name]:
            raise ValueError(
                f"sparse tables: table {t.name!r} was saved as {state.tables[t.name]}, the module has "
                f"{json_format.MessageToDict(_spec(t))}: build the module with the configs it was saved with"
            )
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        client.admin.load_checkpoint(state.checkpoint, state.num_shards, names)
    if distributed:
        dist.barrier()


def torchrec_state_dict(
    client: PSClient, configs: Sequence[Any], prefix: str = "", *, max_rows: int = 10_000_000
) -> dict[str, torch.Tensor]:
    """TorchRec's ``EmbeddingBagCollection`` state dict of ``configs``' tables: every id in
    ``[0, num_embeddings)`` looked up (an id never trained reads its initial row, which the
    training shards create). ``ValueError`` for a table over ``max_rows``."""
    big = [c.name for c in configs if c.num_embeddings > max_rows]
    if big:
        raise ValueError(f"tables {big}: over max_rows={max_rows:,} rows: too large to export as dense weights")
    out = {}
    for c in configs:
        rows = client.lookup_many({c.name: np.arange(c.num_embeddings, dtype=np.int64)})[c.name]
        out[f"{prefix}embedding_bags.{c.name}.weight"] = torch.from_numpy(rows)
    return out
