"""Prometheus metrics of an online run (``--metrics-port``): validation windows, guards,
publications, and how far training is behind its stream.

Names start with ``ps_trainer_`` and carry their unit; labels are a guard's name at
most. Updated once per batch or window, never per row. The dashboard in
``deploy/grafana`` has a row of panels for them.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

__all__ = ["OnlineMetrics"]

log = logging.getLogger("worker.trainer")

GUARDS = ("auc", "calibration", "nonfinite", "dense")


class OnlineMetrics:
    """The metrics, served at ``http://HOST:port/metrics`` when ``port`` is given (0: any free port, see ``port``)."""

    def __init__(self, port: int | None = None, host: str = "0.0.0.0") -> None:
        r = self.registry = CollectorRegistry()
        self.rows = Counter(
            "ps_trainer_rows", "Rows trained from the stream (malformed rows skipped excluded)", registry=r
        )
        self.batches = Counter("ps_trainer_batches", "Batches trained from the stream", registry=r)
        self.windows = Counter("ps_trainer_windows", "Progressive-validation windows completed", registry=r)
        self.window_auc = Gauge(
            "ps_trainer_window_auc", "AUC of the latest window (rows scored before training)", registry=r
        )
        self.window_logloss = Gauge("ps_trainer_window_logloss", "Logloss of the latest window", registry=r)
        self.window_calibration = Gauge(
            "ps_trainer_window_calibration", "Mean prediction / mean label of the latest window", registry=r
        )
        self.guard_failures = Counter(
            "ps_trainer_guard_failures", "Windows that failed a guard, by guard", ["guard"], registry=r
        )
        for guard in GUARDS:
            self.guard_failures.labels(guard)
        self.publications = Counter("ps_trainer_publications", "Windows published to serving", registry=r)
        self.published_batch = Gauge(
            "ps_trainer_published_batch", "Batch number of the newest publication (0: none yet)", registry=r
        )
        self.serving_held = Gauge(
            "ps_trainer_serving_held",
            "1 while serving is held at an older publication (a window failed its guards, or publishing is held)",
            registry=r,
        )
        self.lag_rows = Gauge("ps_trainer_stream_lag_rows", "Rows in the stream not trained yet", registry=r)
        self.lag_seconds = Gauge(
            "ps_trainer_stream_lag_seconds", "Age of the oldest row in the stream not trained yet", registry=r
        )
        self.pushed_back = Counter(
            "ps_trainer_pushed_back_calls",
            "Calls the shards refused for load (RESOURCE_EXHAUSTED at their --threads limit), each retried after a backoff",
            registry=r,
        )
        self.event_to_trained_seconds = Gauge(
            "ps_trainer_event_to_trained_seconds",
            "From the latest batch's last row landing in the stream to its push being applied",
            registry=r,
        )
        self.port: int | None = None
        self._server: Any = None
        if port is not None:
            self._server, _ = start_http_server(port, addr=host, registry=r)
            self.port = int(self._server.server_port)
            log.info("metrics at http://%s:%d/metrics", host, self.port)

    def window(self, w: dict[str, Any], failed: list[tuple[str, str]]) -> None:
        self.windows.inc()
        for gauge, key in (
            (self.window_auc, "auc"),
            (self.window_logloss, "logloss"),
            (self.window_calibration, "calibration"),
        ):
            gauge.set(float("nan") if w.get(key) is None else w[key])
        for guard in {g for g, _ in failed}:
            self.guard_failures.labels(guard).inc()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
