"""``PSEmbeddingBagCollection`` and ``PSEmbeddingCollection``: TorchRec's embedding modules on the shards.

Each is what TorchRec's module of the same name is to a model (configs in, a
``KeyedJaggedTensor`` in, a ``KeyedTensor`` or per-feature ``JaggedTensor`` out), with the rows on
parameter-server shards: a ``DistributedEmbedding`` underneath looks up each batch's unique ids
(one RPC per shard) and pushes their gradients in backward, where the shards' optimizer applies
them. So a TorchRec model switches by changing the line that builds its embedding module; its
dense parameters train as before, and the sparse ones are not among ``parameters()``.

Example (needs running shards; see docs/guides/torchrec.md):
    ebc = PSEmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t_user", embedding_dim=16, num_embeddings=10**6, feature_names=["user"])],
        client=PSClient(addresses),
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
    )
    pooled = ebc(kjt)  # KeyedTensor: pooled["user"] is [batch, 16]
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig, JaggedTensor, KeyedJaggedTensor, KeyedTensor
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, EmbeddingCollectionInterface

from client import PSClient
from worker.embedding import DistributedEmbedding, Mode
from worker.jagged import JaggedIds
from worker.torchrec.checkpoint import TablesState, load_tables, torchrec_state_dict
from worker.torchrec.configs import output_names, shard_tables

__all__ = ["PSEmbeddingBagCollection", "PSEmbeddingCollection"]

_PREFETCH_DEPTH = 8  # KJTs handed to prefetch() whose forward has not come yet


class _Embeddings:
    """What both modules share: the ``DistributedEmbedding``, and a KJT read as its batch."""

    def __init__(
        self,
        configs: Sequence[EmbeddingBagConfig | EmbeddingConfig],
        client: PSClient,
        fused_params: Mapping[str, Any] | None,
        *,
        pooled: bool,
        weighted: bool,
        mode: Mode,
        staleness: int,
        device: torch.device | str | None,
        seed: int,
        check_ids: bool,
    ) -> None:
        tables, features = shard_tables(configs, fused_params, seed, pooled=pooled)
        self.device = torch.device(device if device is not None else "cpu")
        self.embedding = DistributedEmbedding(
            tables, features, client, mode=mode, staleness=staleness, device=self.device
        )
        # Tables exist once the module does, as TorchRec allocates its tables at construction.
        self.embedding.create_tables()
        self.weighted = weighted
        self.check_ids = check_ids
        self.names = [n for names in output_names(configs) for n in names]
        self.client = client
        self.tables = tables
        # Per output: the KJT key it reads, and its table's config; the keys read, in order.
        self.reads = [(f, c) for c in configs for f in c.feature_names]
        self.keys = list(dict.fromkeys(f for f, _ in self.reads))
        self._known = frozenset(self.keys)
        self._ahead: deque[tuple[KeyedJaggedTensor, dict[str, JaggedIds]]] = deque(maxlen=_PREFETCH_DEPTH)

    def batch(self, kjt: KeyedJaggedTensor) -> dict[str, JaggedIds]:
        """The ids of each output, from ``kjt`` (the same dict for a KJT given to ``prefetch``)."""
        for i, (seen, batch) in enumerate(self._ahead):
            if seen is kjt:
                del self._ahead[i]
                return batch
        return self._read(kjt)

    def prefetch(self, kjt: KeyedJaggedTensor) -> None:
        batch = self._read(kjt)
        self._ahead.append((kjt, batch))
        self.embedding.prefetch(batch)

    def _read(self, kjt: KeyedJaggedTensor) -> dict[str, JaggedIds]:
        if not isinstance(kjt, KeyedJaggedTensor):
            raise TypeError(f"features: expected a KeyedJaggedTensor, got {type(kjt).__name__}")
        if kjt.variable_stride_per_key():
            raise ValueError("features: a KeyedJaggedTensor with a batch size per key is not supported")
        keys = kjt.keys()
        index = {k: i for i, k in enumerate(keys)}
        missing = [k for k in self.keys if k not in index]
        extra = [k for k in keys if k not in self._known]
        if missing or extra:
            raise ValueError(
                f"features: KeyedJaggedTensor keys {keys}: no key for {missing} (read by the tables), "
                f"no table reads {extra}; the tables read {self.keys}"
                if missing
                else f"features: no table reads the KeyedJaggedTensor key(s) {extra}; the tables read {self.keys}"
            )
        weights = kjt.weights_or_none()
        if self.weighted and weights is None:
            raise ValueError(
                "features: the module is weighted (is_weighted=True) but the KeyedJaggedTensor has no weights"
            )
        stride = kjt.stride()
        values = kjt.values().to("cpu", torch.int64)
        offsets = kjt.offsets().to("cpu", torch.int64)
        weights = None if weights is None or not self.weighted else weights.to("cpu", torch.float32)
        by_key: dict[str, JaggedIds] = {}
        for key in self.keys:
            i = index[key]
            o = offsets[i * stride : (i + 1) * stride + 1]
            lo, hi = int(o[0]), int(o[-1])
            by_key[key] = JaggedIds(values[lo:hi], o - lo, None if weights is None else weights[lo:hi])
        if self.check_ids:
            for key, c in self.reads:
                ids = by_key[key].values
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= c.num_embeddings):
                    bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                    raise ValueError(
                        f"feature {key!r}: id {bad} outside [0, {c.num_embeddings}) of table {c.name!r} "
                        "(check_ids=True checks ids against num_embeddings)"
                    )
        return {name: by_key[key] for name, (key, _) in zip(self.names, self.reads)}


class _OnShards:
    """What both modules do alike, through their ``_Embeddings``: prefetching, flushing, closing,
    and the tables as the module's extra state."""

    _e: _Embeddings

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Start looking up ``features`` for a later ``forward(features)`` (the same object)."""
        self._e.prefetch(features)

    @property
    def device(self) -> torch.device:
        return self._e.device

    @property
    def embedding(self) -> DistributedEmbedding:
        """The ``DistributedEmbedding`` underneath."""
        return self._e.embedding

    def flush(self) -> None:
        """Block until every push so far is applied on the shards."""
        self.embedding.flush()

    def get_extra_state(self) -> TablesState:
        """The tables' entry of ``state_dict()`` (``worker.torchrec.checkpoint``); flushes pushes."""
        self.flush()
        return TablesState(self._e.client, self._e.tables)

    def set_extra_state(self, state: object) -> None:
        """Load the tables a saved state dict names into the shards (``worker.torchrec.checkpoint``)."""
        load_tables(self._e.client, self._e.tables, state)

    def close(self) -> None:
        """Flush and stop the background threads (the client stays open)."""
        self.embedding.close()


class PSEmbeddingBagCollection(_OnShards, EmbeddingBagCollectionInterface):  # type: ignore[misc]  # TorchRec is untyped
    """TorchRec's ``EmbeddingBagCollection`` with its tables on the shards.

    ``tables``: ``EmbeddingBagConfig``s (``worker.torchrec.configs`` says how each field maps);
    ``fused_params``: FBGEMM's optimizer keys (default row-wise Adagrad, lr 0.01); ``mode``:
    ``"pipelined"`` (lookups ahead, pushes behind, ``staleness`` steps) or ``"sync"`` (each step's
    push applied before the next lookup: bit-exact with TorchRec's own module trained by the same
    optimizer); ``is_weighted``: pool with the KJT's weights; ``check_ids``: refuse ids outside
    ``[0, num_embeddings)``, as TorchRec's row space is (otherwise any int64 id is a key of its own).

    ``forward(kjt)`` returns a ``KeyedTensor`` of ``[batch, sum of dims]``, keys in table order.
    Call ``prefetch(next_kjt)`` to overlap the next lookup with this step (pipelined mode), and
    ``flush()`` before reading rows elsewhere. Errors in the configs or the KJT are ``ValueError``s
    naming the table or the feature.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        client: PSClient,
        fused_params: Mapping[str, Any] | None = None,
        mode: Mode = "pipelined",
        *,
        is_weighted: bool = False,
        staleness: int = 1,
        device: torch.device | str | None = None,
        seed: int = 0,
        check_ids: bool = False,
    ) -> None:
        super().__init__()
        self._configs = list(tables)
        self._is_weighted = is_weighted
        self._e = _Embeddings(
            self._configs,
            client,
            fused_params,
            pooled=True,
            weighted=is_weighted,
            mode=mode,
            staleness=staleness,
            device=device,
            seed=seed,
            check_ids=check_ids,
        )
        self._dims = [c.embedding_dim for c in self._configs for _ in c.feature_names]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        pooled = self.embedding(self._e.batch(features))
        values = torch.cat([pooled[n] for n in self._e.names], dim=1)
        return KeyedTensor(keys=self._e.names, length_per_key=self._dims, values=values)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def torchrec_state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The tables as TorchRec's own ``EmbeddingBagCollection`` state dict, for tables small
        enough (``worker.torchrec.checkpoint.torchrec_state_dict``)."""
        self.flush()
        return torchrec_state_dict(self._e.client, self._configs, prefix)


class PSEmbeddingCollection(_OnShards, EmbeddingCollectionInterface):  # type: ignore[misc]  # TorchRec is untyped
    """TorchRec's ``EmbeddingCollection`` (unpooled rows, for sequence features) on the shards.

    ``forward(kjt)`` returns ``{output name: JaggedTensor}``: each id's row, ``[ids, dim]``, with
    the KJT's lengths. Options as ``PSEmbeddingBagCollection``'s; every table has the same
    ``embedding_dim``, as TorchRec requires.
    """

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        client: PSClient,
        fused_params: Mapping[str, Any] | None = None,
        mode: Mode = "pipelined",
        *,
        need_indices: bool = False,
        staleness: int = 1,
        device: torch.device | str | None = None,
        seed: int = 0,
        check_ids: bool = False,
    ) -> None:
        super().__init__()
        dims = {c.embedding_dim for c in tables}
        if len(dims) > 1:
            named = ", ".join(f"{c.name}: {c.embedding_dim}" for c in tables)
            raise ValueError(f"tables: embedding_dim differs ({named}); an EmbeddingCollection needs one dim")
        self._configs = list(tables)
        self._need_indices = need_indices
        self._e = _Embeddings(
            self._configs,
            client,
            fused_params,
            pooled=False,
            weighted=False,
            mode=mode,
            staleness=staleness,
            device=device,
            seed=seed,
            check_ids=check_ids,
        )
        self._dim = next(iter(dims)) if dims else 0

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        batch = self._e.batch(features)
        rows = self.embedding(batch)
        return {
            n: JaggedTensor(
                values=rows[n],
                lengths=batch[n].lengths().to(self._e.device),
                weights=batch[n].values.to(self._e.device) if self._need_indices else None,
            )
            for n in self._e.names
        }

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._dim

    def embedding_names_by_table(self) -> list[list[str]]:
        return output_names(self._configs)
