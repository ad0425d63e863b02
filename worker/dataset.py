"""The rows of a training run: synthetic, a click log held in memory, or one streamed.

A click log of at most ``IN_MEMORY_BYTES`` (or one that must be sorted, MovieLens) is
read whole and split in row order: the first ``train_fraction`` of the rows trains, the
rest evaluates, and the embeddings read values found in fewer than ``min_count`` training
rows as one "rare" key per feature (``RunData.rare``, see ``worker.rare``). With ``folds=K`` the run is one
fold of a cross-validation inside the training rows (``cv_fold``): the evaluation block is
moved behind the K-1 training blocks, so everything downstream still sees "the first
``train_rows`` train, the rest evaluates". A larger log is streamed from
disk each epoch. Every worker gets the same number of steps per epoch, or DDP's
allreduce would wait forever.

Example:
    >>> auto_batch_size(8_000, world=1), auto_batch_size(80_000, world=1), auto_batch_size(10**7, world=4)
    (64, 512, 1024)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from worker.config import TrainerConfig
from worker.data import BadLines, Batch, ClickLog, ColumnSchema, DataError, load_click_log, read_click_log
from worker.rare import RareValues
from worker.schemafile import load_schema_file
from worker.synthetic import synthetic_criteo

__all__ = [
    "EVAL_BATCH_SIZE",
    "IN_MEMORY_BYTES",
    "EpochPlan",
    "OneLabelError",
    "RunData",
    "SCHEMAS",
    "auto_batch_size",
    "count_lines",
    "cv_fold",
    "epoch_batches",
    "eval_batches",
    "micro_batches",
    "open_data",
    "schema_of",
    "steps_per_epoch",
]

SCHEMAS = {"criteo": ColumnSchema.criteo, "avazu": ColumnSchema.avazu, "movielens": ColumnSchema.movielens}
CHECK_ROWS = 4096  # a streamed log: rows read before training starts, to find a wrong schema early
IN_MEMORY_BYTES = 256 << 20  # click logs up to this size are read whole (ordered, several epochs)
STEPS_PER_EPOCH = 128  # what batch_size=0 aims at
EVAL_BATCH_SIZE = 4096  # click logs; synthetic evaluation uses batch_size (its samples depend on it)


def schema_of(spec: str) -> ColumnSchema:
    """The layout ``--schema spec`` names: a name in ``SCHEMAS``, or the path of a TOML schema
    file (``worker.schemafile``; raises its ``SchemaFileError``, one line, for a bad one).

    >>> schema_of("avazu").label
    'click'
    """
    make = SCHEMAS.get(spec)
    return make() if make is not None else load_schema_file(spec).schema


@dataclass(frozen=True)
class RunData:
    """The rows of a run: synthetic, a click log in memory (``train``/``test``), or one streamed."""

    source: str  # "synthetic", or the schema's name or file
    train_rows: int  # all workers together
    eval_rows: int
    train: ClickLog | None = None  # in memory, keys as read
    test: ClickLog | None = None
    rows: ClickLog | None = None  # in memory, as read: the probe splits the training rows again
    rare: RareValues | None = None  # in memory with min_count > 1: the training rows' vocabulary
    path: Path | None = None  # a streamed log
    bad_lines: BadLines | None = None  # malformed lines left out (--bad-lines skip), over every read

    def split(self, n: int, end: int, min_count: int) -> tuple[ClickLog, ClickLog, RareValues | None]:
        """Rows ``[0, n)`` and ``[n, end)`` of an in-memory log, and the vocabulary of the first part."""
        if self.rows is None:
            raise ValueError(f"{self.source}: only a click log held in memory can be split")
        head, tail = self.rows[:n], self.rows[n:end]
        return head, tail, RareValues.counted(head, min_count)


def open_data(config: TrainerConfig) -> RunData:
    """The rows ``config`` names; reads a click log that fits in memory, and the first
    ``CHECK_ROWS`` rows of a larger one, so that a schema that does not fit the file fails
    here, before any training (raises ``ValueError``: ``DataError`` for bad rows,
    ``SchemaFileError`` for a bad schema file)."""
    if config.data == "synthetic":
        return RunData("synthetic", config.train_samples, config.eval_samples)
    schema, path = schema_of(config.schema), Path(config.data)
    bad = BadLines() if config.bad_lines == "skip" else None
    if schema.order_by is not None or path.stat().st_size <= IN_MEMORY_BYTES:
        rows = load_click_log(path, schema, bad_lines=bad)
        n_train = int(len(rows) * config.train_fraction)
        if config.folds:
            rows, n_train = cv_fold(rows[:n_train], config.folds, config.eval_fold)
        data = RunData(config.schema, n_train, len(rows) - n_train, rows=rows, bad_lines=bad)
        train, test, rare = data.split(n_train, len(rows), config.min_count)
        _check_both_labels(path, test.labels, "held-out")
        _check_both_labels(path, train.labels, "training")
        return dataclasses.replace(data, train=train, test=test, rare=rare)
    if config.folds:
        raise ValueError(
            f"folds={config.folds}: cross-validation needs the log in memory; {path} is over "
            f"{IN_MEMORY_BYTES >> 20} MiB and is streamed"
        )
    for _ in read_click_log(path, schema, CHECK_ROWS, limit=CHECK_ROWS, bad_lines=BadLines() if bad else None):
        pass
    # Streamed: rows are lines (a skipped malformed line shortens the pass it is in).
    total = count_lines(path) - (1 if schema.header else 0)
    n_train = int(total * config.train_fraction)
    return RunData(config.schema, n_train, total - n_train, path=path, bad_lines=bad)


def schemas_that_fit(path: str | Path, lines: int = 20) -> list[str]:
    """The names in ``SCHEMAS`` under which the first ``lines`` data lines of ``path`` read
    without a ``DataError`` and give at least one row (what to suggest when a file fails its
    ``--schema``; a schema that takes a file's only line as its header does not fit it)."""
    fits = []
    for name, make in SCHEMAS.items():
        schema = dataclasses.replace(make(), order_by=None)  # the order is no matter here
        rows = 0
        try:
            for batch in read_click_log(path, schema, lines, limit=lines):
                rows += batch.batch_size
        except DataError:
            continue
        if rows:
            fits.append(name)
    return fits


def cv_fold(rows: ClickLog, folds: int, k: int) -> tuple[ClickLog, int]:
    """Fold ``k`` of a ``folds``-fold cross-validation over ``rows``: the rows reordered so
    the K-1 training blocks come first (in row order) and block ``k`` last, and the count
    of training rows. Block ``k`` is rows ``[n*k//K, n*(k+1)//K)``.

    >>> log = ClickLog(np.arange(10, dtype=np.float32), np.zeros((10, 0), np.float32), np.zeros((0, 10), np.int64), ())
    >>> moved, n_train = cv_fold(log, 5, 1)
    >>> moved.labels.tolist(), n_train
    ([0.0, 1.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 2.0, 3.0], 8)
    """
    if folds < 2 or not 0 <= k < folds:
        raise ValueError(f"fold {k} of {folds}: need folds >= 2 and 0 <= fold < folds")
    n = len(rows)
    lo, hi = n * k // folds, n * (k + 1) // folds
    if hi == lo or hi - lo == n:
        raise ValueError(f"fold {k} of {folds}: {n} rows are too few to cut into {folds} blocks")
    return rows.take(np.r_[0:lo, hi:n, lo:hi]), n - (hi - lo)


def count_lines(path: Path) -> int:
    count, last = 0, b"\n"
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def auto_batch_size(train_rows: int, world: int) -> int:
    """A power of two in [32, 1024] near ``train_rows / (STEPS_PER_EPOCH * world)``: enough
    optimizer steps per pass for the dense tower on a small log, large batches on a big one."""
    target = max(1.0, train_rows / (STEPS_PER_EPOCH * world))
    return int(min(1024, max(32, 2 ** round(math.log2(target)))))


def micro_batches(rows: int, batch_size: int) -> int:
    """Batches of ``batch_size`` in an epoch of ``rows`` (the last may be short): the
    epoch's micro-batches, numbered 0, 1, ... whatever the number of workers."""
    return -(-rows // batch_size)


def steps_per_epoch(rows: int, batch_size: int, world: int, start: int = 0) -> int:
    """Steps each of ``world`` workers takes over the micro-batches ``start, start + 1, ...``
    of an epoch: all take the same number, or DDP's allreduce would wait forever; in the
    last step a worker may have no micro-batch left (it adds nothing to that step)."""
    return -(-max(0, micro_batches(rows, batch_size) - start) // world)


@dataclass(frozen=True)
class EpochPlan:
    """Which micro-batch a worker trains at each step of an epoch, and the seq it pushes.

    The epoch's ``total`` micro-batches from ``start`` on are dealt out in turns: at step
    ``j``, worker ``rank`` of ``world`` trains micro-batch ``start + j * world + rank``
    (``epoch_batches`` yields them in that order), pushed as ``seq_base + index + 1``. In
    the last step some workers may have none (``index`` None): they add zero gradients,
    and the others' loss is scaled so the step averages over those that trained.

    >>> plan = EpochPlan(total=7, start=2, world=2, rank=1, seq_base=70)
    >>> [plan.index(j) for j in range(plan.steps)], plan.seq(3), plan.active(2), plan.position(2)
    ([3, 5, None], 74, 1, 7)
    """

    total: int
    start: int
    world: int
    rank: int
    seq_base: int = 0

    @property
    def steps(self) -> int:
        return -(-max(0, self.total - self.start) // self.world)

    def index(self, step: int) -> int | None:
        """This worker's micro-batch at ``step`` (None: it has none)."""
        i = self.start + step * self.world + self.rank
        return i if i < self.total else None

    def active(self, step: int) -> int:
        """How many workers have a micro-batch at ``step``."""
        return min(self.world, self.total - self.start - step * self.world)

    def position(self, step: int) -> int:
        """Micro-batches of the epoch done once every worker finished ``step``."""
        return min(self.total, self.start + (step + 1) * self.world)

    def seq(self, index: int) -> int:
        return self.seq_base + index + 1


def epoch_batches(
    config: TrainerConfig,
    rank: int,
    world: int,
    data: RunData,
    batch_size: int,
    epoch: int,
    rows: ClickLog | None = None,
    start: int = 0,
) -> Iterator[Batch]:
    """This worker's batches of one epoch over ``rows`` (default: all training rows): the
    micro-batches ``start + rank``, ``start + rank + world``, ... (every micro-batch from
    ``start`` on, once, over all ranks; a group resumed at ``start`` with another world
    size splits the rest anew). A streamed log that ran short yields fewer."""
    if data.source == "synthetic":
        return synthetic_criteo(
            config.train_samples, batch_size, seed=config.seed + 1000 * epoch, rank=rank, world_size=world, start=start
        )
    if data.path is not None:
        schema = schema_of(config.schema)
        # Without skipped lines a micro-batch is rows [i * batch_size, (i + 1) * batch_size) of
        # the file; a skipped line shifts the rows after it, so the stream is read from its start.
        skip = start * batch_size if data.bad_lines is None else 0
        batches = read_click_log(
            data.path, schema, batch_size, skip=skip, limit=data.train_rows - skip, bad_lines=data.bad_lines
        )
        return itertools.islice(batches, start - skip // batch_size + rank, None, world)
    rows = rows if rows is not None else data.train
    if rows is None:
        raise ValueError(f"{data.source}: no training rows")
    return rows.batches(batch_size, rank=rank, world_size=world, start=start)


def eval_batches(config: TrainerConfig, data: RunData, batch_size: int) -> list[Batch]:
    """Every evaluation row, batched (synthetic: in ``batch_size``, which its samples depend on)."""
    if data.source == "synthetic":
        return list(synthetic_criteo(config.eval_samples, batch_size, seed=config.seed + 7_777_777))
    if data.path is not None:
        schema = schema_of(config.schema)
        return list(read_click_log(data.path, schema, EVAL_BATCH_SIZE, skip=data.train_rows, bad_lines=data.bad_lines))
    if data.test is None:
        raise ValueError(f"{data.source}: no evaluation rows")
    return list(data.test.batches(EVAL_BATCH_SIZE))


class OneLabelError(DataError):
    """The training or the held-out rows of a file hold one label only (or none)."""


def _check_both_labels(path: Path, labels: npt.NDArray[np.float32], which: str) -> None:
    """``DataError`` (about the file as a whole) unless ``labels`` hold both 0 and 1: AUC and
    the epoch choice need both, and a run would fail only after it trained."""
    positives = int((labels > 0.5).sum())
    if 0 < positives < labels.shape[0]:
        return
    only = "no rows" if labels.shape[0] == 0 else f"only label {1 if positives else 0}"
    raise OneLabelError(
        f"{path}: the {labels.shape[0]} {which} rows hold {only}: a run needs both labels in each part; "
        "use a larger file, or another --train-fraction",
        str(path),
    )
