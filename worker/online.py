"""Train online: batches from a stream (``worker.stream``), each scored before it trains.

``worker.trainer.train`` runs ``train_online`` when ``--data`` names a stream
(``dir:PATH`` or ``redis://HOST:PORT/STREAM``). The run never ends by itself unless
``--idle-exit-s`` says so; it then writes a final checkpoint and the run directory (dense
model, manifest, metrics) and returns.

Exactly once, from event to row. Batch ``n`` of the run (counted from the start of the
stream) pushes under seq ``n`` with the run's id as the client id. A checkpoint holds
``n``, the stream position after batch ``n`` and the dense model and optimizer after it,
written once the shards acknowledged every push through ``n``. A trainer restarted from
it seeks the stream there and cuts the same batches again (a source's batches are a
function of the log, not of timing): the shards skip the pushes they applied before the
restart, so every row's sparse update is applied once, none skipped. The dense tower
retrains the batches after the checkpoint, against rows that hold their updates already.
In sync mode it need not: there each checkpoint is written before its step's push leaves
(the push travels inside it, and is sent again at a restart), so with
``--checkpoint-every 1`` a trainer killed at any moment, shards included, and restarted
ends bit-equal to one never killed.

Progressive validation (test-then-train): the predictions a batch gets from the model
before it trains on it are its validation. Every ``--validation-window`` rows make a
window: AUC, logloss and calibration (mean prediction / mean label), logged and kept in
the metrics.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from client import ClientConfig, PSClient
from worker.config import TrainerConfig
from worker.dataset import schema_of
from worker.distributed import Dist
from worker.online_loop import OnlineLoop
from worker.online_metrics import OnlineMetrics
from worker.online_state import OnlineProgress, StreamRows, load_checkpoint, save_checkpoint
from worker.output import run_dir
from worker.resume import CheckpointDir, CheckpointError
from worker.stream import StreamSource, open_stream

__all__ = ["train_online"]

log = logging.getLogger("worker.trainer")

STREAM_BATCH_SIZE = 512  # batch_size=0 on a stream: the whole stream is not there to size it by


def train_online(config: TrainerConfig, addresses: Sequence[str], d: Dist) -> dict[str, Any]:
    """Train on the stream ``config.data`` until ``config.idle_exit_s`` seconds pass without
    a row (forever when 0); returns the metrics (also in the run directory, by rank 0).

    With several workers (torchrun), worker ``r`` of ``W`` trains the part of the stream it
    owns (``worker.stream``), pushing under its own client id; the dense tower trains under
    DDP, a worker without a batch adding zero gradients to a step. A resumed group must have
    as many workers as the run began with. With ``config.checkpoint_dir`` resumes from the
    newest checkpoint there (see the module). Raises ``StreamError`` for a stream that
    cannot be read from its position, ``DataError`` for a malformed row (``--bad-lines
    error``), ``CheckpointError`` for a checkpoint directory of another run, the client's
    ``PSError``s for shard failures.
    """
    # torch.optim imports torch._dynamo on first use (about 1.3 s here): done meanwhile, a
    # restarted trainer reaches its first batch sooner (the checkpoint and the stream load).
    threading.Thread(target=_warm_optimizer, name="warm-optimizer", daemon=True).start()
    schema = schema_of(config.schema)
    if schema.order_by is not None:
        raise ValueError(
            f"--schema {config.schema}: orders rows by {schema.order_by!r}, and a stream trains in the order rows "
            "arrive: use a schema without order_by"
        )
    ckpts = CheckpointDir(config.checkpoint_dir) if config.checkpoint_dir is not None else None
    box: list[Any] = [None]
    if d.rank == 0:
        box[0] = load_checkpoint(ckpts, config)
    if d.world > 1:
        dist.broadcast_object_list(box, src=0)
    saved = box[0]
    if saved is not None:
        progress = OnlineProgress(**saved["online"])
        if progress.world != d.world:
            raise CheckpointError(
                f"{saved['path']}: the run splits its stream over {progress.world} workers, and {d.world} were "
                f"started: resume it with {progress.world} (torchrun --nproc-per-node {progress.world})"
            )
        mine = progress.parts[d.rank]
        log.info(
            "run %s: resuming from %s (step %d; this worker: batch %d, %d rows, position %s)",
            progress.run_id,
            saved["path"],
            progress.steps,
            mine["batches"],
            mine["rows"],
            mine["position"],
        )
    else:
        box = [uuid.uuid4().hex]
        if d.world > 1:
            dist.broadcast_object_list(box, src=0)
        progress = OnlineProgress(box[0], config.batch_size or STREAM_BATCH_SIZE, d.world)
    out = Path(progress.output_dir) if progress.output_dir else run_dir(config) if d.rank == 0 else Path(".")
    if d.world > 1:
        box = [str(out)]
        dist.broadcast_object_list(box, src=0)
        out = Path(box[0])
    if d.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    progress.output_dir = str(out)
    source = open_stream(config.data, schema, window_ms=config.stream_window_ms, part=(d.rank, d.world))
    try:
        source.seek(progress.parts[d.rank]["position"])
        if ckpts is not None and saved is None and d.rank == 0:
            save_checkpoint(ckpts, config, progress, None)  # the run id, before anything is pushed
            log.info("run %s: checkpoints in %s", progress.run_id, ckpts.path)
        return _train(
            config, addresses, d, source, StreamRows(schema, config.bad_lines == "skip"), ckpts, saved, progress
        )
    finally:
        source.close()


def _warm_optimizer() -> None:
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


def _train(
    config: TrainerConfig,
    addresses: Sequence[str],
    d: Dist,
    source: StreamSource,
    rows: StreamRows,
    ckpts: CheckpointDir | None,
    saved: dict[str, Any] | None,
    progress: OnlineProgress,
) -> dict[str, Any]:
    wire = ClientConfig(transport_dtype=config.wire_dtype)  # type: ignore[arg-type]
    # One client id per worker: each numbers the pushes of its own part of the stream.
    client_id = progress.run_id if d.world == 1 else f"{progress.run_id}.{d.rank}"
    metrics = OnlineMetrics(config.metrics_port if d.rank == 0 else None)
    started = time.perf_counter()
    try:
        with PSClient(addresses, wire, client_id=client_id) as client:
            held = (saved or {}).get("held")
            if held:  # the checkpoint's own step: skipped by the shards if it was applied
                updates = {t: (k.numpy(), g.numpy()) for t, (k, g) in held["updates"].items()}
                client.push_many(updates, seq=held["seq"])
            dense_state: dict[str, Any] = {
                k: saved[k] for k in ("model", "optimizer", "rng") if saved is not None and k in saved
            }
            loop = OnlineLoop(config, d, client, source, rows, metrics, progress)
            loop.run(ckpts, dense_state, list(addresses), (saved or {}).get("inputs"))
            shard_stats = client.admin.stats() if d.rank == 0 else []
    finally:
        metrics.close()
    return loop.finish(list(addresses), shard_stats, time.perf_counter() - started)
