"""A run's directory: the dense weights, the exported model and the manifest ``ps-infer``
serves it by, and the metrics (``save_run``; ``worker.trainer`` and ``worker.online``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.config import TrainerConfig
from worker.data import SchemaColumns
from worker.export import describe_data, serving_manifest
from worker.loop import WIDE, TrainingPass
from worker.rare import RareValues

__all__ = ["save_run"]


def save_run(
    config: TrainerConfig,
    out: Path,
    run: TrainingPass,
    source: str,
    features: list[str],
    num_dense: int,
    addresses: list[str],
    shard_stats: list[dict[str, Any]],
    metrics: dict[str, Any],
    rare: RareValues | None = None,
    *,
    probs: torch.Tensor | None = None,
    columns: SchemaColumns | None = None,
) -> None:
    """Write the run directory ``out``: ``dense.pt``, the exported model and its manifest
    (``worker.export``), ``metrics.json`` and, given ``probs``, the final evaluation's
    predicted probabilities in row order (``predictions.npy``). ``source``: "synthetic" or
    the schema (``RunData.source``); ``columns``: the schema's columns where ``config.data``
    is no file to read them from (a stream)."""
    torch.save({k: v.detach().cpu() for k, v in run.model.state_dict().items()}, out / "dense.pt")
    if probs is not None:
        np.save(out / "predictions.npy", probs.numpy().astype(np.float32))
    schema = describe_data(source, config.data, features, num_dense, columns)
    manifest = {
        "model": config.model,
        "dim": config.dim,
        "num_dense": num_dense,
        # The cluster's size when training ended (a live reshard may have changed it).
        "num_shards": int(shard_stats[0]["num_shards"]) if shard_stats else len(addresses),
        "tables": [dataclasses.asdict(t) | {"params": dict(t.params)} for t in run.tables],
        "features": [dataclasses.asdict(f) for f in run.features],
        "wide_suffix": WIDE if config.wide else None,
        "shard_rows": [sum(t["rows"] for t in s["tables"]) for s in shard_stats],
        # Which data each shard's rows are (Stats.lineage): ps-infer refuses shards of another.
        "shard_lineages": [s.get("lineage", "") for s in shard_stats],
    }
    rare_values = None
    if rare is not None:
        # Serving must send keys outside the training vocabulary to the rare row, as training
        # did, for the embeddings only: the first-order weights keep every value (worker.rare).
        np.savez_compressed(out / "vocabulary.npz", **rare.vocabulary)  # type: ignore[arg-type]
        rare_values = {
            "min_count": rare.min_count,
            "vocabulary": "vocabulary.npz",
            "rare_keys": rare.rare_keys(),
            "shared_by": sorted({f.table for f in run.features if not f.name.endswith(WIDE)}),
        }
    manifest |= serving_manifest(
        run.model, out, run.tables, run.features, num_dense, schema, WIDE if config.wide else None, rare_values
    )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
