"""The loop of an online run (``worker.online``): read, score, train, checkpoint, validate, publish.

Every worker of a group runs it on the part of the stream it owns. The workers step
together (the dense tower trains under DDP): at each step they share, in one small
all-reduce, whether each has a batch, how many rows, and whether it has been idle long
enough to stop. A worker without a batch adds zero gradients to a step that others
train, and the others' loss is scaled so the step averages over those that trained.
Checkpoints, validation windows and publications fall on the group's steps: rank 0
gathers what it needs (positions, predictions) and decides; a publication waits until
every worker's pushes are applied and lets none push before the shards have it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from client import PSClient
from worker.config import TrainerConfig
from worker.data import Batch
from worker.distributed import Dist
from worker.export import probabilities
from worker.guard import WindowGuard, finite
from worker.loop import TrainingPass
from worker.online_metrics import OnlineMetrics
from worker.online_state import OnlineProgress, ProgressiveValidation, StreamRows, save_checkpoint, window_figures
from worker.published import published_dir
from worker.results import save_run
from worker.resume import CheckpointDir
from worker.schema import SchemaColumns
from worker.stream import Lines, StreamSource
from worker.stream.readahead import ReadAhead

__all__ = ["OnlineLoop"]

log = logging.getLogger("worker.trainer")

POLL_S = 1.0  # one worker: longest wait for a batch before the loop looks at the clock again
GROUP_POLL_S = 0.05  # several: a worker waiting longer would hold up the others' step
LAG_EVERY_S = 5.0  # how often the stream's lag is read
BEHIND_S = 60.0  # lag that makes the trainer say it does not keep up (at most every BEHIND_SAY_EVERY_S)
BEHIND_SAY_EVERY_S = 60.0
PUSHED_BACK_SAY_EVERY_S = 60.0  # how often the trainer says the shards refused its calls for load
WINDOWS_KEPT = 1000  # in the checkpoint and metrics: the latest windows


class _Group:
    """The collectives of a group of workers (nothing to do for one)."""

    def __init__(self, d: Dist) -> None:
        self.d = d

    def step(self, has: bool, rows: int, idle: bool) -> tuple[int, int, bool]:
        """``(workers with a batch, rows in them, whether every worker is idle)`` of this step."""
        if self.d.world == 1:
            return int(has), rows, idle
        t = torch.tensor([int(has), rows, int(idle)], dtype=torch.int64, device=self.d.device)
        dist.all_reduce(t)
        active, total, idle_n = (int(x) for x in t.tolist())
        return active, total, idle_n == self.d.world

    def gather(self, obj: Any) -> list[Any]:
        """Every worker's ``obj`` on rank 0 (``[]`` elsewhere)."""
        if self.d.world == 1:
            return [obj]
        out: list[Any] = [None] * self.d.world if self.d.rank == 0 else []
        dist.gather_object(obj, out if self.d.rank == 0 else None, dst=0)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        if self.d.world == 1:
            return [obj]
        out: list[Any] = [None] * self.d.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every worker."""
        if self.d.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.d.world > 1:
            dist.barrier()


class OnlineLoop:
    """One worker's part of an online run (see the module)."""

    def __init__(
        self,
        config: TrainerConfig,
        d: Dist,
        client: PSClient,
        source: StreamSource,
        rows: StreamRows,
        metrics: OnlineMetrics,
        progress: OnlineProgress,
    ) -> None:
        self.config, self.d, self.client, self.source, self.rows = config, d, client, source, rows
        self.metrics, self.progress, self.group = metrics, progress, _Group(d)
        self.mine = progress.parts[d.rank]
        self.out = Path(progress.output_dir or ".")
        self.training: TrainingPass | None = None
        self.features: list[str] = []
        self.num_dense = 0
        self.columns: Any = None
        self.guard = WindowGuard(config.guard_auc_drop, config.guard_calibration_min, config.guard_calibration_max)
        self.validation = ProgressiveValidation()
        self.trained_s = 0.0
        self._window_rows = 0  # rows the group trained since the window began
        self._skipped_at = 0  # run.skipped when the window began
        self._lag_at = 0.0
        self._lag_s = float("inf")  # the lag read before: a warning needs it to grow
        self._behind_said = 0.0
        self._refused = 0  # calls the shards refused for load, counted into the metric so far
        self._refused_said = (0.0, 0)  # when the trainer last said so, and the count then
        self._first_said = False

    # -- the loop -------------------------------------------------------------------
    def run(
        self,
        ckpts: CheckpointDir | None,
        dense_state: dict[str, Any],
        addresses: list[str],
        saved_inputs: dict[str, Any] | None = None,
    ) -> None:
        """Train on the stream until it ends (``--idle-exit-s``) or forever. ``dense_state``
        and ``saved_inputs``: what the checkpoint resumed from holds (empty, None: none)."""
        config, d = self.config, self.d
        self.run_written = bool(self.progress.published) and (self.out / "manifest.json").exists()
        wait_s = POLL_S if d.world == 1 else GROUP_POLL_S
        if config.idle_exit_s:
            wait_s = min(wait_s, config.idle_exit_s)
        ahead: tuple[Lines, Batch, dict[str, Any] | None] | None = None
        reader = ReadAhead(self.source, self.rows.batch, self.progress.batch_size)
        reader.start()
        try:
            while True:
                self._watch()
                lines: Lines | None
                batch: Batch | None
                inputs: dict[str, Any] | None
                if ahead is not None:
                    (lines, batch, inputs), ahead = ahead, None
                else:
                    got = reader.get(wait_s)
                    lines, batch, inputs = (got[0], got[1], None) if got is not None else (None, None, None)
                idle = bool(config.idle_exit_s) and lines is None and reader.quiet_s() >= config.idle_exit_s
                active, step_rows, all_idle = self.group.step(
                    lines is not None, 0 if batch is None else batch.batch_size, idle
                )
                if active == 0:
                    if all_idle:
                        if d.rank == 0:
                            log.info("no new row for %.1f s (--idle-exit-s): ending the run", config.idle_exit_s)
                        break
                    continue
                run = self._pass(batch, dense_state)  # made once, before the clock starts
                t0 = time.perf_counter()
                if batch is not None and inputs is None:  # not read ahead: its lookup starts now
                    inputs = run.inputs(batch)
                    if batch.batch_size:
                        run.prefetch(inputs)
                # The next batch, if it is complete already: its lookup overlaps this step
                # (prefetched after this one's: the embeddings take lookups in step order).
                if batch is not None and (got := reader.get(0.0)) is not None:
                    nxt_lines, nxt = got
                    nxt_inputs = run.inputs(nxt)
                    if nxt.batch_size:
                        run.prefetch(nxt_inputs)
                    ahead = (nxt_lines, nxt, nxt_inputs)
                checkpoint = ckpts is not None and (self.progress.steps + 1) % config.checkpoint_every == 0
                held = self._step(run, batch, inputs, lines, active, hold=checkpoint and self._wal)
                self.progress.steps += 1
                self.trained_s += time.perf_counter() - t0
                self._window_rows += step_rows
                if lines is not None and lines.appended_s is not None:
                    self.metrics.event_to_trained_seconds.set(max(0.0, time.time() - lines.appended_s))
                if not self._first_said and batch is not None:
                    self._first_said = True
                    log.info("first batch trained (batch %d, %d rows)", self.mine["batches"], batch.batch_size)
                if checkpoint and ckpts is not None:
                    self._checkpoint(ckpts, held)
                if self._window_rows >= config.validation_window:
                    self._window_rows = 0
                    self._close_window(addresses)
            if self.training is None and saved_inputs is not None and self.progress.steps:
                # Resumed with no row left to read (stopped after its last checkpoint, before it
                # wrote the run): the model is the checkpoint's, and the run is written from it.
                self._rebuild(saved_inputs, dense_state)
            if self.training is not None:
                self.training.emb.flush()
                if ckpts is not None:
                    self._checkpoint(ckpts, None)
            parts = self.group.gather(dict(self.mine))  # the group's totals, for rank 0's metrics
            if self.d.rank == 0:
                self.progress.parts = parts
                self.mine = parts[0]
        finally:
            reader.close()
            if self.training is not None:
                self.training.close()

    @property
    def _wal(self) -> bool:
        """Whether a checkpoint carries its step's push (sync mode, one worker: see ``worker.online``)."""
        return self.config.mode == "sync" and self.d.world == 1

    def _pass(self, batch: Batch | None, dense_state: dict[str, Any]) -> TrainingPass:
        """The model, made (by every worker together) when the first batch says which
        features the stream has; a worker without a batch yet takes them from one with."""
        if self.training is None:
            mine = None if batch is None else (list(batch.sparse), int(batch.dense.shape[1]), self.rows.columns)
            found = next(x for x in self.group.all_gather(mine) if x is not None)
            self.features, self.num_dense, self.columns = found
            run = TrainingPass(self.config, self.d, self.client, self.features, self.num_dense, dense_state=dense_state)
            run.skip_nonfinite = True
            self.training = run
        return self.training

    def saved_inputs(self) -> dict[str, Any] | None:
        """What the model was built for, as a checkpoint keeps it (plain values)."""
        if self.training is None:
            return None
        columns = None
        if self.columns is not None:
            columns = {
                f.name: list(v) if isinstance(v := getattr(self.columns, f.name), tuple) else dict(v)
                for f in dataclasses.fields(self.columns)
            }
        return {"features": list(self.features), "num_dense": int(self.num_dense), "columns": columns}

    def _rebuild(self, saved: dict[str, Any], dense_state: dict[str, Any]) -> None:
        """The model of ``saved_inputs``, with the checkpoint's ``dense_state`` (every worker together)."""
        saved_columns = saved.get("columns")
        columns = None
        if saved_columns is not None:
            columns = SchemaColumns(
                categorical=tuple(saved_columns["categorical"]),
                dense=tuple(saved_columns["dense"]),
                buckets=tuple(saved_columns["buckets"]),
                seeds=dict(saved_columns["seeds"]),
                multi=dict(saved_columns.get("multi", {})),
            )
        self.features, self.num_dense, self.columns = list(saved["features"]), int(saved["num_dense"]), columns
        run = TrainingPass(self.config, self.d, self.client, self.features, self.num_dense, dense_state=dense_state)
        run.skip_nonfinite = True
        self.training = run

    def _step(
        self,
        run: TrainingPass,
        batch: Batch | None,
        inputs: dict[str, Any] | None,
        lines: Lines | None,
        active: int,
        hold: bool,
    ) -> tuple[int | None, dict[str, Any]] | None:
        """Train this worker's batch (or add zero gradients without one) under its next
        seq; with ``hold``, keep its push for the checkpoint and return it."""
        if batch is None or lines is None:
            run._idle_step(None)
            return None
        seq = int(self.mine["batches"]) + 1
        held = None
        if batch.batch_size == 0:  # every row malformed and skipped: the seq stays used
            run.emb.push_nothing(seq)
        else:
            if hold:
                run.emb.hold_next_push()
            scale = self.d.world / active if active < self.d.world else None
            logits = run.train(batch, inputs or run.inputs(batch), seq, scale)
            self.validation.add(batch.labels, probabilities(logits.cpu()))
            if hold:
                held = run.emb.held_push()
        self.mine.update(batches=seq, rows=int(self.mine["rows"]) + batch.batch_size, position=lines.end)
        self.metrics.batches.inc()
        self.metrics.rows.inc(batch.batch_size)
        return held

    def _checkpoint(self, ckpts: CheckpointDir, held: Any) -> None:
        """Once every worker's pushes so far are applied, rank 0 writes the group's progress
        (a held push: sent once the file is safe)."""
        run = self.training
        assert run is not None
        if held is None:
            run.emb.flush()
        parts = self.group.gather(dict(self.mine))
        if self.d.rank == 0:
            self.progress.parts = parts
            save_checkpoint(ckpts, self.config, self.progress, run, held, self.saved_inputs())
            self.mine = self.progress.parts[0]
        if held is not None:
            run.emb.send_held()

    # -- windows and publications ---------------------------------------------------
    def _close_window(self, addresses: list[str]) -> None:
        """The group's window: rank 0 scores it against the guards; it is published if it passes."""
        run = self.training
        assert run is not None
        y, p = self.validation.take()
        parts = self.group.gather((y, p, run.skipped - self._skipped_at))
        self._skipped_at = run.skipped
        decision = None
        if self.d.rank == 0:
            window = window_figures(
                len(self.progress.windows) + 1,
                *(torch.cat([torch.from_numpy(x[i]) for x in parts]).numpy() for i in (0, 1)),
            )
            window["batch"] = self.progress.steps
            failed = self.guard.check(
                window, skipped=sum(x[2] for x in parts), dense_finite=finite(run.model.parameters())
            )
            window["guards"] = "passed" if not failed else "; ".join(why for _, why in failed)
            self.metrics.window(window, failed)
            _log_window(window)
            if failed:
                self.metrics.serving_held.set(1)
                log.warning(
                    "window %d failed its guards (%s): not published (the last publication is %s)",
                    window["window"],
                    window["guards"],
                    self.progress.published or "none yet",
                )
            decision = (window, not failed and self.config.publish)
        window, publish = self.group.broadcast(decision)
        self.progress.windows = [*self.progress.windows, window][-WINDOWS_KEPT:]
        if publish:
            self._publish(f"{self.progress.steps:012d}", addresses)

    def _publish(self, name: str, addresses: list[str]) -> None:
        """Every worker's pushes applied, rank 0 writes the dense weights of publication
        ``name`` and publishes the rows as they are now; no worker pushes meanwhile."""
        run = self.training
        assert run is not None
        run.emb.flush()  # every push so far applied: the publication holds them all, and no later one
        self.group.barrier()
        published = ""
        if self.d.rank == 0:
            if not self.run_written:  # what ps-infer loads: manifest, program, the weights at this point
                self._save_run(
                    run, addresses, self.client.admin.stats(), {"run_id": self.progress.run_id, "online": True}
                )
                self.run_written = True
            target = published_dir(self.out, name)
            target.mkdir(parents=True, exist_ok=True)
            tmp = target / ".dense.pt.tmp"
            torch.save({k: v.detach().cpu() for k, v in run.model.state_dict().items()}, tmp)
            os.replace(tmp, target / "dense.pt")
            answers = self.client.admin.publish(name)
            held = [a["held_by"] for a in answers if a["held"]]
            if held:
                self.metrics.serving_held.set(1)
                log.warning("publication %s refused: publishing is %s", name, held[0])
            else:
                published = name
                missed = sum(a["followers"] - a["exact"] for a in answers)
                self.metrics.publications.inc()
                self.metrics.published_batch.set(self.progress.steps)
                self.metrics.serving_held.set(0)
                log.info(
                    "published %s (step %d) to %d serving shards%s",
                    name,
                    self.progress.steps,
                    sum(a["followers"] for a in answers),
                    f"; {missed} read it too slowly and wait for the next" if missed else "",
                )
        published = self.group.broadcast(published)  # also: nobody pushes before the shards have it
        if published:
            self.progress.published = published

    def _save_run(
        self, run: TrainingPass, addresses: list[str], stats: list[dict[str, Any]], metrics: dict[str, Any]
    ) -> None:
        save_run(
            self.config,
            self.out,
            run,
            self.config.schema,
            self.features,
            self.num_dense,
            addresses,
            stats,
            metrics,
            columns=self.columns,
        )

    def _watch(self) -> None:
        """Every ``LAG_EVERY_S``: the stream's lag and the shards' push-back, as metrics and warnings."""
        now = time.monotonic()
        if now - self._lag_at < LAG_EVERY_S:
            return
        self._lag_at = now
        self._watch_lag(now)
        self._watch_push_back(now)

    def _watch_push_back(self, now: float, *, last: bool = False) -> None:
        """Calls the shards refused for load (RESOURCE_EXHAUSTED at their ``--threads`` limit).
        The client retries each after a backoff, so training slows to the shards' pace and
        the stream position does not move past a batch until its push is applied."""
        total = self.client.admin.refusals()
        if total > self._refused:
            self.metrics.pushed_back.inc(total - self._refused)
        self._refused = total
        said_at, said = self._refused_said
        if total > said and (last or now - said_at >= PUSHED_BACK_SAY_EVERY_S):
            self._refused_said = (now, total)
            log.warning(
                "the shards refused %d calls for load since %s (RESOURCE_EXHAUSTED: at their --threads limit): "
                "training slows to their pace, each call retried after a backoff; the stream position is kept",
                total - said,
                "the start" if said_at == 0.0 else f"{now - said_at:.0f} s ago",
            )

    def _watch_lag(self, now: float) -> None:
        """The stream's lag as metrics, and a warning while training falls behind."""
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

    # -- the end --------------------------------------------------------------------
    def finish(self, addresses: list[str], shard_stats: list[dict[str, Any]], elapsed_s: float) -> dict[str, Any]:
        """The run's metrics; rank 0 writes them with the run directory."""
        config, run, progress = self.config, self.training, self.progress
        self._watch_push_back(time.monotonic(), last=True)
        metrics: dict[str, Any] = {
            "config": {k: str(v) for k, v in dataclasses.asdict(config).items()},
            "run_id": progress.run_id,
            "workers": progress.world,
            "steps": progress.steps,
            "batches": progress.batches if self.d.rank == 0 else self.mine["batches"],
            "rows": progress.rows if self.d.rank == 0 else self.mine["rows"],
            "position": self.mine["position"] if progress.world == 1 else [p["position"] for p in progress.parts],
            "published": progress.published,
            "windows": progress.windows,
            "elapsed_s": elapsed_s,
            "pushed_back_calls": self._refused,
            "output_dir": str(self.out),
        }
        if run is not None:
            run.train_s = self.trained_s
            metrics.update(run.stats(), skipped_batches=run.skipped)
        if self.rows.bad is not None and self.rows.bad.count:
            metrics["bad_lines"] = {"count": self.rows.bad.count, "first": self.rows.bad.first}
            log.warning("%s: %s (--bad-lines skip)", config.data, self.rows.bad)
        if self.d.rank != 0:
            return metrics
        if run is not None and self.columns is not None:
            self._save_run(run, addresses, shard_stats, metrics)
            log.info(
                "trained %d batches (%d rows) from %s; wrote %s", progress.batches, progress.rows, config.data, self.out
            )
        else:
            (self.out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
            log.info("no row arrived from %s: nothing trained", config.data)
        return metrics


def _log_window(w: dict[str, Any]) -> None:
    def fmt(v: float | None, spec: str = ".4f") -> str:
        return "n/a" if v is None else format(v, spec)

    log.info(
        "window %d: rows=%d auc=%s logloss=%s calibration=%s (up to step %d): %s",
        w["window"],
        w["rows"],
        fmt(w["auc"]),
        fmt(w["logloss"]),
        fmt(w["calibration"], ".3f"),
        w["batch"],
        w["guards"],
    )
