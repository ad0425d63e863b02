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

import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from client import ClientConfig, PSClient
from worker.config import TrainerConfig
from worker.data import Batch, ColumnSchema, parse_lines
from worker.dataset import schema_of
from worker.distributed import Dist
from worker.export import probabilities
from worker.guard import WindowGuard, finite
from worker.loop import TrainingPass
from worker.metrics import auc, logloss
from worker.online_metrics import OnlineMetrics
from worker.output import run_dir
from worker.published import published_dir
from worker.results import save_run
from worker.resume import CheckpointDir, CheckpointError, fingerprint
from worker.schema import BadLines, DataError, Layout, SchemaColumns, columns_of, resolve_layout
from worker.stream import Lines, StreamBadLines, StreamSource, open_stream

__all__ = ["OnlineProgress", "ProgressiveValidation", "train_online"]

log = logging.getLogger("worker.trainer")

STREAM_BATCH_SIZE = 512  # batch_size=0 on a stream: the whole stream is not there to size it by
POLL_S = 1.0  # longest wait for a batch before the loop looks at the clock again
LAG_EVERY_S = 5.0  # how often the stream's lag is read
BEHIND_S = 60.0  # lag that makes the trainer say it does not keep up (at most every BEHIND_SAY_EVERY_S)
BEHIND_SAY_EVERY_S = 60.0
WINDOWS_KEPT = 1000  # in the checkpoint and metrics: the latest windows


@dataclass
class OnlineProgress:
    """How far an online run got: ``batches`` trained (the seq of the last push), ``rows``
    in them, and the stream ``position`` after the last one."""

    run_id: str
    batch_size: int
    batches: int = 0
    rows: int = 0
    position: dict[str, Any] | None = None
    output_dir: str | None = None
    published: str = ""  # the newest publication (worker.published)
    windows: list[dict[str, Any]] = field(default_factory=list)


class ProgressiveValidation:
    """Predictions made before training, gathered into windows of ``rows`` rows each.

    >>> pv = ProgressiveValidation(4)
    >>> pv.add(torch.tensor([0.0, 1.0]), torch.tensor([0.2, 0.6])) is None
    True
    >>> w = pv.add(torch.tensor([0.0, 1.0]), torch.tensor([0.4, 0.8]))
    >>> w["rows"], w["auc"], round(w["calibration"], 3)
    (4, 1.0, 1.0)
    """

    def __init__(self, rows: int, first: int = 1) -> None:
        self.rows, self.number = rows, first
        self._labels: list[np.ndarray] = []
        self._probs: list[np.ndarray] = []
        self._n = 0

    def add(self, labels: torch.Tensor, probs: torch.Tensor) -> dict[str, Any] | None:
        """Add one batch; the window's figures when it is full (None: not yet)."""
        self._labels.append(labels.numpy().astype(np.float64))
        self._probs.append(probs.numpy().astype(np.float64))
        self._n += int(labels.shape[0])
        if self._n < self.rows:
            return None
        y, p = np.concatenate(self._labels), np.concatenate(self._probs)
        self._labels, self._probs, self._n = [], [], 0
        mean_y, mean_p = float(y.mean()), float(p.mean())
        finite = bool(np.isfinite(p).all())
        window = {
            "window": self.number,
            "rows": int(y.shape[0]),
            "auc": auc(y, p) if finite and 0 < y.sum() < y.shape[0] else None,
            "logloss": logloss(y, p) if finite else None,
            "calibration": mean_p / mean_y if mean_y > 0 and finite else None,
            "mean_label": mean_y,
            "mean_prediction": mean_p,
        }
        self.number += 1
        return window


class _Rows:
    """``Lines`` into ``Batch``es under ``schema``: one layout per header, malformed rows
    raised or (``skip``) counted."""

    def __init__(self, schema: ColumnSchema, skip: bool) -> None:
        self.schema = schema
        self.bad = StreamBadLines() if skip else None
        self._layouts: dict[tuple[str, ...] | None, Layout] = {}
        self.columns: SchemaColumns | None = None

    def batch(self, lines: Lines) -> Batch:
        lay = self._layouts.get(lines.header)
        if lay is None:
            first = lines.data[: lines.data.index(b"\n")]
            try:
                lay = resolve_layout(self.schema, None if lines.header is None else list(lines.header), first)
                self.columns = self.columns or columns_of(self.schema, lines.header, first)
            except ValueError as exc:
                raise DataError(f"{lines.where}: {exc}", lines.where) from None
            self._layouts[lines.header] = lay
        bad = BadLines() if self.bad is not None else None
        batch = parse_lines(lines.data, self.schema, lay, lines.where, lines.first_line, bad)
        if self.bad is not None and bad is not None and bad.count:
            self.bad.add(lines.where, bad.count, bad.first)
        return batch


def _load(ckpts: CheckpointDir | None, config: TrainerConfig) -> dict[str, Any] | None:
    state = ckpts.newest() if ckpts is not None else None
    if state is None:
        return None
    if "online" not in state:
        raise CheckpointError(
            f"{state['path']} is a checkpoint of a run on a file, not a stream: pass another --checkpoint-dir"
        )
    theirs, ours = state["fingerprint"], fingerprint(config)
    differ = [f"{k}={theirs.get(k)!r} there, {ours.get(k)!r} here" for k in sorted(ours) if theirs.get(k) != ours[k]]
    if differ:
        raise CheckpointError(
            f"{state['path']} holds the checkpoints of another run ({'; '.join(differ)}): resume with that run's "
            "settings, or pass another --checkpoint-dir"
        )
    return state


def _save(
    ckpts: CheckpointDir,
    config: TrainerConfig,
    progress: OnlineProgress,
    run: TrainingPass | None,
    held: tuple[int | None, dict[str, tuple[np.ndarray, np.ndarray]]] | None = None,
) -> None:
    state: dict[str, Any] = {"online": dataclasses.asdict(progress), "fingerprint": fingerprint(config)}
    if run is not None:
        state |= {
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
        }
    if held is not None:  # the step's push, sent when this file is safe (and again at a restart)
        seq, updates = held
        state["held"] = {
            "seq": seq,
            "updates": {t: (torch.from_numpy(k), torch.from_numpy(g)) for t, (k, g) in updates.items()},
        }
    ckpts.save(state, progress.batches)


def _features(schema_columns: SchemaColumns) -> list[str]:
    return [*schema_columns.categorical, *schema_columns.buckets, *schema_columns.multi]


def train_online(config: TrainerConfig, addresses: Sequence[str], d: Dist) -> dict[str, Any]:
    """Train on the stream ``config.data`` until ``config.idle_exit_s`` seconds pass without
    a row (forever when 0); returns the metrics (also in the run directory).

    With ``config.checkpoint_dir`` resumes from the newest checkpoint there (see the
    module). Raises ``StreamError`` for a stream that cannot be read from its position,
    ``DataError`` for a malformed row (``--bad-lines error``), ``CheckpointError`` for a
    checkpoint directory of another run, the client's ``PSError``s for shard failures.
    """
    if d.world > 1:
        raise ValueError(
            f"--data {config.data}: a stream trains with one worker for now ({d.world} were started); "
            "run one trainer process"
        )
    schema = schema_of(config.schema)
    if schema.order_by is not None:
        raise ValueError(
            f"--schema {config.schema}: orders rows by {schema.order_by!r}, and a stream trains in the order rows "
            "arrive: use a schema without order_by"
        )
    ckpts = CheckpointDir(config.checkpoint_dir) if config.checkpoint_dir is not None else None
    saved = _load(ckpts, config)
    if saved is not None:
        progress = OnlineProgress(**saved["online"])
        log.info(
            "run %s: resuming from %s (batch %d, %d rows, position %s)",
            progress.run_id,
            saved["path"],
            progress.batches,
            progress.rows,
            progress.position,
        )
    else:
        progress = OnlineProgress(uuid.uuid4().hex, config.batch_size or STREAM_BATCH_SIZE)
    out = Path(progress.output_dir) if progress.output_dir else run_dir(config)
    out.mkdir(parents=True, exist_ok=True)
    progress.output_dir = str(out)
    source = open_stream(config.data, schema, window_ms=config.stream_window_ms)
    try:
        source.seek(progress.position)
        if ckpts is not None and saved is None:
            _save(ckpts, config, progress, None)  # the run id, before anything is pushed
            log.info("run %s: checkpoints in %s", progress.run_id, ckpts.path)
        return _train(config, addresses, d, source, schema, ckpts, saved, progress, out)
    finally:
        source.close()


def _train(
    config: TrainerConfig,
    addresses: Sequence[str],
    d: Dist,
    source: StreamSource,
    schema: ColumnSchema,
    ckpts: CheckpointDir | None,
    saved: dict[str, Any] | None,
    progress: OnlineProgress,
    out: Path,
) -> dict[str, Any]:
    wire = ClientConfig(transport_dtype=config.wire_dtype)  # type: ignore[arg-type]
    metrics = OnlineMetrics(config.metrics_port)
    started = time.perf_counter()
    try:
        with PSClient(addresses, wire, client_id=progress.run_id) as client:
            if saved is not None and saved.get("held"):
                held = saved["held"]
                updates = {t: (k.numpy(), g.numpy()) for t, (k, g) in held["updates"].items()}
                client.push_many(updates, seq=held["seq"])  # skipped by the shards if it was applied
            dense_state = {k: saved[k] for k in ("model", "optimizer", "rng") if saved is not None and k in saved}
            online = _Online(config, d, client, source, _Rows(schema, config.bad_lines == "skip"), metrics)
            online.loop(progress, ckpts, dense_state, out, list(addresses))
            shard_stats = client.admin.stats()
    finally:
        metrics.close()
    return online.finish(progress, out, list(addresses), shard_stats, time.perf_counter() - started)


class _Online:
    """The loop of an online run: read, score, train, checkpoint, validate, publish."""

    def __init__(
        self,
        config: TrainerConfig,
        d: Dist,
        client: PSClient,
        source: StreamSource,
        rows: _Rows,
        metrics: OnlineMetrics,
    ) -> None:
        self.config, self.d, self.client, self.source, self.rows, self.metrics = (
            config,
            d,
            client,
            source,
            rows,
            metrics,
        )
        self.run: TrainingPass | None = None
        self.features: list[str] = []
        self.num_dense = 0
        self.guard = WindowGuard(config.guard_auc_drop, config.guard_calibration_min, config.guard_calibration_max)
        self.trained_s = 0.0
        self.run_written = False  # the run directory ps-infer loads (at the first publication)
        self._skipped_at = 0  # run.skipped when the window began
        self._lag_at = 0.0
        self._first_said = False
        self._lag_s = float("inf")  # the lag read before: a warning needs it to grow
        self._behind_said = 0.0

    def loop(
        self,
        progress: OnlineProgress,
        ckpts: CheckpointDir | None,
        dense_state: dict[str, Any],
        out: Path,
        addresses: list[str],
    ) -> None:
        config, source = self.config, self.source
        validation = ProgressiveValidation(config.validation_window, first=len(progress.windows) + 1)
        self.run_written = bool(progress.published) and (out / "manifest.json").exists()
        idle_since = time.monotonic()
        ahead: Lines | None = None
        ahead_batch: tuple[Batch, dict[str, Any]] | None = None
        try:
            while True:
                self._watch_lag()
                lines, ahead = ahead, None
                if lines is None:
                    wait = POLL_S if not config.idle_exit_s else min(POLL_S, config.idle_exit_s)
                    lines = source.next_batch(progress.batch_size, wait)
                if lines is None:
                    if config.idle_exit_s and time.monotonic() - idle_since >= config.idle_exit_s:
                        log.info("no new row for %.1f s (--idle-exit-s): ending the run", config.idle_exit_s)
                        break
                    continue
                idle_since = time.monotonic()
                t0 = time.perf_counter()
                batch, inputs = ahead_batch if ahead_batch is not None else (self.rows.batch(lines), None)
                ahead_batch = None
                if self.run is None:  # made once: not training time
                    self._pass(batch, dense_state)
                    t0 = time.perf_counter()
                run = self._pass(batch, dense_state)
                if inputs is None:  # not read ahead: its lookup starts now, before the next one's
                    inputs = run.inputs(batch)
                    if batch.batch_size:
                        run.prefetch(inputs)
                # The next batch, if it is complete already: its lookup overlaps this step
                # (prefetched after this one's: the embeddings take lookups in step order).
                ahead = source.next_batch(progress.batch_size, 0.0)
                if ahead is not None:
                    nxt = self.rows.batch(ahead)
                    ahead_batch = (nxt, run.inputs(nxt))
                    if nxt.batch_size:
                        run.prefetch(ahead_batch[1])
                window = self._step(run, batch, inputs, progress, ckpts, lines, validation)
                self.trained_s += time.perf_counter() - t0
                if not self._first_said:
                    self._first_said = True
                    log.info("first batch trained (batch %d, %d rows)", progress.batches, batch.batch_size)
                if lines.appended_s is not None:
                    self.metrics.event_to_trained_seconds.set(max(0.0, time.time() - lines.appended_s))
                if window is not None:
                    self._window(window, progress, out, addresses)
            if self.run is not None:
                self.run.emb.flush()
                if ckpts is not None:
                    _save(ckpts, config, progress, self.run)
        finally:
            if self.run is not None:
                self.run.close()

    def _pass(self, batch: Batch, dense_state: dict[str, Any]) -> TrainingPass:
        """The model, made when the first batch says which features the stream has."""
        if self.run is None:
            self.features, self.num_dense = list(batch.sparse), int(batch.dense.shape[1])
            self.run = TrainingPass(
                self.config, self.d, self.client, self.features, self.num_dense, dense_state=dense_state
            )
            self.run.skip_nonfinite = True
        return self.run

    def _step(
        self,
        run: TrainingPass,
        batch: Batch,
        inputs: dict[str, Any],
        progress: OnlineProgress,
        ckpts: CheckpointDir | None,
        lines: Lines,
        validation: ProgressiveValidation,
    ) -> dict[str, Any] | None:
        """Train one batch under the next seq, checkpoint when due; the window it completed, if any."""
        config = self.config
        seq = progress.batches + 1
        checkpoint = ckpts is not None and seq % config.checkpoint_every == 0
        hold = checkpoint and config.mode == "sync"
        window = None
        if batch.batch_size == 0:  # every row malformed and skipped: the seq stays used
            run.emb.push_nothing(seq)
        else:
            if hold:
                run.emb.hold_next_push()
            logits = run.train(batch, inputs, seq)
            window = validation.add(batch.labels, probabilities(logits.cpu()))
        progress.batches, progress.rows, progress.position = seq, progress.rows + batch.batch_size, lines.end
        self.metrics.batches.inc()
        self.metrics.rows.inc(batch.batch_size)
        if checkpoint and ckpts is not None:
            if hold:
                _save(ckpts, config, progress, run, run.emb.held_push())
                run.emb.send_held()
            else:
                run.emb.flush()
                _save(ckpts, config, progress, run)
        if window is not None:
            window["batch"] = seq
        return window

    def _window(self, window: dict[str, Any], progress: OnlineProgress, out: Path, addresses: list[str]) -> None:
        """Check a finished window against the guards; publish it if it passes."""
        run = self.run
        assert run is not None
        failed = self.guard.check(
            window, skipped=run.skipped - self._skipped_at, dense_finite=finite(run.model.parameters())
        )
        self._skipped_at = run.skipped
        window["guards"] = "passed" if not failed else "; ".join(why for _, why in failed)
        self.metrics.window(window, failed)
        _log_window(window)
        if failed:
            self.metrics.serving_held.set(1)
            log.warning(
                "window %d failed its guards (%s): not published (the last publication is %s)",
                window["window"],
                window["guards"],
                progress.published or "none yet",
            )
        elif self.config.publish:
            self._publish(f"{window['batch']:012d}", progress, out, addresses)
        progress.windows = [*progress.windows, window][-WINDOWS_KEPT:]

    def _publish(self, name: str, progress: OnlineProgress, out: Path, addresses: list[str]) -> None:
        """Write the dense weights of publication ``name``, then publish the rows as they are now."""
        run = self.run
        assert run is not None and self.rows.columns is not None
        if not self.run_written:  # what ps-infer loads: manifest, program, the weights at this point
            save_run(
                self.config,
                out,
                run,
                self.config.schema,
                self.features,
                self.num_dense,
                addresses,
                self.client.admin.stats(),
                {"run_id": progress.run_id, "online": True},
                columns=self.rows.columns,
            )
            self.run_written = True
        target = published_dir(out, name)
        target.mkdir(parents=True, exist_ok=True)
        tmp = target / ".dense.pt.tmp"
        torch.save({k: v.detach().cpu() for k, v in run.model.state_dict().items()}, tmp)
        os.replace(tmp, target / "dense.pt")
        run.emb.flush()  # every push so far applied: the publication holds them all, and no later one
        answers = self.client.admin.publish(name)
        held = [a["held_by"] for a in answers if a["held"]]
        if held:
            self.metrics.serving_held.set(1)
            log.warning("publication %s refused: publishing is %s", name, held[0])
            return
        missed = sum(a["followers"] - a["exact"] for a in answers)
        progress.published = name
        self.metrics.publications.inc()
        self.metrics.published_batch.set(progress.batches)
        self.metrics.serving_held.set(0)
        log.info(
            "published %s (batch %d) to %d serving shards%s",
            name,
            progress.batches,
            sum(a["followers"] for a in answers),
            f"; {missed} read it too slowly and wait for the next" if missed else "",
        )

    def _watch_lag(self) -> None:
        """Every ``LAG_EVERY_S``: the stream's lag as metrics, and a warning while training falls behind."""
        now = time.monotonic()
        if now - self._lag_at < LAG_EVERY_S:
            return
        self._lag_at = now
        lag = self.source.lag()
        if lag.rows is not None:
            self.metrics.lag_rows.set(lag.rows)
        self.metrics.lag_seconds.set(lag.seconds)
        falling, self._lag_s = lag.seconds >= self._lag_s, lag.seconds
        if lag.seconds > BEHIND_S and falling and now - self._behind_said >= BEHIND_SAY_EVERY_S:
            self._behind_said = now
            log.warning(
                "training is %.0f s behind the head of %s (%s rows): it does not keep up with the stream",
                lag.seconds,
                self.config.data,
                "?" if lag.rows is None else lag.rows,
            )

    def finish(
        self,
        progress: OnlineProgress,
        out: Path,
        addresses: list[str],
        shard_stats: list[dict[str, Any]],
        elapsed_s: float,
    ) -> dict[str, Any]:
        """The run's metrics, written with the run directory."""
        config, run = self.config, self.run
        metrics: dict[str, Any] = {
            "config": {k: str(v) for k, v in dataclasses.asdict(config).items()},
            "run_id": progress.run_id,
            "batches": progress.batches,
            "rows": progress.rows,
            "position": progress.position,
            "published": progress.published,
            "windows": progress.windows,
            "elapsed_s": elapsed_s,
            "output_dir": str(out),
        }
        if run is not None:
            run.train_s = self.trained_s
            metrics.update(run.stats(), skipped_batches=run.skipped)
        if self.rows.bad is not None and self.rows.bad.count:
            metrics["bad_lines"] = {"count": self.rows.bad.count, "first": self.rows.bad.first}
            log.warning("%s: %s (--bad-lines skip)", config.data, self.rows.bad)
        if run is not None and self.rows.columns is not None:
            save_run(
                config,
                out,
                run,
                config.schema,
                self.features,
                self.num_dense,
                addresses,
                shard_stats,
                metrics,
                columns=self.rows.columns,
            )
            log.info(
                "trained %d batches (%d rows) from %s; wrote %s", progress.batches, progress.rows, config.data, out
            )
        else:
            (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
            log.info("no row arrived from %s: nothing trained", config.data)
        return metrics


def _log_window(w: dict[str, Any]) -> None:
    def fmt(v: float | None, spec: str = ".4f") -> str:
        return "n/a" if v is None else format(v, spec)

    log.info(
        "window %d: rows=%d auc=%s logloss=%s calibration=%s (up to batch %d): %s",
        w["window"],
        w["rows"],
        fmt(w["auc"]),
        fmt(w["logloss"]),
        fmt(w["calibration"], ".3f"),
        w["batch"],
        w["guards"],
    )
