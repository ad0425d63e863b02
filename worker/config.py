"""What a model's embeddings are: tables (created on the shards) and the features that read them.

Example:
    >>> user = EmbeddingTableConfig("user", dim=16, optimizer="adagrad", params={"lr": 0.05})
    >>> FeatureConfig("user_id", table="user", pooling="sum").table
    'user'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "SCHEMA_NAMES",
    "EmbeddingTableConfig",
    "FeatureConfig",
    "Pooling",
    "TrainerConfig",
    "check_features",
]

Pooling = Literal["sum", "mean", "none"]
_FLOAT_TYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EmbeddingTableConfig:
    """A table to create on every shard (see ``PSClient.create_table`` for the options).

    ``optimizer``/``initializer`` None and absent ``params`` take the shards' defaults.
    ``serving_default`` is "initial": serving shards read a key training never stored as
    the row training would have created for it, so a model scores there as it did in
    training ("zeros" reads such keys as zeros).
    """

    name: str
    dim: int
    optimizer: str | None = None
    initializer: str | None = None
    seed: int = 0
    params: Mapping[str, float] = field(default_factory=dict)
    serving_default: str = "initial"
    storage_dtype: str = "float32"
    state_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim={self.dim}, must be >= 1")

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``PSClient.create_table`` (and ``client.tables.table_spec``) after name and dim."""
        return {
            "optimizer": self.optimizer,
            "initializer": self.initializer,
            "seed": self.seed,
            "serving_default": self.serving_default,
            "storage_dtype": self.storage_dtype,
            "state_dtype": self.state_dtype,
            **dict(self.params),
        }


@dataclass(frozen=True)
class FeatureConfig:
    """A sparse input feature: its ids are keys of ``table``; ``pooling`` reduces each bag.

    ``sum``/``mean`` give ``[batch, dim]``; ``none`` gives the unpooled ``[num_ids, dim]`` rows.
    """

    name: str
    table: str
    pooling: Pooling = "sum"

    def __post_init__(self) -> None:
        if self.pooling not in ("sum", "mean", "none"):
            raise ValueError(f"feature {self.name!r}: pooling={self.pooling!r}, expected sum, mean or none")


def check_features(tables: Sequence[EmbeddingTableConfig], features: Sequence[FeatureConfig]) -> None:
    """Raise ``ValueError`` for duplicate names or a feature naming an unknown table."""
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"tables: duplicate names in {names}")
    fnames = [f.name for f in features]
    if len(set(fnames)) != len(fnames):
        raise ValueError(f"features: duplicate names in {fnames}")
    for f in features:
        if f.table not in names:
            raise ValueError(f"feature {f.name!r}: table {f.table!r} is not among the tables {names}")


SCHEMA_NAMES = ("criteo", "avazu", "movielens")  # click-log layouts the trainer knows (worker.data.ColumnSchema)


def _help(text: str) -> dict[str, str]:
    return {"help": text}


ENV_PREFIX = "TRAINER_"  # TrainerConfig's variables: --num-shards is TRAINER_NUM_SHARDS


@dataclass(frozen=True)
class TrainerConfig:
    """One training run (immutable; ``--help`` lists every field; ``worker.trainer`` says
    what the automatic choices, ``batch_size=0`` and ``epochs=0``, do)."""

    addresses: tuple[str, ...] = field(default=(), metadata=_help("shard addresses in shard order, comma-separated"))
    num_shards: int = field(default=2, metadata=_help("local shards to start when no addresses are given"))
    data: str = field(
        default="synthetic",
        metadata=_help(
            "'synthetic' (Criteo-like, planted model), a click-log path, or a stream to train on online: "
            "dir:PATH (a directory files land in) or redis://HOST:PORT/STREAM (docs/guides/online.md)"
        ),
    )
    schema: str = field(
        default="criteo",
        metadata=_help(
            "layout of a click-log file: criteo, avazu, movielens, or the path of a TOML schema file naming its "
            "delimiter, header, label and each column's kind (docs/guides/custom-data.md)"
        ),
    )
    bad_lines: str = field(
        default="error",
        metadata=_help(
            "a malformed line in a click-log file: error (stop, naming its file and line) or skip (leave it out; "
            "the count and the first line numbers are logged)"
        ),
    )
    model: str = field(default="dlrm", metadata=_help("dlrm or deepfm"))
    dim: int = field(default=16, metadata=_help("embedding dim of every feature's table"))
    batch_size: int = field(
        default=0,
        metadata=_help("samples per step per worker; 0: about 128 steps per epoch, in [32, 1024]"),
    )
    train_samples: int = field(default=200_000, metadata=_help("synthetic samples to train on (all workers together)"))
    eval_samples: int = field(default=20_000, metadata=_help("synthetic samples to evaluate on"))
    train_fraction: float = field(
        default=0.8,
        metadata=_help(
            "click logs: the first fraction of the rows trains, the rest evaluates; with folds, the rows cut "
            "into blocks (1: every row)"
        ),
    )
    folds: int = field(
        default=0,
        metadata=_help(
            "click logs in memory, cross-validation: K >= 2 cuts the first train_fraction of the rows into K "
            "contiguous blocks; block eval_fold evaluates, the other K-1 train, the rows after train_fraction "
            "are not read (train_fraction=1: every row is in a block; 0: off)"
        ),
    )
    eval_fold: int = field(default=0, metadata=_help("with folds=K: the block that evaluates, 0 (first) to K-1"))
    epochs: int = field(
        default=0,
        metadata=_help(
            "passes over the training data; 0: chosen on the training rows' last 10% (logs read into memory), else 1"
        ),
    )
    sparse_optimizer: str = field(
        default="rowwise_adagrad",
        metadata=_help(
            "optimizer the shards run on the embeddings: rowwise_adagrad (one accumulator per row), adagrad, "
            "sgd, adam, ftrl"
        ),
    )
    sparse_lr: float = field(default=0.003, metadata=_help("learning rate of the embedding tables"))
    wide: bool = field(default=True, metadata=_help("learn a first-order weight per feature value (the table 'wide')"))
    wide_lr: float = field(default=0.05, metadata=_help("learning rate of the first-order weights"))
    min_count: int = field(
        default=2,
        metadata=_help("logs in memory: values in fewer training rows share their feature's 'rare' row (1: off)"),
    )
    sparse_weight_decay: float = field(
        default=0.0, metadata=_help("L2 decay of the embedding rows, applied when a row is pushed")
    )
    admit_after: int = field(
        default=1,
        metadata=_help(
            "a key gets a trained row at its N-th lookup (1: at once); counts lookups, so every epoch counts again"
        ),
    )
    storage_dtype: str = field(
        default="float32",
        metadata=_help("how the shards store embedding values: float32, bfloat16 or float16 (stochastic rounding)"),
    )
    state_dtype: str = field(
        default="float32", metadata=_help("how the shards store the sparse optimizer's state: float32 or bfloat16")
    )
    wire_dtype: str = field(
        default="float32",
        metadata=_help("type of looked-up rows and pushed gradients on the wire: float32, bfloat16 or float16"),
    )
    eval_serve_dtype: str = field(
        default="stored",
        metadata=_help(
            "also score the held-out rows as serving shards with --serve-dtype int8, bfloat16 or float16 would "
            "(metrics final_served); stored: no second score"
        ),
    )
    dense_lr: float = field(default=5e-4, metadata=_help("Adam learning rate of the dense tower"))
    mode: str = field(default="pipelined", metadata=_help("pipelined (lookups ahead, async pushes) or sync (exact)"))
    device: str = field(
        default="auto", metadata=_help("where the dense tower trains: cuda, cpu, or auto (cuda when there is one)")
    )
    staleness: int = field(
        default=1, metadata=_help("pipelined mode: step t reads rows without the pushes of the last N steps")
    )
    eval_every: int = field(default=0, metadata=_help("evaluate every N steps (0: only at the end)"))
    idle_exit_s: float = field(
        default=0.0,
        metadata=_help(
            "streams: end the run cleanly (final checkpoint and outputs written, exit 0) after this many seconds "
            "without a new row; 0: wait for rows forever"
        ),
    )
    stream_window_ms: int = field(
        default=100,
        metadata=_help(
            "Redis streams: a batch holds the entries of one tick of this many milliseconds of their IDs (and at "
            "most batch_size), so a restarted trainer cuts the same batches; the longest a row waits for its batch"
        ),
    )
    validation_window: int = field(
        default=10_000,
        metadata=_help(
            "streams: rows per progressive-validation window (every batch is scored before it trains; AUC, "
            "logloss and calibration per window)"
        ),
    )
    publish: bool = field(
        default=True,
        metadata=_help(
            "streams: publish each validation window that passes its guards to serving shards started with "
            "--published-only (dense weights under OUTPUT_DIR/published/)"
        ),
    )
    guard_auc_drop: float = field(
        default=0.02,
        metadata=_help("streams: a window fails when its AUC is below the trailing baseline by more than this"),
    )
    guard_calibration_min: float = field(
        default=0.5, metadata=_help("streams: a window fails when mean prediction / mean label is below this")
    )
    guard_calibration_max: float = field(
        default=2.0, metadata=_help("streams: a window fails when mean prediction / mean label is above this")
    )
    metrics_port: int | None = field(
        default=None,
        metadata=_help(
            "streams: serve Prometheus metrics (windows, guards, publications, stream lag) at "
            "http://0.0.0.0:PORT/metrics (0: any free port, logged)"
        ),
    )
    output_dir: Path | None = field(
        default=None,
        metadata=_help(
            "where the dense model, manifest and metrics go; empty: runs/<UTC time>/, linked from runs/latest"
        ),
    )
    checkpoint_dir: Path | None = field(
        default=None,
        metadata=_help(
            "where rank 0 keeps the worker checkpoints (dense model and optimizer, data position, run id; the "
            "newest two) that a restarted training group resumes from; pushes sent again are skipped by the "
            "shards. Empty: no checkpoints, a restarted group starts over"
        ),
    )
    checkpoint_every: int = field(
        default=100,
        metadata=_help("with checkpoint_dir: steps between checkpoints (one also ends each epoch)"),
    )
    seed: int = field(default=0, metadata=_help("seed of dense and embedding initialisation (and synthetic data)"))
    progress: bool = field(
        default=True, metadata=_help("show progress on rank 0 (a bar on a terminal, else a line every 10 s)")
    )
    log_level: str = field(default="INFO", metadata=_help("DEBUG, INFO, WARNING or ERROR"))

    def __post_init__(self) -> None:
        checks = [
            (self.model in ("dlrm", "deepfm"), f"model={self.model!r}: expected dlrm or deepfm"),
            (
                self.storage_dtype in _FLOAT_TYPES,
                f"storage_dtype={self.storage_dtype!r}: expected float32, bfloat16 or float16",
            ),
            (self.state_dtype in _FLOAT_TYPES[:2], f"state_dtype={self.state_dtype!r}: expected float32 or bfloat16"),
            (self.wire_dtype in _FLOAT_TYPES, f"wire_dtype={self.wire_dtype!r}: expected float32, bfloat16 or float16"),
            (
                self.eval_serve_dtype in ("stored", "int8", *_FLOAT_TYPES),
                f"eval_serve_dtype={self.eval_serve_dtype!r}: expected stored, int8, float32, bfloat16 or float16",
            ),
            (self.mode in ("sync", "pipelined"), f"mode={self.mode!r}: expected sync or pipelined"),
            (self.device in ("auto", "cpu", "cuda"), f"device={self.device!r}: expected auto, cpu or cuda"),
            (self.bad_lines in ("error", "skip"), f"bad_lines={self.bad_lines!r}: expected error or skip"),
            (
                self.schema in SCHEMA_NAMES or Path(self.schema).is_file(),
                f"schema={self.schema!r}: expected {', '.join(SCHEMA_NAMES)} or the path of a TOML schema file "
                "(no such file)",
            ),
            (self.dim >= 1, f"dim={self.dim}: must be >= 1"),
            (self.batch_size >= 0 and self.epochs >= 0, "batch_size and epochs must be >= 0 (0: chosen for you)"),
            (self.num_shards >= 1, f"num_shards={self.num_shards}: must be >= 1"),
            (self.checkpoint_every >= 1, f"checkpoint_every={self.checkpoint_every}: must be >= 1"),
            (self.admit_after >= 1 and self.min_count >= 1, "admit_after and min_count must be >= 1"),
            (
                0 < self.train_fraction < 1 or (self.folds >= 2 and self.train_fraction == 1),
                f"train_fraction={self.train_fraction}: must be in (0, 1), or 1 with folds (every row in a block)",
            ),
            (self.folds == 0 or self.folds >= 2, f"folds={self.folds}: must be 0 (off) or >= 2"),
            (
                0 <= self.eval_fold < max(1, self.folds),
                f"eval_fold={self.eval_fold}: must be in [0, {max(1, self.folds) - 1}] (folds={self.folds})",
            ),
            (
                self.data == "synthetic" or self.data.startswith(("dir:", "redis://")) or Path(self.data).is_file(),
                f"data={self.data!r}: not 'synthetic', dir:PATH, redis://HOST:PORT/STREAM or an existing file",
            ),
            (self.idle_exit_s >= 0, f"idle_exit_s={self.idle_exit_s}: must be >= 0 (0: wait forever)"),
            (self.stream_window_ms >= 1, f"stream_window_ms={self.stream_window_ms}: must be >= 1"),
            (self.validation_window >= 1, f"validation_window={self.validation_window}: must be >= 1"),
            (self.guard_auc_drop >= 0, f"guard_auc_drop={self.guard_auc_drop}: must be >= 0"),
            (
                self.metrics_port is None or 0 <= self.metrics_port <= 65535,
                f"metrics_port={self.metrics_port}: must be in [0, 65535]",
            ),
            (
                0 <= self.guard_calibration_min <= 1 <= self.guard_calibration_max,
                f"guard_calibration_min={self.guard_calibration_min}, guard_calibration_max="
                f"{self.guard_calibration_max}: need 0 <= min <= 1 <= max",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
