"""Worker checkpoints: where a training group that torchrun restarted picks up.

With ``checkpoint_dir`` a run stays one run however often its workers restart or the
group changes size. Rank 0 keeps a small checkpoint there (``CheckpointDir``): the
run's ``Progress`` (run id, epoch, data position, step, batch size, epoch count) and
the dense model and optimizer; the rows stay on the shards. Every rank of a group that
starts resumes from the newest one (``resume``), whatever the number of ranks now.

Exactly-once, whatever restarts: the run's pushes are named ``(run_id, table, seq)``
(the run id is the ``PSClient``'s ``client_id``), and micro-batch ``i`` of epoch ``e``
pushes ``seq = e * M + i + 1``, ``M`` being the epoch's micro-batches (``Progress.seq``),
whichever worker trains it. A checkpoint is written only once every worker's pushes of
the micro-batches before its position were acknowledged (``flush`` and a barrier). A
group resumed from it trains the micro-batches from there again; the shards skip the
pushes they applied before the restart, so no sparse update is applied twice and none
is lost. The dense model retrains those steps from the checkpoint, against rows that
hold their sparse updates already: a restart costs at most ``checkpoint_every`` steps.

The run id is written before the first push (a checkpoint at step 0), so a group that
dies before its first real checkpoint also resumes under the same id. A checkpoint
directory holds one run: another configuration is refused (``CheckpointError``).

Example:
    >>> import tempfile
    >>> ckpts = CheckpointDir(Path(tempfile.mkdtemp()))
    >>> p = Progress("run-1", batch_size=64, micro_batches=10, epochs=2)
    >>> _ = ckpts.save({"progress": dataclasses.asdict(p)}, step=0)
    >>> Progress(**ckpts.newest()["progress"]).seq(epoch=1, index=3)
    14
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from worker.config import TrainerConfig
from worker.distributed import Dist

__all__ = ["CheckpointDir", "CheckpointError", "Progress", "fingerprint", "resume"]

log = logging.getLogger(__name__)

KEEP = 2  # checkpoints kept: the newest, and the one before in case the newest cannot be read
FORMAT = 1
_NAME = re.compile(r"checkpoint-(\d{9})\.pt")

# Settings a restarted group may change: where and how it runs, not what it trains.
_MAY_CHANGE = frozenset(
    {
        "addresses",
        "num_shards",
        "mode",
        "staleness",
        "device",
        "eval_every",
        "output_dir",
        "progress",
        "log_level",
        "checkpoint_dir",
        "checkpoint_every",
        "idle_exit_s",
        "validation_window",
        "publish",
        "guard_auc_drop",
        "guard_calibration_min",
        "guard_calibration_max",
        "metrics_port",
    }
)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be resumed here (another run's, or unreadable)."""


@dataclass
class Progress:
    """How far a run got. ``position``: micro-batches of ``epoch`` that every worker has
    trained and whose pushes the shards acknowledged; ``epochs`` is None until chosen."""

    run_id: str
    batch_size: int  # per worker and micro-batch: fixed for the run, whatever the group's size
    micro_batches: int  # M: per epoch
    epochs: int | None
    epoch: int = 0
    position: int = 0
    steps: int = 0  # optimizer steps over every epoch (checkpoints fall every checkpoint_every)
    output_dir: str | None = None
    epoch_choice: dict[str, Any] | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)

    def seq(self, epoch: int, index: int) -> int:
        """The push number of micro-batch ``index`` of ``epoch``."""
        return epoch * self.micro_batches + index + 1

    @property
    def done(self) -> bool:
        return self.epochs is not None and self.epoch >= self.epochs


def fingerprint(config: TrainerConfig) -> dict[str, str]:
    """The settings that define what a run trains (a resumed run must match them)."""
    return {k: str(v) for k, v in dataclasses.asdict(config).items() if k not in _MAY_CHANGE}


class CheckpointDir:
    """Checkpoints of one run in ``path``: ``checkpoint-<step>.pt``, the newest ``KEEP``.

    Written atomically (a temporary file, fsync, rename), so a reader sees whole files
    only; written by one process (rank 0) at a time. Blocks on the disk.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def _files(self) -> list[tuple[int, Path]]:
        if not self.path.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.path.iterdir() if (m := _NAME.fullmatch(p.name))]
        return sorted(found, reverse=True)

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step`` (replacing one of the same step); returns its
        path. Raises ``CheckpointError`` naming the directory if it cannot be written."""
        try:
            return self._save(state, step)
        except OSError as exc:
            raise CheckpointError(
                f"--checkpoint-dir {self.path}: cannot write a checkpoint there ({exc.strerror or exc}): "
                "pass a --checkpoint-dir this process can write, on a disk with room left"
            ) from exc

    def _save(self, state: dict[str, Any], step: int) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        final = self.path / f"checkpoint-{step:09d}.pt"
        tmp = self.path / f".{final.name}.{os.getpid()}.tmp"
        with tmp.open("wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash of the machine
        finally:
            os.close(fd)
        for _, old in self._files()[KEEP:]:
            old.unlink(missing_ok=True)
        for stale in self.path.glob(".checkpoint-*.tmp"):  # left by a writer that died
            if stale != tmp:
                stale.unlink(missing_ok=True)
        return final

    def newest(self) -> dict[str, Any] | None:
        """The newest checkpoint that reads (None: none). An unreadable one is skipped with a warning."""
        for _, path in self._files():
            try:
                state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # a torn or foreign file: the one before will do
                log.warning("checkpoint %s does not read (%s); trying the one before", path, exc)
                continue
            if state.get("format") != FORMAT:
                raise CheckpointError(f"{path}: checkpoint format {state.get('format')!r}, this trainer reads {FORMAT}")
            state["path"] = str(path)
            return state
        return None


def _check(state: dict[str, Any], config: TrainerConfig, micro_batches: int, path: Path) -> None:
    """Raise ``CheckpointError`` unless ``state`` is a checkpoint of the run ``config`` asks for."""
    theirs, ours = state["fingerprint"], fingerprint(config)
    differ = [f"{k}={theirs.get(k)!r} there, {ours.get(k)!r} here" for k in sorted(ours) if theirs.get(k) != ours[k]]
    if differ:
        raise CheckpointError(
            f"{path} holds the checkpoints of another run ({'; '.join(differ)}): resume with that run's settings, "
            "or pass another --checkpoint-dir"
        )
    if state["progress"]["micro_batches"] != micro_batches:
        raise CheckpointError(
            f"{path}: the run had {state['progress']['micro_batches']} batches an epoch, the data now gives "
            f"{micro_batches}: the training data changed; pass another --checkpoint-dir"
        )


def resume(
    config: TrainerConfig,
    d: Dist,
    micro_batches: Callable[[int], int],
    batch_size: int,
    epochs: int | None,
    output_dir: Callable[[TrainerConfig, Progress | None], Path],
) -> tuple[Progress, dict[str, Any]]:
    """This run's ``Progress`` and the dense state to start from (``{}``: fresh), the same on every rank.

    Rank 0 reads the newest checkpoint of ``config.checkpoint_dir`` (none: a new run,
    whose id it writes there before anything is pushed) and broadcasts it; collective
    under torchrun. ``micro_batches(batch_size)`` is the epoch's micro-batch count;
    ``batch_size`` and ``epochs`` are used for a new run (a resumed one keeps its own);
    ``output_dir(config, resumed progress or None)`` gives (and makes) the directory rank
    0 writes the run to. Raises ``CheckpointError`` (on every rank) for a directory of
    another run or one that cannot be read or written.
    """
    box: list[Any] = [None, None]
    if d.rank == 0:
        try:
            box[0] = _load_or_start(config, micro_batches, batch_size, epochs, output_dir)
        except Exception as exc:  # every rank must hear of it, or the others wait forever
            if d.world == 1:
                raise
            box[1] = exc
    if d.world > 1:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise box[1]
    progress_dict, dense = box[0]
    return Progress(**progress_dict), dense


def _load_or_start(
    config: TrainerConfig,
    micro_batches: Callable[[int], int],
    batch_size: int,
    epochs: int | None,
    output_dir: Callable[[TrainerConfig, Progress | None], Path],
) -> tuple[dict[str, Any], dict[str, Any]]:
    ckpts = CheckpointDir(config.checkpoint_dir) if config.checkpoint_dir is not None else None
    state = ckpts.newest() if ckpts is not None else None
    if ckpts is None or state is None:
        progress = Progress(uuid.uuid4().hex, batch_size, micro_batches(batch_size), epochs)
        progress.output_dir = str(output_dir(config, None))
        if ckpts is not None:
            save(ckpts, config, progress)
            log.info("run %s: checkpoints in %s", progress.run_id, ckpts.path)
        return dataclasses.asdict(progress), {}
    _check(state, config, micro_batches(state["progress"]["batch_size"]), Path(state["path"]))
    progress = Progress(**state["progress"])
    progress.output_dir = str(output_dir(config, progress))
    log.info(
        "run %s: resuming from %s (epoch %d, batch %d of %d, step %d)",
        progress.run_id,
        state["path"],
        progress.epoch,
        progress.position,
        progress.micro_batches,
        progress.steps,
    )
    return dataclasses.asdict(progress), {k: state[k] for k in ("model", "optimizer", "rng") if k in state}


def save(
    ckpts: CheckpointDir,
    config: TrainerConfig,
    progress: Progress,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Write ``progress`` (and the dense state, when given) as the checkpoint of its step."""
    state: dict[str, Any] = {
        "progress": dataclasses.asdict(progress),
        "fingerprint": fingerprint(config),
        # Every seq up to this one of the run's client id is applied on the shards (for a reader).
        "pushed_through": progress.seq(progress.epoch, progress.position) - 1,
    }
    if model is not None and optimizer is not None:
        state |= {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}
    return ckpts.save(state, progress.steps)
