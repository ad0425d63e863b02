"""TorchRec's vocabulary in ours: ``EmbeddingBagConfig`` and FBGEMM's ``fused_params`` onto shard tables.

``shard_tables(configs, fused_params, seed)`` gives the ``EmbeddingTableConfig`` of each TorchRec
table and the ``FeatureConfig`` of each of its features, named as TorchRec names the outputs
(``feature``, or ``feature@table`` for a feature that several tables read). Every mistake is a
``ValueError`` that names the table, the feature or the ``fused_params`` key.

What maps onto what:

- ``name`` -> the table's name on the shards; ``embedding_dim`` -> ``dim``; ``num_embeddings`` is
  a capacity hint (ids are keys as they are; a module may check them against it);
- ``data_type`` FP32, FP16, BF16 -> ``storage_dtype`` float32, float16, bfloat16;
- ``weight_init_min``/``weight_init_max`` (TorchRec's default ``+-sqrt(1/num_embeddings)``) ->
  the shards' ``uniform`` initializer; an ``init_fn`` of ``torch.nn.init.uniform_`` or
  ``normal_`` (a ``functools.partial``) -> ``uniform``/``normal``; any other function cannot run
  on the shards and is refused;
- ``pooling`` SUM, MEAN -> ``sum``, ``mean`` (``PSEmbeddingCollection``: unpooled rows);
- ``fused_params["optimizer"]`` ``EmbOptimType`` (or its value as a string): ``EXACT_SGD`` (and
  ``SGD``) -> ``sgd``, ``EXACT_ADAGRAD`` -> ``adagrad``, ``EXACT_ROWWISE_ADAGRAD`` (the default)
  -> ``rowwise_adagrad``, ``ADAM`` -> ``adam``; ``learning_rate`` (default 0.01) -> ``lr``,
  ``eps``, ``beta1``, ``beta2``, and ``weight_decay`` when ``weight_decay_mode`` is L2.

Example:
    >>> from torchrec import EmbeddingBagConfig
    >>> tables, features = shard_tables(
    ...     [EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["a", "b"])],
    ...     {"learning_rate": 0.05},
    ... )
    >>> tables[0].optimizer, tables[0].params["lr"], [f.name for f in features]
    ('rowwise_adagrad', 0.05, ['a', 'b'])
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torchrec import DataType, PoolingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from worker.config import EmbeddingTableConfig, FeatureConfig, Pooling

__all__ = ["optimizer_of", "output_names", "shard_tables"]

_OPTIMIZERS = {
    "exact_sgd": "sgd",
    "sgd": "sgd",
    "exact_adagrad": "adagrad",
    "exact_row_wise_adagrad": "rowwise_adagrad",
    "adam": "adam",
}
_STORAGE = {DataType.FP32: "float32", DataType.FP16: "float16", DataType.BF16: "bfloat16"}
_POOLING: dict[PoolingType, Pooling] = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}
# fused_params keys that tune FBGEMM's kernels or caches: nothing to do on the shards.
_KERNEL_ONLY = {
    "stochastic_rounding",
    "cache_load_factor",
    "cache_algorithm",
    "cache_reserved_memory",
    "cache_precision",
    "output_dtype",
    "prefetch_pipeline",
    "bounds_check_mode",
    "enforce_hbm",
    "gradient_clipping",
    "max_gradient",
    "uvm_non_rowwise_momentum",
    "use_experimental_tbe",
}
_NUMBERS = {"learning_rate": "lr", "eps": "eps", "beta1": "beta1", "beta2": "beta2", "weight_decay": "weight_decay"}


def optimizer_of(fused_params: Mapping[str, Any] | None) -> tuple[str, dict[str, float]]:
    """The shards' optimizer name and hyper-parameters for FBGEMM's ``fused_params``."""
    fp = dict(fused_params or {})
    unknown = sorted(k for k in fp if k not in _NUMBERS and k not in _KERNEL_ONLY | {"optimizer", "weight_decay_mode"})
    if unknown:
        raise ValueError(
            f"fused_params: {', '.join(map(repr, unknown))} not supported; supported: optimizer, "
            f"{', '.join(_NUMBERS)}, weight_decay_mode (and FBGEMM's kernel settings, which do nothing here)"
        )
    kind = fp.get("optimizer", "exact_row_wise_adagrad")
    value = str(getattr(kind, "value", kind)).lower()
    if value not in _OPTIMIZERS:
        raise ValueError(
            f"fused_params: optimizer={kind!s}: not supported; supported: EXACT_SGD, EXACT_ADAGRAD, "
            "EXACT_ROWWISE_ADAGRAD, ADAM"
        )
    params = {"lr": float(fp.get("learning_rate", 0.01))}
    for key, ours in _NUMBERS.items():
        if key in fp and key != "learning_rate":
            params[ours] = float(fp[key])
    if params.get("weight_decay", 0.0):
        mode = fp.get("weight_decay_mode")
        mode_name = str(getattr(mode, "name", mode)).upper()
        if mode_name != "L2":
            raise ValueError(
                f"fused_params: weight_decay={params['weight_decay']} with weight_decay_mode={mode_name}: "
                "only L2 decay is supported (FBGEMM applies none without a mode); pass weight_decay_mode="
                "WeightDecayMode.L2, or leave weight_decay out"
            )
    else:
        params.pop("weight_decay", None)
    return _OPTIMIZERS[value], params


def output_names(configs: Sequence[BaseEmbeddingConfig]) -> list[list[str]]:
    """Per table, the names of its outputs: the feature's name, or ``feature@table`` where a
    feature is read by more than one table (as TorchRec names them)."""
    count: dict[str, int] = {}
    for c in configs:
        for f in c.feature_names:
            count[f] = count.get(f, 0) + 1
    return [[f if count[f] == 1 else f"{f}@{c.name}" for f in c.feature_names] for c in configs]


def shard_tables(
    configs: Sequence[BaseEmbeddingConfig],
    fused_params: Mapping[str, Any] | None,
    seed: int = 0,
    *,
    pooled: bool = True,
) -> tuple[list[EmbeddingTableConfig], list[FeatureConfig]]:
    """Our tables and features for TorchRec's table configs (see the module docstring).

    Each table's seed is ``seed`` plus a hash of its name, so tables start from different rows
    and a table's rows do not depend on the order of the configs."""
    if not configs:
        raise ValueError("tables: empty; give at least one EmbeddingBagConfig")
    optimizer, opt_params = optimizer_of(fused_params)
    seen: set[str] = set()
    for i, c in enumerate(configs):
        if not c.name:
            raise ValueError(f"tables[{i}]: name is empty; each table needs a name (it names the table on the shards)")
        if c.name in seen:
            raise ValueError(f"tables: duplicate name {c.name!r}")
        seen.add(c.name)
        if not c.feature_names:
            raise ValueError(f"table {c.name!r}: feature_names is empty; name the KeyedJaggedTensor keys it reads")
        if len(set(c.feature_names)) != len(c.feature_names):
            raise ValueError(f"table {c.name!r}: feature_names {c.feature_names} repeat a name")
        if c.embedding_dim < 1:
            raise ValueError(f"table {c.name!r}: embedding_dim={c.embedding_dim}, must be >= 1")
        if c.num_embeddings < 1:
            raise ValueError(f"table {c.name!r}: num_embeddings={c.num_embeddings}, must be >= 1")
        if c.data_type not in _STORAGE:
            raise ValueError(f"table {c.name!r}: data_type={c.data_type}: supported FP32, FP16, BF16")
    tables, features = [], []
    for c, names in zip(configs, output_names(configs)):
        initializer, init_params = _initializer(c)
        tables.append(
            EmbeddingTableConfig(
                c.name,
                c.embedding_dim,
                optimizer,
                initializer,
                seed=(seed + zlib.crc32(c.name.encode())) % 2**63,
                params={**opt_params, **init_params},
                storage_dtype=_STORAGE[c.data_type],
            )
        )
        pooling: Pooling = _pooling(c) if pooled else "none"
        features += [FeatureConfig(n, c.name, pooling) for n in names]
    return tables, features


def _pooling(c: BaseEmbeddingConfig) -> Pooling:
    pooling = getattr(c, "pooling", PoolingType.SUM)
    if pooling not in _POOLING:
        raise ValueError(f"table {c.name!r}: pooling={pooling}: supported SUM, MEAN")
    return _POOLING[pooling]


def _initializer(c: BaseEmbeddingConfig) -> tuple[str, dict[str, float]]:
    low, high = c.get_weight_init_min(), c.get_weight_init_max()
    fn = c.init_fn
    if isinstance(fn, functools.partial) and fn.func is torch.nn.init.uniform_ and not fn.args:
        low, high = fn.keywords.get("a", 0.0), fn.keywords.get("b", 1.0)
    elif isinstance(fn, functools.partial) and fn.func is torch.nn.init.normal_ and not fn.args:
        return "normal", {"mean": float(fn.keywords.get("mean", 0.0)), "std": float(fn.keywords.get("std", 1.0))}
    elif fn is not None:
        raise ValueError(
            f"table {c.name!r}: init_fn={fn!r} cannot run on the shards; use weight_init_min/weight_init_max "
            "(uniform), or functools.partial(torch.nn.init.uniform_ or normal_, ...)"
        )
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"table {c.name!r}: weight_init_min={low}, weight_init_max={high}: need min < max")
    return "uniform", {"low": float(low), "high": float(high)}
