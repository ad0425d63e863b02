"""Train a recommendation model whose embeddings live on parameter-server shards.

The dense tower runs under ``DistributedDataParallel`` (gloo on CPU, nccl with CUDA);
each worker pushes its own sparse gradients to the shards. ``train(config, addresses)``
trains against running shards; ``python -m worker.trainer --addresses ...`` is its
command line (``ps-launch`` passes the addresses in ``TRAINER_ADDRESSES``). Starting
shards for a run is ``deploy``'s job: ``python -m deploy.train`` (what the examples
use) starts them on 127.0.0.1 when no addresses are given.

What a run trains on, unless the flags say otherwise (the defaults were chosen on the
Criteo, Avazu and MovieLens samples; see the README for the AUC each reaches):

* every categorical feature reads the table ``embedding`` (``dim`` columns; keys are
  hashed with a seed per feature, so features never share a row) and, for the
  first-order term, the dim-1 table ``wide`` (zeros at first). Both use Adagrad, the
  embeddings with a small learning rate: on a few thousand rows the interaction terms
  overfit within an epoch or two, while the first-order weights need several;
* the rows come from ``worker.dataset``: a click log that fits in memory is split in
  row order (first ``train_fraction`` trains, the rest evaluates); the embeddings read
  values seen in fewer than ``min_count`` training rows as one row per feature, the
  first-order weights keep every value (``worker.rare``);
* ``batch_size=0`` takes about 128 steps per pass over the training rows (a power of
  two in [32, 1024]); ``epochs=0`` trains a probe model (tables ``probe.*``) on the
  training rows without their last ``VALIDATION_FRACTION``, evaluates that tail after
  each epoch until its logloss has been worse than the best for ``PATIENCE`` epochs,
  and trains the real model on all training rows for the best epoch count (ties within
  ``TIE`` go to the later epoch). Nothing is chosen on the evaluation rows. Synthetic
  data and streamed logs train for one epoch.

Workers come and go: with ``checkpoint_dir``, a group that torchrun restarts (a worker
died, or one joined) resumes from the newest checkpoint there, and the rest of the epoch is
split over the workers it has now (``worker.resume``, ``worker.dataset.EpochPlan``).

Scale: DDP averages dense gradients over workers, while each worker pushes the sparse
gradients of its own batch, so with W workers the shards take W updates per step (as in
PERSIA and HugeCTR); the sparse learning rate is per worker batch. A run with one
worker is reproducible to the bit (same seed, same AUC); with W > 1 the pushes of
different workers reach a shard in whatever order the network gives, so runs differ
in the last digits.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from client import ClientConfig, PSClient
from protos.rowtypes import as_served
from worker.command import parse, report
from worker.config import TrainerConfig
from worker.dataset import (
    EVAL_BATCH_SIZE,
    EpochPlan,
    RunData,
    auto_batch_size,
    epoch_batches,
    eval_batches,
    micro_batches,
    open_data,
    steps_per_epoch,
)
from worker.distributed import Dist, init_distributed
from worker.loop import TrainingPass, dense_adam, evaluate, predict, scores
from worker.mistakes import run_or_explain
from worker.online import train_online
from worker.output import progress, run_dir
from worker.results import save_run
from worker.resume import CheckpointDir, Progress, resume, save
from worker.stream import is_stream

__all__ = [
    "TrainerConfig",
    "dense_adam",
    "evaluate",
    "main",
    "predict",
    "train",
]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

VALIDATION_FRACTION = 0.1  # of the training rows, to choose the epoch count on
MAX_EPOCHS = 10
PATIENCE = 1  # epochs past the chosen one before the probe stops
TIE = 1e-3  # validation loglosses within this fraction of the best count as equally good


def _choose_epochs(
    config: TrainerConfig,
    d: Dist,
    client: PSClient,
    data: RunData,
    batch_size: int,
    features: list[str],
    num_dense: int,
) -> tuple[int, dict[str, Any]]:
    """Train a probe (tables ``probe.*``) on the training rows but their tail; the best epoch count on the tail."""
    n_val = int(data.train_rows * VALIDATION_FRACTION)
    fit, val, rare = data.split(data.train_rows - n_val, data.train_rows, config.min_count)
    val_batches = list(val.batches(EVAL_BATCH_SIZE))
    probe = TrainingPass(config, d, client, features, num_dense, prefix="probe.", rare=rare)
    history: list[dict[str, float]] = []
    best = 1
    bar = progress(
        config.progress and d.rank == 0, MAX_EPOCHS * steps_per_epoch(len(fit), batch_size, d.world), "choosing epochs"
    )
    fit_batches = micro_batches(len(fit), batch_size)
    try:
        for epoch in range(1, MAX_EPOCHS + 1):
            # The probe's pushes are numbered as the real model's (see worker.resume): a group
            # restarted while it probes probes again, and the pushes applied before are skipped.
            plan = EpochPlan(fit_batches, 0, d.world, d.rank, seq_base=(epoch - 1) * fit_batches)
            probe.epoch(plan, epoch_batches(config, d.rank, d.world, data, batch_size, epoch, fit), bar)
            stop: list[Any] = [False]
            if d.rank == 0:
                history.append(probe.evaluate(val_batches))
                best, stop[0] = _best_epoch([h["logloss"] for h in history])
            if d.world > 1:
                dist.broadcast_object_list(stop, src=0)
            if stop[0]:
                break
    finally:
        if bar is not None:
            bar.close()
        probe.close()
    box: list[Any] = [best]
    if d.world > 1:
        dist.broadcast_object_list(box, src=0)
    return int(box[0]), {"validation_rows": n_val, "fit_rows": len(fit), "chosen": int(box[0]), "history": history}


def _best_epoch(losses: Sequence[float]) -> tuple[int, bool]:
    """(the epoch count to train for, whether to stop probing) after ``len(losses)`` epochs.

    The latest epoch within ``TIE`` of the lowest validation logloss: at the top of the
    curve those differences are noise, and the first-order weights, which train slowest,
    gain from the later epoch. Probing stops ``PATIENCE`` epochs after the chosen one.

    >>> _best_epoch([0.46, 0.45, 0.4502]), _best_epoch([0.46, 0.45, 0.47])
    ((3, False), (2, True))
    """
    low = min(losses)
    best = 1 + max(i for i, x in enumerate(losses) if x <= low * (1 + TIE))
    return best, len(losses) - best >= PATIENCE or len(losses) >= MAX_EPOCHS


def _can_choose_epochs(data: RunData) -> bool:
    if data.train is None:
        return False
    tail = data.train.labels[len(data.train) - int(len(data.train) * VALIDATION_FRACTION) :]
    return len(tail) >= 200 and 0 < float(tail.sum()) < len(tail)  # AUC and logloss need both classes


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.state_dict().values():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(
    config: TrainerConfig, addresses: Sequence[str], d: Dist | None = None, data: RunData | None = None
) -> dict[str, Any]:
    """Train ``config`` on the cluster at ``addresses``; returns the metrics (also written to the run directory).

    ``data``: the rows, ``open_data(config)`` (read here when None): a caller that starts
    shards for the run reads them first, so that a file that does not fit its schema fails
    before any shard starts.

    With ``config.checkpoint_dir``, resumes from the newest checkpoint there and writes
    new ones (``worker.resume``). Raises the client's ``PSError`` subclasses if the shards
    fail, ``ValueError`` for bad data or a checkpoint directory of another run. Blocks
    until done; collective across all workers under ``torchrun`` (``d`` from
    ``init_distributed()``; the caller owns the process group).
    """
    d = d or init_distributed(config.device)
    if is_stream(config.data):
        return train_online(config, addresses, d)
    data = data if data is not None else open_data(config)
    if data.train_rows == 0:
        raise ValueError(f"no training steps: {data.source} has no training rows")
    choose = config.epochs == 0 and _can_choose_epochs(data)
    state, dense_state = resume(
        config,
        d,
        lambda b: micro_batches(data.train_rows, b),
        config.batch_size or (1024 if data.source == "synthetic" else auto_batch_size(data.train_rows, d.world)),
        None if choose else config.epochs or 1,
        _output_dir,
    )
    batch_size = state.batch_size
    first = next(epoch_batches(config, 0, 1, data, batch_size, 0), None)
    if first is None:
        raise ValueError(f"no training steps: {data.train_rows} rows in batches of {batch_size}")
    features, num_dense = list(first.sparse), first.dense.shape[1]
    held_out = eval_batches(config, data, batch_size)
    out = Path(state.output_dir) if d.rank == 0 and state.output_dir is not None else None
    resolved = dataclasses.replace(
        config, batch_size=batch_size, epochs=state.epochs or 1, output_dir=out, num_shards=len(addresses)
    )
    if d.rank == 0:
        _log_config(config, resolved, data, d, choose, state.epochs is None)
    metrics: dict[str, Any] = {
        "config": {k: str(v) for k, v in dataclasses.asdict(resolved).items()},
        "data": {
            "source": data.source,
            "train_rows": data.train_rows,
            "eval_rows": data.eval_rows,
            "features": len(features),
            "dense": num_dense,
        },
        "run_id": state.run_id,
    }
    ckpts = CheckpointDir(config.checkpoint_dir) if config.checkpoint_dir is not None else None

    def checkpoint(run: TrainingPass | None) -> None:
        """Every rank: once all pushes so far are acknowledged everywhere, rank 0 writes ``state``."""
        if ckpts is None:
            return
        if run is not None:
            run.emb.flush()
        if d.world > 1:
            dist.barrier()
        if d.rank == 0:
            save(ckpts, config, state, *((run.model, run.optimizer) if run is not None else ()))

    # The run id names the pushes for exactly-once: the same in every process of the run.
    wire = ClientConfig(transport_dtype=config.wire_dtype)  # type: ignore[arg-type]
    with PSClient(addresses, wire, client_id=state.run_id) as client:
        if state.epochs is None:
            state.epochs, state.epoch_choice = _choose_epochs(config, d, client, data, batch_size, features, num_dense)
            checkpoint(None)
            if d.rank == 0:
                log.info(
                    "epochs=%d chosen on the last %d training rows (validation logloss per epoch: %s)",
                    state.epochs,
                    state.epoch_choice["validation_rows"],
                    " ".join(f"{h['logloss']:.4f}" for h in state.epoch_choice["history"]),
                )
        if state.epoch_choice is not None:
            metrics["epoch_choice"] = state.epoch_choice
            metrics["config"]["epochs"] = str(state.epochs)
        run = TrainingPass(config, d, client, features, num_dense, dense_state=dense_state, rare=data.rare)
        run.steps, run.evals = state.steps, state.evals

        def after_step(position: int) -> None:
            state.position, state.steps = position, run.steps
            if run.steps % config.checkpoint_every == 0:
                checkpoint(run)

        bar = progress(
            config.progress and d.rank == 0,
            _steps_left(state, data.train_rows, d.world),
            "training",
        )
        try:
            while not state.done:
                plan = EpochPlan(
                    state.micro_batches, state.position, d.world, d.rank, seq_base=state.epoch * state.micro_batches
                )
                batches = epoch_batches(config, d.rank, d.world, data, batch_size, state.epoch, start=state.position)
                run.epoch(plan, batches, bar, held_out, after_step)
                state.epoch, state.position, state.steps = state.epoch + 1, 0, run.steps
                checkpoint(run)
            if bar is not None:
                bar.close()
            final: dict[str, float] = {}
            served: dict[str, float] = {}
            if d.rank == 0:
                labels, probs = predict(run.emb, run.model, held_out, d.device, data.rare)
                final = scores(labels, probs)
                if config.eval_serve_dtype != "stored":  # the same model, rows as serving shards would hold them
                    run.emb.eval_rows = functools.partial(as_served, config.eval_serve_dtype)
                    served = scores(*predict(run.emb, run.model, held_out, d.device, data.rare))
                    run.emb.eval_rows = None
        finally:
            run.close()
        digests: list[Any] = [_digest(run.model)] * d.world
        if d.world > 1:
            dist.all_gather_object(digests, _digest(run.model))
        shard_stats = client.admin.stats() if d.rank == 0 else []
    metrics.update(run.stats(), evals=run.evals, final=final, dense_digests=digests)
    if served:
        metrics["final_served"] = {**served, "serve_dtype": config.eval_serve_dtype}
    if shard_stats:
        metrics["shards"] = _shard_totals(shard_stats)
    if data.bad_lines is not None and data.bad_lines.count:
        metrics["data"]["bad_lines"] = {"count": data.bad_lines.count, "first": data.bad_lines.first}
        if d.rank == 0:
            log.warning("%s: %s (--bad-lines skip)", config.data, data.bad_lines)
    if out is not None:
        metrics["output_dir"] = str(out)
        save_run(
            config,
            out,
            run,
            data.source,
            features,
            num_dense,
            list(addresses),
            shard_stats,
            metrics,
            data.rare,
            probs=probs,
        )
        log.info(
            "final AUC %.4f logloss %.4f (%d eval samples), %.0f samples/s; wrote %s",
            final["auc"],
            final["logloss"],
            final["samples"],
            metrics["samples_per_s"],
            out,
        )
    return metrics


def _shard_totals(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """What the shards hold and applied, over all shards: rows and keys pushed per table
    (every run on them counts), and pushes skipped as applied before."""
    tables: dict[str, dict[str, int]] = {}
    for s in stats:
        for t in s["tables"]:
            total = tables.setdefault(t["name"], {"rows": 0, "keys_pushed": 0})
            total["rows"] += int(t["rows"])
            total["keys_pushed"] += int(t["pushes"])
    return {"tables": tables, "duplicate_pushes": sum(int(s.get("duplicate_pushes", 0)) for s in stats)}


def _output_dir(config: TrainerConfig, state: Progress | None) -> Path:
    """Where rank 0 writes the run: ``--output-dir``, else the resumed run's directory, else a new one."""
    if config.output_dir is None and state is not None and state.output_dir is not None:
        Path(state.output_dir).mkdir(parents=True, exist_ok=True)
        return Path(state.output_dir)
    return run_dir(config)


def _steps_left(state: Progress, rows: int, world: int) -> int:
    """Steps this group takes from ``state`` to the end of the run (for the progress bar)."""
    epochs = state.epochs or 1
    if state.epoch >= epochs:
        return 0
    per_epoch = steps_per_epoch(rows, state.batch_size, world)
    return steps_per_epoch(rows, state.batch_size, world, state.position) + (epochs - state.epoch - 1) * per_epoch


_ALWAYS_SHOWN = ("model", "data", "addresses")


def _log_config(
    config: TrainerConfig, resolved: TrainerConfig, data: RunData, d: Dist, choose: bool, probing: bool
) -> None:
    """One line: the settings as used, with what was chosen for the user marked (``choose``:
    the epoch count is chosen on a probe; ``probing``: now, not before a restart)."""
    shown: dict[str, Any] = dataclasses.asdict(resolved)
    if data.rows is None:
        del shown["min_count"]  # rare values are only shared in logs held in memory
    if data.source == "synthetic" or not config.folds:
        del shown["folds"], shown["eval_fold"]
    if data.source == "synthetic":
        del shown["schema"], shown["train_fraction"]
    else:
        del shown["train_samples"], shown["eval_samples"]
        shown["train_rows"], shown["eval_rows"] = data.train_rows, data.eval_rows
        shown["rows_from"] = "memory" if data.path is None else "stream"
    if config.batch_size == 0:
        shown["batch_size"] = f"{resolved.batch_size}(auto)"
    if config.epochs == 0 and choose and probing:
        shown["epochs"] = f"auto(probe_on_last_{int(data.train_rows * VALIDATION_FRACTION)}_training_rows)"
    elif config.epochs == 0:
        shown["epochs"] = f"{resolved.epochs}(auto{',chosen_before_a_restart' if choose else ''})"
    if config.checkpoint_dir is None:
        del shown["checkpoint_every"]
    shown["workers"] = d.world

    def words(items: dict[str, Any]) -> str:
        return " ".join(f"{k}={','.join(v) if isinstance(v, tuple) else v}" for k, v in items.items())

    # At INFO what differs from the defaults (and what was chosen for the user); the whole at DEBUG.
    defaults = {f.name: f.default for f in dataclasses.fields(TrainerConfig)}
    told = {k: v for k, v in shown.items() if k not in defaults or v != defaults[k] or k in _ALWAYS_SHOWN}
    log.info("config %s (--log-level DEBUG: every setting)", words(told))
    log.debug("config %s", words(shown))


@record  # under torchrun, the error reaches ps-launch's one-line summary of a failed worker
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m worker.trainer``: train against running shards (``--addresses`` or ``TRAINER_ADDRESSES``).

    To have the shards started for you, use ``python -m deploy.train`` (or the examples).
    """
    config = parse(argv, local_shards=False)
    if not config.addresses:
        print(
            "trainer: no shard addresses: pass --addresses (ps-launch sets TRAINER_ADDRESSES), "
            "or run `python -m deploy.train` with the same flags, which starts local shards",
            file=sys.stderr,
        )
        raise SystemExit(2)

    def run() -> dict[str, Any]:
        d = init_distributed(config.device)
        try:
            return train(config, config.addresses, d)
        finally:
            if d.world > 1:
                dist.destroy_process_group()

    metrics = run_or_explain(run, config, "trainer")
    report(metrics)
    return metrics


if __name__ == "__main__":
    main()
