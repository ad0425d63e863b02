"""``ps-infer``: serve a trained model's ``Predict`` (``protos/infer.proto``) over gRPC.

``ps-infer --model runs/latest --ps HOST:PORT,HOST:PORT`` loads the run's exported
model and manifest (``worker.export``), checks that the shards are the cluster it was
trained on (shard count and order, tables, dims, seeds, rows, the lineage of each shard's rows;
``worker.preflight``, which waits up to ``--wait-s`` for serving shards still loading), and
serves ``ps.v1.Predictor`` with gRPC health and reflection:

* each request is checked and hashed on its own gRPC thread (``Predictor.encode``); a
  single batcher thread then scores concurrent requests together: it takes what is
  queued, waits up to ``--batch-wait-ms`` for requests still being encoded (never when
  none are), up to ``--max-batch-rows`` rows, and makes one lookup (one RPC per shard)
  and one model call for all of them. Scores do not depend on the batching (see
  ``worker.predictor``);
* at most ``--max-concurrent`` requests are in progress; one more is refused at once
  with RESOURCE_EXHAUSTED, never queued;
* a bad request gets INVALID_ARGUMENT naming the field; shards that do not answer,
  UNAVAILABLE or DEADLINE_EXCEEDED;
* SIGTERM or SIGINT: health turns NOT_SERVING, new calls are refused, calls in progress
  finish (up to ``--grace-s``), and the process exits 0.

Exit codes: 0 stopped cleanly; 1 cannot start (the run cannot be served, the shards lack
its tables, the address is taken: the message says which); 2 a bad setting.

Example (a client, ``client.PredictClient``, which needs no torch; the README starts a predictor):
    with PredictClient("127.0.0.1:50070") as predictor:
        scores = predictor.predict(context={"C1": 3}, candidates=[{"C2": 5, ...}, {"C2": 8, ...}])
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt
import torch
from google.protobuf.message import DecodeError

from client import ClientConfig, PSClient, PSError, parse_addresses
from protos import infer_pb2 as pb
from protos.columns import Column, InvalidRequest, decode_request, request_of
from protos.rpc.process import run_server
from protos.rpc.server import RunningServer, Status, start_server, status_boundary
from protos.rpc.settings import describe_settings, load_settings
from protos.services import PREDICT_SERVICE
from worker.export import load_model
from worker.predictor import MIN_ROWS, Encoded, Predictor
from worker.preflight import check_shards

__all__ = ["InferConfig", "InferServer", "build_server", "main"]

ENV_PREFIX = "INFER_"
_NO_DEADLINE_S = 10**6  # time_remaining() beyond this: the call has no deadline
_SPARE_THREADS = 8  # gRPC threads beyond --max-concurrent: refusals and health checks never wait

log = logging.getLogger(__name__)
F32 = npt.NDArray[np.float32]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class InferConfig:
    """Settings of ``ps-infer`` (``--help`` lists them); raises ``ValueError`` naming a bad one."""

    model: Path | None = field(default=None, metadata=_help("run directory to serve (e.g. runs/latest); required"))
    ps: tuple[str, ...] = field(
        default=(),
        metadata=_help(
            "shard addresses in shard order, ',' between shards, '+' between the replicas of one "
            "(h:1+h:2,h:3; '|' also works quoted); required"
        ),
    )
    ps_file: Path | None = field(
        default=None,
        metadata=_help(
            "instead of --ps: a file holding the addresses in --ps syntax, read again every second, so that "
            "replicas can join and leave while this serves (a 'dns:HOST:PORT' entry in either names every "
            "address HOST resolves to)"
        ),
    )
    listen: str = field(default="127.0.0.1:0", metadata=_help("HOST:PORT to serve on (port 0: any free port)"))
    port_file: Path | None = field(default=None, metadata=_help("write the bound port here once serving"))
    max_candidates: int = field(default=1000, metadata=_help("most candidates one request may carry"))
    max_concurrent: int = field(default=64, metadata=_help("requests in progress at once; more: RESOURCE_EXHAUSTED"))
    batch_wait_ms: float = field(
        default=2.0, metadata=_help("how long a micro-batch waits for requests still being decoded")
    )
    max_batch_rows: int = field(default=8192, metadata=_help("most candidates scored in one model call"))
    deadline_s: float = field(default=5.0, metadata=_help("deadline of the row lookups of one micro-batch"))
    hedge_after_ms: float = field(
        default=0.0,
        metadata=_help(
            "with replicas: a shard's lookup not answered after this long is sent to a second replica too, and "
            "the first answer wins (about the 95th percentile of a healthy lookup); 0: off"
        ),
    )
    wait_s: float = field(
        default=10.0,
        metadata=_help(
            "at start, how long to keep checking shards that are still loading (a serving shard not caught up "
            "with its training shard yet, a shard not answering yet) before giving up; 0: check once"
        ),
    )
    grace_s: float = field(default=10.0, metadata=_help("on SIGTERM, how long calls in progress may take to finish"))
    drain_s: float = field(
        default=5.0,
        metadata=_help(
            "on SIGTERM, seconds to report NOT_SERVING (health) while still answering, so that load balancers "
            "move away first; then --grace-s. SIGINT skips it"
        ),
    )
    threads: int = field(default=0, metadata=_help("torch threads for the model (0: torch's default)"))
    log_level: str = field(default="INFO", metadata=_help("DEBUG, INFO, WARNING or ERROR"))
    metrics_port: int | None = field(
        default=None, metadata=_help("serve Prometheus metrics at http://HOST:PORT/metrics (HOST of --listen)")
    )
    tls_cert: Path | None = field(default=None, metadata=_help("PEM certificate chain: serve TLS (with --tls-key)"))
    tls_key: Path | None = field(default=None, metadata=_help("PEM private key of --tls-cert"))
    tls_client_ca: Path | None = field(
        default=None, metadata=_help("PEM CA: callers must present a certificate it signed (mutual TLS)")
    )
    auth_token_file: Path | None = field(
        default=None,
        metadata=_help(
            "file of 'ROLE TOKEN' lines, each token at least 16 characters and listed once: "
            "Predict needs a read token or better"
        ),
    )

    def __post_init__(self) -> None:
        checks = [
            (self.model is not None, "model: required (--model DIR, a run directory such as runs/latest)"),
            (
                bool(self.ps) or self.ps_file is not None,
                "ps: required (--ps HOST:PORT,HOST:PORT, the shards in shard order; HOST:PORT+HOST:PORT for replicas; "
                "or --ps-file FILE)",
            ),
            (not (self.ps and self.ps_file is not None), "ps and ps_file: give one"),
            (0 <= self.drain_s < float("inf"), f"drain_s={self.drain_s}: must be a finite number >= 0"),
            (0 <= self.hedge_after_ms < float("inf"), f"hedge_after_ms={self.hedge_after_ms}: must be >= 0 (0: off)"),
            (self.max_candidates >= 1, f"max_candidates={self.max_candidates}: must be >= 1"),
            (self.max_concurrent >= 1, f"max_concurrent={self.max_concurrent}: must be >= 1"),
            (self.batch_wait_ms >= 0, f"batch_wait_ms={self.batch_wait_ms}: must be >= 0"),
            (
                self.max_batch_rows >= self.max_candidates,
                f"max_batch_rows={self.max_batch_rows}: must be >= max_candidates={self.max_candidates}",
            ),
            (self.deadline_s > 0 and self.grace_s >= 0, "deadline_s must be > 0 and grace_s >= 0"),
            (0 <= self.wait_s < float("inf"), f"wait_s={self.wait_s}: must be a finite number >= 0"),
            (self.threads >= 0, f"threads={self.threads}: must be >= 0"),
            ((self.tls_cert is None) == (self.tls_key is None), "tls_cert and tls_key go together: give both"),
            (self.tls_client_ca is None or self.tls_cert is not None, "tls_client_ca needs tls_cert and tls_key"),
            (self.metrics_port is None or 0 <= self.metrics_port <= 65535, "metrics_port: must be in [0, 65535]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.ps:
            self.addresses()  # raises InvalidRequestError, a ValueError, naming a bad address

    def addresses(self) -> list[list[str]]:
        """``ps`` as ``PSClient`` takes it: per shard, its replicas (``client.parse_addresses``)."""
        return parse_addresses(",".join(self.ps))

    def client(self) -> PSClient:
        """The client of the shards: of ``ps``, or of ``ps_file``'s addresses as they change.
        Raises ``InvalidRequestError`` (a ``ValueError``) for a file it cannot read or parse."""
        hedge_s = self.hedge_after_ms / 1000 if self.hedge_after_ms else None
        config = ClientConfig(deadline_s=self.deadline_s, hedge_after_s=hedge_s)
        if self.ps_file is not None:
            return PSClient(addresses_file=self.ps_file, config=config)
        return PSClient(self.addresses(), config)

    @property
    def shards_named(self) -> str:
        """The shards as the user gave them, for messages."""
        return ",".join(self.ps) if self.ps else f"--ps-file {self.ps_file}"


# --- request path


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Gate:
    """Admission: at most ``limit`` requests in progress; counts those still being encoded."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self.in_flight = 0
        self.encoding = 0

    def enter(self) -> None:
        with self._lock:
            if self.in_flight >= self._limit:
                raise _Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self._limit} requests in progress (--max-concurrent): retry later or elsewhere",
                )
            self.in_flight += 1
            self.encoding += 1

    def encoded(self) -> None:
        with self._lock:
            self.encoding -= 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1


@dataclass
class _Item:
    encoded: Encoded
    future: futures.Future[F32]


class Batcher:
    """Scores queued requests in micro-batches on one thread (see the module docstring).

    ``submit`` is thread-safe and returns a ``Future`` of the request's scores (or the
    exception ``Predictor.score`` raised for its batch). ``close`` scores what is queued
    and stops the thread.
    """

    def __init__(
        self,
        predictor: Predictor,
        *,
        wait_s: float,
        max_rows: int,
        encoding: Callable[[], int],
        observe: Callable[[int], None] | None = None,
    ) -> None:
        self._predictor, self._wait_s, self._max_rows, self._encoding = predictor, wait_s, max_rows, encoding
        self._observe = observe  # told the candidates of each micro-batch
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ps-infer-batcher", daemon=True)
        self._thread.start()

    def submit(self, encoded: Encoded) -> futures.Future[F32]:
        future: futures.Future[F32] = futures.Future()
        self._queue.put(_Item(encoded, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        carry: _Item | None = None
        while True:
            first = carry if carry is not None else self._queue.get()
            carry = None
            if first is None:
                return
            items, rows, stop = [first], first.encoded.n, False
            deadline = time.monotonic() + self._wait_s
            while rows < self._max_rows:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    # Wait only for requests that are being decoded now, and not past the deadline.
                    left = deadline - time.monotonic()
                    if left <= 0 or self._encoding() == 0:
                        break
                    try:
                        item = self._queue.get(timeout=min(left, 0.0005))
                    except queue.Empty:
                        continue
                if item is None:
                    stop = True
                    break
                if rows + item.encoded.n > self._max_rows:
                    carry = item
                    break
                items.append(item)
                rows += item.encoded.n
            self._score(items)
            if stop:
                return

    def _score(self, items: list[_Item]) -> None:
        if self._observe is not None:
            self._observe(sum(i.encoded.n for i in items))
        try:
            results = self._predictor.score([i.encoded for i in items])
        except BaseException as exc:
            for i in items:
                i.future.set_exception(exc)
            return
        for i, scores in zip(items, results):
            i.future.set_result(scores)


class _Servicer:
    def __init__(self, predictor: Predictor, batcher: Batcher, gate: _Gate, run: str) -> None:
        self._predictor, self._batcher, self._gate, self._run = predictor, batcher, gate, run

    def Predict(self, body: bytes, context: grpc.ServicerContext) -> pb.PredictResponse:
        with status_boundary(context, "Predict", _status_of, "ps-infer"):
            try:  # decoded here, not by gRPC: bytes that do not decode get INVALID_ARGUMENT, not INTERNAL
                request = pb.PredictRequest.FromString(body)
            except DecodeError as exc:
                raise InvalidRequest(f"request: not a PredictRequest ({exc})") from None
            self._gate.enter()
            try:
                try:
                    encoded = self._predictor.encode(*decode_request(request))
                finally:
                    self._gate.encoded()
                scores = self._batcher.submit(encoded).result(timeout=_time_left_s(context))
            finally:
                self._gate.leave()
            return pb.PredictResponse(scores=scores.astype("<f4").tobytes(), model=self._run)
        raise AssertionError("unreachable: the status boundary aborts the call")


def _time_left_s(context: grpc.ServicerContext) -> float | None:
    """The call's time left, or None when it has no deadline (grpcurl's default, and many
    Go and Java stubs'): gRPC then reports a huge number that no wait accepts as a timeout."""
    left = context.time_remaining()
    return None if left is None or left > _NO_DEADLINE_S else max(left, 0.0)


def _status_of(exc: Exception, method: str) -> Status | None:
    """Each failure of a Predict to its status code (see protos/infer.proto); None for
    anything unexpected (INTERNAL, logged)."""
    if isinstance(exc, InvalidRequest):
        return Status(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, _Refused):
        return Status(exc.code, str(exc))
    if isinstance(exc, futures.TimeoutError):
        return Status(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed before its batch was scored")
    if isinstance(exc, PSError):
        if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return Status(exc.code, f"row lookup: {exc}")
        log.error("row lookup failed: %s", exc)
        return Status(grpc.StatusCode.INTERNAL, f"row lookup: {exc}")
    return None


# --- server


class InferServer:
    """A started predictor: ``port`` is the bound port, ``metrics_port`` where its metrics
    are served (None without ``--metrics-port``); ``stop()`` drains it."""

    def __init__(self, running: RunningServer, batcher: Batcher) -> None:
        self._running, self._batcher = running, batcher
        self.server, self.port, self.metrics_port = running.server, running.port, running.metrics_port

    def drain(self) -> None:
        """NOT_SERVING from now on, every call still answered (``protos.rpc.process.run_server``)."""
        self._running.drain()

    def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, refuse new calls, let calls in progress finish (up to ``grace_s``), stop the batcher."""
        self._running.stop(grace_s)
        self._batcher.close()


def build_server(config: InferConfig, predictor: Predictor) -> InferServer:
    """Bind ``config.listen``, register Predictor, health and reflection, and start serving.

    Raises ``RuntimeError`` naming the address when it cannot be bound.
    """
    metrics = observe = None
    if config.metrics_port is not None:
        from prometheus_client import CollectorRegistry, Histogram

        registry = CollectorRegistry(auto_describe=False)
        metrics = ("ps_infer", registry)
        observe = Histogram(
            "ps_infer_batch_candidates",
            "Candidates scored per micro-batch (model call)",
            registry=registry,
            buckets=(1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000),
        ).observe
    gate = _Gate(config.max_concurrent)
    batcher = Batcher(
        predictor,
        wait_s=config.batch_wait_ms / 1000,
        max_rows=config.max_batch_rows,
        encoding=lambda: gate.encoding,
        observe=observe,
    )
    servicer = _Servicer(predictor, batcher, gate, predictor.model.run)
    predict = grpc.unary_unary_rpc_method_handler(
        servicer.Predict, request_deserializer=None, response_serializer=pb.PredictResponse.SerializeToString
    )
    threads = config.max_concurrent + _SPARE_THREADS
    try:
        running = start_server(
            config,
            [PREDICT_SERVICE],
            [grpc.method_handlers_generic_handler(PREDICT_SERVICE, {"Predict": predict})],
            who="ps-infer",
            # Admission is the gate's (--max-concurrent); the guard checks tokens and keeps metrics.
            roles={f"/{PREDICT_SERVICE}/Predict": "read"},
            threads=threads,
            thread_name="ps-infer",
            # Past this, gRPC itself refuses with RESOURCE_EXHAUSTED instead of queueing.
            max_concurrent_rpcs=2 * threads,
            metrics=metrics,
        )
    except RuntimeError:
        batcher.close()
        raise
    return InferServer(running, batcher)


def _warm_up(predictor: Predictor) -> None:
    """Encode one made-up candidate and run the program on zeros (no lookup), so the first
    request does not pay for loading the numba kernels or the program's first run."""
    m = predictor.model
    sample = {"string": Column.of([""]), "int64": Column.of([0]), "float64": Column.of([0.0])}
    columns = {name: sample[types[0]] for name, types in predictor.accepts().items()}
    columns |= dict.fromkeys(m.dense, Column.of(["1"]))  # the text path of dense values
    predictor.encode(*decode_request(request_of(1, {}, columns)))  # read-only arrays, as requests bring
    with torch.no_grad():
        pooled = {name: torch.zeros(MIN_ROWS, m.dims[table]) for name, table, _, _ in m.embeddings}
        m.program(torch.zeros(MIN_ROWS, len(m.dense)), pooled)


_DESCRIPTION = (
    "Serve a trained model's Predict over gRPC: raw feature values in, scores out, hashed "
    "and looked up on the shards exactly as in training."
)


@dataclass
class _Running:
    """A started ``ps-infer`` with the shard client it owns (``protos.rpc.process.Served``)."""

    server: InferServer
    client: PSClient
    about: str

    @property
    def port(self) -> int:
        return self.server.port

    def drain(self) -> None:
        self.server.drain()

    def stop_and_report(self, grace_s: float) -> int:
        self.server.stop(grace_s)
        self.client.close()
        log.info("stopped")
        return 0


def _start(config: InferConfig) -> _Running:
    """Load the run, check the shards are its cluster, warm up and start serving; raises
    ``RuntimeError`` or ``ValueError`` saying why it cannot."""
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.model is None:
        raise ValueError("--model is required: the run directory of a trained model (e.g. runs/latest)")
    client = config.client()
    try:
        predictor = Predictor(load_model(config.model), client, max_candidates=config.max_candidates)
        check_shards(predictor.model.manifest, predictor.model.dims, client, config.shards_named, config.wait_s)
        _warm_up(predictor)
        server = build_server(config, predictor)
    except (ValueError, RuntimeError, PSError) as exc:
        client.close()
        raise RuntimeError(str(exc)) from None
    except BaseException:
        client.close()
        raise
    return _Running(server, client, f"model={config.model} run={predictor.model.run}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ps-infer`` console script (``protos.rpc.process.run_server``)."""
    return run_server(
        "ps-infer",
        lambda: load_settings(
            InferConfig, sys.argv[1:] if argv is None else argv, os.environ, ENV_PREFIX, "ps-infer", _DESCRIPTION
        ),
        _start,
        describe_settings,
    )


# --- client


if __name__ == "__main__":
    sys.exit(main())
