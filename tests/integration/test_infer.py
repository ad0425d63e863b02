"""``ps-infer`` end to end: train on real shards, export, serve from a real process, score over gRPC.

Scores must equal the in-process model's to the bit (CPU): the trainer's own dense model
and ``DistributedEmbedding`` on the keys the data path computes, for the same raw values.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from client import PredictClient, PredictError, PSClient
from deploy.local import LocalCluster
from protos import infer_pb2 as pb
from protos import ps_pb2 as pb_ps
from protos.columns import Column, columns_of, encode_request, request_of
from tests.faults.proxy import FaultProxy
from tests.integration.infer_helpers import (
    CAT,
    CRITEO,
    DENSE,
    F32,
    REPO,
    Infer,
    Trained,
    await_infer,
    in_process,
    raw_rows,
    requests_of,
    spawn_infer,
    start_infer,
    stop_infer,
    with_shared_context,
)
from worker.trainer import TrainerConfig, train


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    """A DLRM trained for a few seconds on generated data, against two real shards that stay up."""
    root = tmp_path_factory.mktemp("infer")
    with LocalCluster(2, root=root / "shards") as cluster:
        config = TrainerConfig(
            train_samples=4096, eval_samples=512, batch_size=512, progress=False, output_dir=root / "run"
        )
        train(config, cluster.addresses)
        yield Trained(cluster.addresses, root / "run", [s.proc.pid for s in cluster.shards])


@pytest.fixture(scope="module")
def infer(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Infer]:
    running = start_infer(trained, tmp_path_factory.mktemp("ps-infer"), "main", "--max-candidates=600")
    try:
        yield running
    finally:
        stop_infer(running)


def test_scores_equal_the_in_process_model_bit_exactly(trained: Trained, infer: Infer) -> None:
    sizes = [1, 7, 40, 80, 400]  # 528 rows: the in-process model scores them as one batch
    ids, counts = raw_rows(sum(sizes), seed=1)
    with_shared_context(ids, counts, sizes)
    expected = in_process(trained, ids, counts)
    with PredictClient(infer.address) as client:
        got = np.concatenate([client.predict(ctx, cand) for ctx, cand in requests_of(ids, counts, sizes)])
    np.testing.assert_array_equal(got, expected)
    assert 0 < got.min() and got.max() < 1


def test_micro_batched_scores_equal_one_by_one(infer: Infer) -> None:
    sizes = [3, 17, 64, 5, 128, 1, 40, 9] * 3
    ids, counts = raw_rows(sum(sizes), seed=2)
    with_shared_context(ids, counts, sizes)
    requests = requests_of(ids, counts, sizes)
    with PredictClient(infer.address) as client:
        alone = [client.predict(ctx, cand) for ctx, cand in requests]
        barrier = threading.Barrier(len(requests))

        def concurrent(i: int) -> F32:
            barrier.wait()
            return client.predict(*requests[i])

        with futures.ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(concurrent, range(len(requests))))
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda ctx, cand: cand.update(nope=Column.of(np.zeros(4, np.int64))), "candidates['nope']: unknown feature"),
        (lambda ctx, cand: ctx.update(C1=Column.of("abc")), "context['C1']: string values, the model takes int64"),
        (lambda ctx, cand: cand.pop("C5"), "missing features: C5"),
        (lambda ctx, cand: cand.update(C5=Column.of(np.zeros(3, np.int64))), "candidates['C5']: 3 values"),
        (lambda ctx, cand: cand.update(I2=Column.of(["1", "2", "x", "4"])), "candidates['I2']: value 2 is b'x'"),
    ],
)
def test_bad_requests_get_invalid_argument_naming_the_field(infer: Infer, change: Any, field: str) -> None:
    ids, counts = raw_rows(4, seed=3)
    n, ctx, cand = columns_of(*requests_of(ids, counts, [4])[0])
    change(ctx, cand)
    with PredictClient(infer.address) as client, pytest.raises(PredictError) as info:
        client.call(request_of(n, ctx, cand))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in str(info.value)


def test_wire_level_errors_and_too_many_candidates(infer: Infer) -> None:
    with PredictClient(infer.address) as client:
        bad_lengths = pb.Column(
            name="C2", type=pb.VALUE_TYPE_STRING, values=b"abc", lengths=np.array([1, 1], "<i4").tobytes()
        )
        with pytest.raises(PredictError, match=r"candidates\['C2'\].lengths: add up to 2 bytes") as info:
            client.call(pb.PredictRequest(num_candidates=2, candidates=[bad_lengths]))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        ids, counts = raw_rows(601, seed=4)
        ((ctx, cand),) = requests_of(ids, counts, [601])
        with pytest.raises(PredictError, match=r"num_candidates: 601, must be in \[1, 600\]") as info:
            client.predict(ctx, cand)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_reflection(infer: Infer) -> None:
    with grpc.insecure_channel(infer.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "ps.v1.Predictor"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "ps.v1.Predictor" in services


def test_serving_replicas_that_follow_the_training_shards_give_the_same_scores(
    trained: Trained, infer: Infer, tmp_path: Path
) -> None:
    ids, counts = raw_rows(64, seed=7)
    ((ctx, cand),) = requests_of(ids, counts, [64])
    with PredictClient(infer.address) as client:
        expected = client.predict(ctx, cand)  # on the training shards: creates the rows of unseen ids
    with (
        LocalCluster(2, root=tmp_path / "a", follow=trained.addresses) as a,
        LocalCluster(2, root=tmp_path / "b", follow=trained.addresses) as b,
    ):
        for replicas in (a, b):
            with PSClient(replicas.addresses) as followers:
                deadline = time.monotonic() + 60
                while any(s["follow"]["lag_versions"] or not s["follow"]["connected"] for s in followers.admin.stats()):
                    assert time.monotonic() < deadline, followers.admin.stats()
                    time.sleep(0.05)
        ps = ",".join(f"{x}|{y}" for x, y in zip(a.addresses, b.addresses))
        served = start_infer(Trained([ps], trained.run), tmp_path, "replicas")
        try:
            with PredictClient(served.address) as client:
                for _ in range(4):  # reads spread over both replicas of each shard
                    np.testing.assert_array_equal(client.predict(ctx, cand), expected)
        finally:
            stop_infer(served)


def test_scores_from_8_bit_serving_shards_equal_the_in_process_model_on_the_same_rows(
    trained: Trained, infer: Infer, tmp_path: Path
) -> None:
    from worker.predictor import Predictor

    ids, counts = raw_rows(64, seed=9)
    ((ctx, cand),) = requests_of(ids, counts, [64])
    with PredictClient(infer.address) as client:
        full = client.predict(ctx, cand)  # float32 rows (creates the rows of unseen ids first)
    int8 = ("--serve-dtype=int8",)
    with LocalCluster(2, root=tmp_path / "q", follow=trained.addresses, extra_args=int8) as quantized:
        with PSClient(quantized.addresses) as rows:
            deadline = time.monotonic() + 60
            while any(s["follow"]["lag_versions"] or not s["follow"]["connected"] for s in rows.admin.stats()):
                assert time.monotonic() < deadline, rows.admin.stats()
                time.sleep(0.05)
            assert {t["storage_dtype"] for s in rows.admin.stats() for t in s["tables"]} == {pb_ps.INT8}
            local = Predictor.load(trained.run, rows).predict(ctx, cand)
        served = start_infer(Trained([",".join(quantized.addresses)], trained.run), tmp_path, "int8")
        try:
            with PredictClient(served.address) as client:
                got = client.predict(ctx, cand)
        finally:
            stop_infer(served)
    np.testing.assert_array_equal(got, local)  # ps-infer on 8-bit rows = this process on them, bit for bit
    assert not np.array_equal(got, full) and np.abs(got - full).max() < 0.01  # quantized, and close


def test_past_max_concurrent_requests_are_refused_at_once(trained: Trained, tmp_path: Path) -> None:
    small = start_infer(trained, tmp_path, "small", "--max-concurrent=1")
    try:
        ids, counts = raw_rows(1000, seed=5)
        ((ctx, cand),) = requests_of(ids, counts, [1000])
        req = encode_request(ctx, cand)
        outcomes: list[tuple[str, float]] = []
        lock = threading.Lock()
        with PredictClient(small.address) as client:
            expected = client.call(req)

            def hammer(_: int) -> None:
                for _ in range(6):
                    started = time.monotonic()
                    try:
                        np.testing.assert_array_equal(client.call(req), expected)
                        outcome = "ok"
                    except PredictError as exc:
                        assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                        assert "--max-concurrent" in str(exc)
                        outcome = "refused"
                    with lock:
                        outcomes.append((outcome, time.monotonic() - started))

            with futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(hammer, range(8)))
        refused = sorted(t for o, t in outcomes if o == "refused")
        assert refused and any(o == "ok" for o, _ in outcomes), outcomes
        assert refused[len(refused) // 2] < 0.5, refused  # refused, not queued behind the running call
    finally:
        stop_infer(small)


def test_sigterm_finishes_calls_in_progress_and_exits_0(trained: Trained, tmp_path: Path) -> None:
    running = start_infer(trained, tmp_path, "term", "--batch-wait-ms=0")
    ids, counts = raw_rows(500, seed=6)
    ((ctx, cand),) = requests_of(ids, counts, [500])
    calls: list[tuple[float, float, str]] = []  # (when the call started, when it ended, how)
    stop = threading.Event()
    refused = {"UNAVAILABLE", "CANCELLED"}  # a call that reaches a stopping server may see either

    def keep_calling() -> None:
        with PredictClient(running.address) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    client.predict(ctx, cand)
                    calls.append((started, time.monotonic(), "ok"))
                except PredictError as exc:
                    calls.append((started, time.monotonic(), exc.code.name))
                    if exc.code.name in refused:
                        return

    # Calls are a few ms long, and one sent a moment before SIGTERM may still reach the
    # server after it: which calls were in progress is made certain by pausing the shards,
    # so every call made before the pause is inside ps-infer, waiting for rows, at SIGTERM.
    with futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(keep_calling) for _ in range(4)]
        time.sleep(1.0)
        paused = time.monotonic()
        for pid in trained.shard_pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(0.2)
            term = time.monotonic()
            running.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        finally:
            for pid in trained.shard_pids:
                os.kill(pid, signal.SIGCONT)
        code = running.proc.wait(60)
        stop.set()
        for j in jobs:
            j.result(timeout=60)
    assert code == 0, running.tail()
    before = [how for started, _, how in calls if started < paused]  # all reached ps-infer before SIGTERM
    assert before and set(before) == {"ok"}, calls
    assert any(started < paused and ended > term for started, ended, _ in calls), "no call was in progress"
    assert {how for started, _, how in calls if started >= paused} <= {"ok", *refused}, calls
    assert "stopped" in running.tail()


def test_sigterm_drains_first(trained: Trained, tmp_path: Path) -> None:
    """On SIGTERM ps-infer reports NOT_SERVING and still answers for --drain-s, then exits 0."""
    running = start_infer(trained, tmp_path, "drain", "--drain-s=3")
    ids, counts = raw_rows(8, seed=21)
    ((ctx, cand),) = requests_of(ids, counts, [8])
    with PredictClient(running.address) as client, grpc.insecure_channel(running.address) as channel:
        expected = client.predict(ctx, cand)
        running.proc.send_signal(signal.SIGTERM)
        check = health_pb2_grpc.HealthStub(channel).Check
        deadline = time.monotonic() + 10
        while (
            check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        ):
            assert time.monotonic() < deadline, running.tail()
            time.sleep(0.02)
        np.testing.assert_array_equal(client.predict(ctx, cand), expected)  # answered while draining
    assert running.proc.wait(60) == 0, running.tail()
    assert "draining drain_s=3.0" in running.tail()


@pytest.mark.skipif(not CRITEO.exists(), reason=f"{CRITEO} not present (internal sample data)")
def test_criteo_raw_text_fields_score_as_the_trainers_evaluation(tmp_path: Path) -> None:
    lines = CRITEO.read_text().splitlines()[:2000]
    (tmp_path / "head.txt").write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    with LocalCluster(2, root=tmp_path / "shards") as cluster:
        config = TrainerConfig(
            data=str(tmp_path / "head.txt"),
            schema="criteo",
            epochs=1,
            train_fraction=0.8,
            progress=False,
            output_dir=run,
        )
        train(config, cluster.addresses)
        expected = np.load(run / "predictions.npy")  # the final evaluation's, rows 1600..1999 in order
        infer = start_infer(Trained(cluster.addresses, run), tmp_path, "criteo")
        try:
            fields = [line.split("\t") for line in lines[1600:]]
            columns = {name: [f[1 + j] for f in fields] for j, name in enumerate(DENSE + CAT)}  # text, as in the file
            got = []
            with PredictClient(infer.address) as client:
                for lo, hi in ((0, 1), (1, 100), (100, 400)):
                    got.append(client.predict({}, {k: v[lo:hi] for k, v in columns.items()}))
        finally:
            stop_infer(infer)
    assert expected.shape == (400,)
    np.testing.assert_array_equal(np.concatenate(got), expected)


def test_tokens_tls_and_metrics(trained: Trained, tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    token = "predict-token-0123456789"
    (tmp_path / "tokens").write_text(f"read {token}\n")
    secured = start_infer(
        trained,
        tmp_path,
        "secured",
        f"--auth-token-file={tmp_path / 'tokens'}",
        f"--tls-cert={tmp_path / 'server.pem'}",
        f"--tls-key={tmp_path / 'server.key'}",
        "--metrics-port=0",
    )
    try:
        ids, counts = raw_rows(5, seed=9)
        ((ctx, cand),) = requests_of(ids, counts, [5])
        tls = {"tls_ca": str(tmp_path / "ca.pem")}
        with PredictClient(secured.address, token=token, **tls) as client:
            scores = client.predict(ctx, cand)
            assert scores.shape == (5,)
        with PredictClient(secured.address, **tls) as client, pytest.raises(PredictError) as exc:
            client.predict(ctx, cand)
        assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        with PredictClient(secured.address, token=token, timeout_s=3) as client, pytest.raises(PredictError):
            client.predict(ctx, cand)  # plain text to a TLS port
        port = re.search(r"metrics on http://[^:]+:(\d+)/metrics", secured.log.read_text())
        assert port, secured.tail()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=10).read().decode()
        assert 'ps_infer_rpcs_total{code="OK",method="Predict"} 1.0' in text
        assert 'ps_infer_rpcs_rejected_total{method="Predict",reason="no_token"} 1.0' in text
        assert "ps_infer_batch_candidates_count 1.0" in text
        assert token not in secured.log.read_text()
    finally:
        stop_infer(secured)


def test_a_predict_without_a_deadline_is_answered(infer: Infer) -> None:
    # grpcurl and many Go and Java stubs send no deadline; the call must not fail on its absence.
    ids, counts = raw_rows(8, seed=10)
    ((ctx, cand),) = requests_of(ids, counts, [8])
    request = encode_request(ctx, cand)
    with grpc.insecure_channel(infer.address) as channel:
        predict = channel.unary_unary(
            "/ps.v1.Predictor/Predict",
            request_serializer=pb.PredictRequest.SerializeToString,
            response_deserializer=pb.PredictResponse.FromString,
        )
        reply = predict(request)  # no timeout
    with PredictClient(infer.address) as client:
        expected = client.call(request)
    np.testing.assert_array_equal(np.frombuffer(reply.scores, "<f4"), expected)


def refused_start(trained: Trained, ps: str, tmp_path: Path, *extra: str, shell: bool = False) -> str:
    """Run ps-infer with ``--ps ps`` and ``extra`` (through bash, unquoted, when ``shell``); it
    must exit 1 with one line on stderr and no traceback. Returns that line."""
    args = [sys.executable, "-m", "worker.serving", f"--model={trained.run}", "--listen=127.0.0.1:0", *extra]
    if shell:
        command = " ".join([*args, "--ps", ps, "--log-level=ERROR", "2>&1"])
        result = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=120)
        output = result.stdout
    else:
        result = subprocess.run(
            [*args, f"--ps={ps}", "--log-level=ERROR"], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        output = result.stderr
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output, output
    assert len(lines) == 1, output
    return lines[0]


def test_infer_refuses_to_start_on_one_shard_of_two(trained: Trained, tmp_path: Path) -> None:
    line = refused_start(trained, trained.addresses[0], tmp_path)
    assert "--ps names 1 shard" in line and "2 shards" in line, line
    # The mistake itself: '|' between replicas, unquoted. bash pipes ps-infer's output into
    # a command named after the rest of the list, and ps-infer gets shard 0 alone.
    a, b = trained.addresses
    command = (
        f"{sys.executable} -m worker.serving --model={trained.run} --listen=127.0.0.1:0 --log-level=ERROR "
        f"--ps {a}|127.0.0.1:1,{b}|127.0.0.1:2"
    )
    result = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=120)
    refusals = [line for line in result.stderr.splitlines() if "ps-infer" in line or "level=ERROR" in line]
    assert len(refusals) == 1 and "--ps names 1 shard" in refusals[0], result.stderr
    assert "Traceback" not in result.stderr and "'|' works only quoted" in refusals[0]


def test_infer_refuses_shards_given_out_of_order(trained: Trained, tmp_path: Path) -> None:
    line = refused_start(trained, ",".join(reversed(trained.addresses)), tmp_path)
    assert f"{trained.addresses[1]} is shard 1" in line and "shard order" in line, line


def test_infer_refuses_shards_of_another_cluster(trained: Trained, tmp_path: Path) -> None:
    tables = json.loads((trained.run / "manifest.json").read_text())["tables"]
    table = tables[0]
    with LocalCluster(2, root=tmp_path / "other") as other, PSClient(other.addresses) as client:
        client.create_table(table["name"], dim=8)
        line = refused_start(trained, ",".join(other.addresses), tmp_path)
        assert f"table {table['name']!r}: dim 8 on the shards, {table['dim']} in the model" in line, line
    # The same table, but empty (the shards of another run, say): scores would be flat.
    with LocalCluster(2, root=tmp_path / "empty") as other, PSClient(other.addresses) as client:
        for t in tables:
            client.create_table(t["name"], dim=t["dim"], seed=t["seed"])
        line = refused_start(trained, ",".join(other.addresses), tmp_path)
        assert "holds no rows of the model's tables" in line, line
    # The same tables, with rows: another data set's cluster. Names, dims, seeds and row
    # counts cannot tell; the lineage of each shard's rows (Stats.lineage) does.
    manifest = json.loads((trained.run / "manifest.json").read_text())
    assert len(manifest["shard_lineages"]) == 2 and all(manifest["shard_lineages"]), manifest["shard_lineages"]
    with LocalCluster(2, root=tmp_path / "twin") as other, PSClient(other.addresses) as client:
        for t in tables:
            client.create_table(t["name"], dim=t["dim"], seed=t["seed"])
            client.lookup(t["name"], np.arange(1000))  # rows on both shards
        line = refused_start(trained, ",".join(other.addresses), tmp_path)
        assert f"{other.addresses[0]} (shard 0) holds the rows of other data" in line, line
        assert manifest["shard_lineages"][0] in line and "trained on" in line, line


def test_infer_waits_for_serving_shards_still_loading(trained: Trained, infer: Infer, tmp_path: Path) -> None:
    # Right after training, the serving shards may not have loaded their training shards'
    # rows yet: here they cannot reach them (a proxy that answers nothing) until told to.
    ids, counts = raw_rows(16, seed=13)
    ((ctx, cand),) = requests_of(ids, counts, [16])
    with PredictClient(infer.address) as client:
        expected = client.predict(ctx, cand)  # creates the rows of unseen ids before the followers load
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(FaultProxy(a)) for a in trained.addresses]
        for proxy in proxies:
            proxy.set_mode("blackhole")
        followers = stack.enter_context(LocalCluster(2, root=tmp_path / "f", follow=[p.address for p in proxies]))
        ps = ",".join(followers.addresses)
        line = refused_start(trained, ps, tmp_path, "--wait-s=0")  # no wait: fails at once, saying why
        assert f"{followers.addresses[0]} (shard 0) is a serving shard still loading (not connected to" in line, line

        proc, port_file, log = spawn_infer(Trained([ps], trained.run), tmp_path, "waits", "--wait-s=600")
        began = time.monotonic()
        while "waiting up to" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"ps-infer exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() - began < 120, log.read_text()[-3000:]
            time.sleep(0.05)
        assert not port_file.exists(), "ps-infer served before its shards had loaded"
        assert "still loading" in log.read_text(errors="replace")
        for proxy in proxies:
            proxy.set_mode("pass")
        served = await_infer(proc, port_file, log)
        try:
            with PSClient(followers.addresses) as client:
                deadline = time.monotonic() + 60
                while any(s["follow"]["lag_versions"] or not s["follow"]["connected"] for s in client.admin.stats()):
                    assert time.monotonic() < deadline, client.admin.stats()
                    time.sleep(0.05)
            with PredictClient(served.address) as client:
                np.testing.assert_array_equal(client.predict(ctx, cand), expected)
        finally:
            stop_infer(served)


def test_plus_separates_replicas_unquoted_in_bash(trained: Trained, tmp_path: Path) -> None:
    with LocalCluster(2, root=tmp_path / "f", follow=trained.addresses) as followers:
        with PSClient(followers.addresses) as client:
            deadline = time.monotonic() + 60
            while any(s["follow"]["lag_versions"] or not s["follow"]["connected"] for s in client.admin.stats()):
                assert time.monotonic() < deadline, client.admin.stats()
                time.sleep(0.05)
        # Replicas of shard 0 only: shard 1 is missing, so it must refuse naming the count,
        # which proves bash passed the '+' list through as one argument.
        ps = f"{trained.addresses[0]}+{followers.addresses[0]}"
        line = refused_start(trained, ps, tmp_path, shell=True)
        assert "--ps names 1 shard" in line, line
        ps = f"{trained.addresses[0]}+{followers.addresses[0]},{trained.addresses[1]}+{followers.addresses[1]}"
        served = start_infer(Trained([ps], trained.run), tmp_path, "plus")
        try:
            with PredictClient(served.address) as predictor:
                ids, counts = raw_rows(4, seed=11)
                assert predictor.predict(*requests_of(ids, counts, [4])[0]).shape == (4,)
        finally:
            stop_infer(served)
