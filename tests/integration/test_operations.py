"""What operators rely on, on real ``ps-server`` processes: Prometheus metrics, bearer
tokens, TLS and mutual TLS, and admission control (calls in flight, tables, keys)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import ClientConfig, PermissionDeniedError, PSClient, PSError, UnauthenticatedError
from protos import ps_pb2 as pb
from tests.integration.shards import RunningShard, start_shard, stop_shard
from tests.integration.test_admin import ps_admin

LOOKUP = "/ps.v1.ParameterServer/Lookup"
FOLLOW = "/ps.v1.ParameterServer/Follow"


def _metrics_port(shard: RunningShard, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(r"metrics on http://[^:]+:(\d+)/metrics", shard.log.read_text())
        if m:
            return int(m.group(1))
        time.sleep(0.05)
    raise AssertionError(f"no metrics line in the log:\n{shard.log_tail()}")


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


@pytest.fixture
def shard_with_metrics(tmp_path: Path) -> Iterator[RunningShard]:
    shard = start_shard(0, 1, tmp_path, "--metrics-port=0", f"--data-dir={tmp_path / 'data'}")
    yield shard
    stop_shard(shard)


def test_every_labelled_counter_exists_at_zero_before_it_fires(shard_with_metrics: RunningShard) -> None:
    # rate() needs a sample before the first increment, or it misses the first burst.
    m = _scrape(_metrics_port(shard_with_metrics))
    for method in ("Lookup", "Push", "CreateTable", "Stats", "Follow"):
        for reason in ("in_flight", "per_peer", "streams"):
            assert m[f'ps_rpcs_rejected_total{{method="{method}",reason="{reason}"}}'] == 0
        for code in ("OK", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"):
            assert m[f'ps_rpcs_total{{code="{code}",method="{method}"}}'] == 0
    assert not any("no_token" in k for k in m)  # no token file: no token refusals to expect


def test_metrics_count_calls_rows_and_refusals(shard_with_metrics: RunningShard) -> None:
    port = _metrics_port(shard_with_metrics)
    with PSClient([shard_with_metrics.address]) as client:
        client.create_table("users", dim=8)
        client.create_table("half", dim=8, optimizer="sgd", lr=1.0, storage_dtype="float16")
        for _ in range(5):
            client.lookup("users", np.arange(100))
        client.push("users", np.arange(10), np.ones((10, 8), np.float32))
        client.push("users", np.arange(10), np.ones((10, 8), np.float32))
        client.push("half", np.arange(4), np.full((4, 8), 1e6, np.float32))  # past float16's range: clamped
        with pytest.raises(PSError):
            client.lookup("missing", np.arange(3))
        tables = {t["name"]: t for t in client.admin.stats()[0]["tables"]}
    m = _scrape(port)
    assert m['ps_rpcs_total{code="OK",method="Lookup"}'] == 5
    assert m['ps_rpcs_total{code="OK",method="Push"}'] == 3
    assert m['ps_rpc_seconds_count{code="OK",method="Lookup"}'] == 5
    assert m['ps_table_rows{table="users",tier="ram"}'] == 100
    assert m['ps_table_keys_looked_up_total{table="users"}'] == 500
    assert m['ps_table_rows_created_total{table="users"}'] == 100
    assert m['ps_table_memory_bytes{table="users"}'] > 0
    # Bytes per row in RAM (what the budget charges) and on disk, by table: 16-bit rows cost less.
    for name, rows in (("users", 100), ("half", 4)):
        assert m[f'ps_table_bytes_per_row{{table="{name}",tier="ram"}}'] == tables[name]["bytes_per_resident_row"]
        disk = m[f'ps_table_disk_bytes{{table="{name}"}}']
        assert m[f'ps_table_bytes_per_row{{table="{name}",tier="disk"}}'] == pytest.approx(disk / rows)
    assert m['ps_table_bytes_per_row{table="half",tier="ram"}'] < m['ps_table_bytes_per_row{table="users",tier="ram"}']
    assert m['ps_table_values_clamped_total{table="half"}'] == 32
    assert m['ps_table_values_clamped_total{table="users"}'] == m['ps_table_values_flushed_total{table="users"}'] == 0
    assert m["ps_tables"] == 2
    assert m["ps_storage_errors_total"] == 0
    assert m["ps_rpcs_in_flight"] == 0
    # Labels are methods, codes, tables and tiers only: never a key.
    labels = {k for name in m for k in re.findall(r'(\w+)="', name)}
    assert labels <= {"method", "code", "table", "tier", "le", "reason"}, labels


def test_tokens_by_role_and_health_without_one(tmp_path: Path) -> None:
    tokens = {"read": "r" * 20, "write": "w" * 20, "admin": "a" * 20}
    token_file = tmp_path / "tokens"
    token_file.write_text("".join(f"{role} {t}\n" for role, t in tokens.items()))
    shard = start_shard(0, 1, tmp_path, f"--auth-token-file={token_file}")
    try:

        def client(token: str | None) -> PSClient:
            return PSClient([shard.address], ClientConfig(token=token, deadline_s=5, max_attempts=1))

        with client(None) as c, pytest.raises(UnauthenticatedError) as exc:
            c.admin.tables()
        assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        with client("x" * 20) as c, pytest.raises(PSError) as exc:
            c.admin.tables()
        assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED and "x" * 20 not in str(exc.value)
        with client(tokens["read"]) as c, pytest.raises(PermissionDeniedError) as exc:
            c.create_table("t", dim=4)
        assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "CreateTable refused: needs a write token, this one is read" in str(exc.value)
        with client(tokens["write"]) as c:  # what a trainer needs: its tables, new or identical
            c.create_table("t", dim=4)
            c.create_table("t", dim=4)
        with client(tokens["write"]) as c, pytest.raises(PermissionDeniedError) as exc:
            c.admin.checkpoint()
        assert "needs an admin token, this one is write" in str(exc.value)
        with client(tokens["admin"]) as c:
            c.create_table("t", dim=4)
        with client(tokens["read"]) as c:
            assert c.lookup("t", np.arange(4)).shape == (4, 4)
            with pytest.raises(PSError) as exc:
                c.push("t", np.arange(4), np.ones((4, 4), np.float32))
            assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
        with client(tokens["write"]) as c:
            assert c.push("t", np.arange(4), np.ones((4, 4), np.float32)).rows_updated == 4
        with grpc.insecure_channel(shard.address) as channel:  # probes carry no token
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert not any(t in shard.log.read_text() for t in tokens.values())  # never logged
    finally:
        stop_shard(shard)


def test_bad_token_file_stops_start_with_a_clear_error(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("root secret-secret-secret\n")
    with pytest.raises(pytest.fail.Exception, match="line 1: expected 'ROLE TOKEN'"):
        start_shard(0, 1, tmp_path, f"--auth-token-file={token_file}", timeout_s=20)


@pytest.mark.parametrize("second_role", ["admin", "read"])
def test_token_listed_twice_stops_start_naming_both_lines(tmp_path: Path, second_role: str) -> None:
    token = "the-same-token-0123456789"
    token_file = tmp_path / "tokens"
    token_file.write_text(f"read {token}\n# ops\nwrite other-token-0123456789\n{second_role} {token}\n")
    with pytest.raises(pytest.fail.Exception) as exc:
        start_shard(0, 1, tmp_path, f"--auth-token-file={token_file}", timeout_s=20)
    message = str(exc.value)
    assert f"line 4: the {second_role} token of this line is already on line 1 (as read)" in message
    assert token not in message and token not in (tmp_path / "shard.0.log").read_text()


def test_short_token_stops_start_naming_the_minimum(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("write short-token\n")
    with pytest.raises(pytest.fail.Exception, match="line 1: write token has 11 characters, a token needs at least 16"):
        start_shard(0, 1, tmp_path, f"--auth-token-file={token_file}", timeout_s=20)


def test_read_token_lookup_on_a_training_shard_creates_and_streams_nothing(tmp_path: Path) -> None:
    tokens = {"read": "r" * 20, "write": "w" * 20, "admin": "a" * 20}
    token_file = tmp_path / "tokens"
    token_file.write_text("".join(f"{role} {t}\n" for role, t in tokens.items()))
    (tmp_path / "read.token").write_text(tokens["read"])
    leader = start_shard(0, 1, tmp_path / "train", f"--auth-token-file={token_file}")
    follower = None
    try:
        quick = {"deadline_s": 10.0, "max_attempts": 1}
        with PSClient([leader.address], ClientConfig(token=tokens["admin"], **quick)) as writer:
            writer.create_table("zeros", dim=4)
            writer.create_table("init", dim=4, serving_default="initial")
            writer.lookup("zeros", np.arange(10))  # ten rows exist
            writer.push("zeros", np.arange(10), np.ones((10, 4), np.float32))
            existing = writer.lookup("zeros", np.arange(10))
            initial = writer.lookup("init", np.array([0]))  # a row of the table 'init' exists, the first
        follower = start_shard(
            0,
            1,
            tmp_path / "serve",
            "--mode=serve",
            f"--follow={leader.address}",
            f"--client-token-file={tmp_path / 'read.token'}",
        )

        def stats(address: str) -> dict:  # type: ignore[type-arg]
            with PSClient([address], ClientConfig(token=tokens["read"], **quick)) as c:
                return c.admin.stats()[0]

        deadline = time.monotonic() + 20
        while stats(follower.address)["follow"]["applied_version"] < stats(leader.address)["version"]:
            assert time.monotonic() < deadline, "the follower never caught up"
            time.sleep(0.05)
        before = stats(leader.address)
        new_keys = np.arange(1000, 6000)
        with PSClient([leader.address], ClientConfig(token=tokens["read"], **quick)) as reader:
            rows = reader.lookup("zeros", np.concatenate([np.arange(10), new_keys]))
            init_rows = reader.lookup("init", np.array([0, 7]))
        np.testing.assert_array_equal(rows[:10], existing)
        assert not rows[10:].any(), "keys without a row read as the table's serving default, zeros"
        np.testing.assert_array_equal(init_rows[0], initial[0])
        assert init_rows[1].any(), "serving_default=initial: the row the key would start with"
        after = stats(leader.address)
        assert after["version"] == before["version"], "a read lookup changed nothing a follower would get"
        assert (
            {t["name"]: (t["rows"], t["rows_created"]) for t in after["tables"]}
            == {t["name"]: (t["rows"], t["rows_created"]) for t in before["tables"]}
            == {"init": (1, 1), "zeros": (10, 10)}
        )
        time.sleep(0.5)  # anything streamed would have arrived by now
        assert sum(t["rows"] for t in stats(follower.address)["tables"]) == 11
        # The same lookup with a write token creates the rows, as a trainer's does.
        with PSClient([leader.address], ClientConfig(token=tokens["write"], **quick)) as writer:
            writer.lookup("zeros", new_keys)
        assert stats(leader.address)["version"] > before["version"]
    finally:
        for s in (follower, leader):
            if s is not None:
                stop_shard(s)


def test_trainer_runs_with_a_write_token_and_says_in_one_line_what_a_read_token_lacks(tmp_path: Path) -> None:
    tokens = {"read": "r" * 20, "write": "w" * 20}
    (tmp_path / "tokens").write_text("".join(f"{role} {t}\n" for role, t in tokens.items()))
    shard = start_shard(0, 1, tmp_path / "shard", f"--auth-token-file={tmp_path / 'tokens'}")
    try:

        def train(role: str) -> subprocess.CompletedProcess[str]:
            (tmp_path / f"{role}.token").write_text(tokens[role])
            flags = ["--train-samples=2000", "--eval-samples=500", "--progress=false", "--log-level=WARNING"]
            return subprocess.run(
                [sys.executable, "-m", "worker.trainer", f"--addresses={shard.address}", *flags],
                env={**os.environ, "PS_CLIENT_TOKEN_FILE": str(tmp_path / f"{role}.token")},
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=300,
            )

        refused = train("read")
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.splitlines() == [
            f"trainer: shard 0 ({shard.address}): CreateTable refused: needs a write token, this one is read "
            "(a trainer needs a write token: point PS_CLIENT_TOKEN_FILE at a file holding one)"
        ]
        trained = train("write")  # creates its tables, looks rows up, pushes
        assert trained.returncode == 0, trained.stderr[-3000:]
        assert "AUC" in trained.stdout
    finally:
        stop_shard(shard)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def test_tls_and_mutual_tls(tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch) -> None:
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    server_cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    server_cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    client_cert = ca.issue_cert("trainer@example.test")
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "client.pem"))
    client_cert.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    tls = (f"--tls-cert={tmp_path / 'server.pem'}", f"--tls-key={tmp_path / 'server.key'}")
    quick = {"deadline_s": 3.0, "max_attempts": 1}

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)  # the shard's own default, not this process's
    shard = start_shard(0, 1, tmp_path / "tls", *tls)
    try:
        with PSClient([shard.address], ClientConfig(tls_ca=str(tmp_path / "ca.pem"), **quick)) as c:
            c.create_table("t", dim=4)
            assert c.lookup("t", np.arange(3)).shape == (3, 4)
        with PSClient([shard.address], ClientConfig(**quick)) as c, pytest.raises(PSError) as plain:
            c.admin.tables()  # plain text to a TLS port
        assert f"the server at {shard.address} expects TLS: pass --tls-ca" in str(plain.value)
        assert "Handshake failed" not in shard.log.read_text()  # gRPC's own lines of it stay out of the log
        admin = ps_admin("stats", "--addresses", shard.address, cwd=tmp_path)
        assert admin.returncode == 1 and admin.stderr.count("\n") == 1, admin.stderr
        assert "expects TLS: pass --tls-ca" in admin.stderr and "is it running" not in admin.stderr
        # health, too, says which side expects TLS (the hint the client gives every other command)
        health = ps_admin("health", "--addresses", shard.address, "--timeout-s", "2", cwd=tmp_path)
        assert health.returncode == 1, health.stdout + health.stderr
        assert f"the server at {shard.address} expects TLS: pass --tls-ca" in health.stdout, health.stdout
        secure = ps_admin("--tls-ca", tmp_path / "ca.pem", "health", "--addresses", shard.address, cwd=tmp_path)
        assert secure.returncode == 0 and "NOT SERVING" not in secure.stdout, secure.stdout + secure.stderr
    finally:
        stop_shard(shard)

    plain_shard = start_shard(0, 1, tmp_path / "plain")
    try:
        with PSClient([plain_shard.address], ClientConfig(tls_ca=str(tmp_path / "ca.pem"), **quick)) as c:
            with pytest.raises(PSError, match=f"the server at {plain_shard.address} does not use TLS"):
                c.admin.tables()  # TLS to a plain-text port
        health = ps_admin(
            "--tls-ca",
            tmp_path / "ca.pem",
            "health",
            "--addresses",
            plain_shard.address,
            "--timeout-s",
            "2",
            cwd=tmp_path,
        )
        assert health.returncode == 1, health.stdout + health.stderr
        assert f"the server at {plain_shard.address} does not use TLS: connect without --tls-ca" in health.stdout
    finally:
        stop_shard(plain_shard)

    shard = start_shard(0, 1, tmp_path / "mtls", *tls, f"--tls-client-ca={tmp_path / 'ca.pem'}")
    try:
        mutual = ClientConfig(
            tls_ca=str(tmp_path / "ca.pem"),
            tls_cert=str(tmp_path / "client.pem"),
            tls_key=str(tmp_path / "client.key"),
            **quick,
        )
        with PSClient([shard.address], mutual) as c:
            c.create_table("t", dim=4)
        with PSClient([shard.address], ClientConfig(tls_ca=str(tmp_path / "ca.pem"), **quick)) as c:
            with pytest.raises(PSError, match="asks for a client certificate \\(mutual TLS\\): pass --tls-cert"):
                c.admin.tables()  # no client certificate: said so, not "cannot reach the shard"
    finally:
        stop_shard(shard)


def test_table_and_key_limits(tmp_path: Path) -> None:
    shard = start_shard(0, 1, tmp_path, "--max-tables=2", "--max-keys-per-request=1000")
    try:
        with PSClient([shard.address]) as client:
            client.create_table("a", dim=4)
            client.create_table("b", dim=4)
            client.create_table("b", dim=4)  # the same table again: no new one
            with pytest.raises(PSError, match="--max-tables=2") as exc:
                client.create_table("c", dim=4)
            assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(PSError, match="--max-keys-per-request=1000"):
                client.lookup("a", np.arange(1001))
            with pytest.raises(PSError, match="--max-keys-per-request=1000"):
                client.push("a", np.arange(1001), np.ones((1001, 4), np.float32))
            assert client.lookup("a", np.arange(1000)).shape == (1000, 4)
            assert {s["name"] for s in client.admin.stats()[0]["tables"]} == {"a", "b"}
    finally:
        stop_shard(shard)


def test_past_threads_calls_are_refused_fast_and_the_client_retries(tmp_path: Path) -> None:
    shard = start_shard(0, 1, tmp_path, "--threads=1")
    keys = np.arange(300_000)
    try:
        with PSClient([shard.address]) as client:
            client.create_table("a", dim=16)
            client.lookup("a", keys)  # creates the rows: later lookups only read (~20 MB answers)
            body = pb.LookupRequest(
                entries=[pb.LookupEntry(table="a", keys=keys.tobytes())], num_shards=1, shard=0
            ).SerializeToString()
            outcomes: list[tuple[str, float, bool]] = []
            lock = threading.Lock()

            def hammer() -> None:
                with grpc.insecure_channel(shard.address, options=[("grpc.max_receive_message_length", 1 << 26)]) as ch:
                    lookup = ch.unary_unary(LOOKUP, None, None)
                    for _ in range(4):
                        t0 = time.monotonic()
                        try:
                            lookup(body, timeout=30)
                            outcome = ("ok", time.monotonic() - t0, False)
                        except grpc.RpcError as exc:
                            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                            assert "--threads=1" in (exc.details() or "")
                            marked = ("ps-overloaded", "1") in tuple(exc.trailing_metadata() or ())
                            outcome = ("refused", time.monotonic() - t0, marked)
                        with lock:
                            outcomes.append(outcome)

            threads = [threading.Thread(target=hammer) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            refused = sorted(t for o, t, _ in outcomes if o == "refused")
            assert refused and any(o == "ok" for o, _, _ in outcomes), outcomes
            assert all(marked for o, _, marked in outcomes if o == "refused")
            assert refused[len(refused) // 2] < 0.5, refused  # answered at once, not queued

            # PSClient retries overload refusals with backoff: every lookup of 4 concurrent ones succeeds.
            with ThreadPoolExecutor(4) as pool:
                shapes = list(pool.map(lambda _: client.lookup("a", keys[:100_000]).shape, range(8)))
            assert shapes == [(100_000, 16)] * 8
    finally:
        stop_shard(shard)


def test_calls_gRPC_never_hands_to_a_handler_hold_no_slot(tmp_path: Path) -> None:
    """A call that ends before its handler runs (here: a unary method sent no request
    message) must not keep one of the shard's --threads slots."""
    shard = start_shard(0, 1, tmp_path, "--threads=2")
    try:
        with grpc.insecure_channel(shard.address) as channel:
            empty = channel.stream_unary("/ps.v1.ParameterServer/ListTables", None, None)
            for _ in range(5):
                with pytest.raises(grpc.RpcError):
                    empty(iter([]), timeout=5)
            list_tables = channel.unary_unary("/ps.v1.ParameterServer/ListTables", None, None)
            for _ in range(3):
                pb.ListTablesResponse.FromString(list_tables(b"", timeout=5))  # no RESOURCE_EXHAUSTED
    finally:
        stop_shard(shard)


def test_follow_streams_do_not_take_the_call_slots(tmp_path: Path) -> None:
    shard = start_shard(0, 1, tmp_path, "--threads=1", "--max-follow-streams=2")
    try:
        with grpc.insecure_channel(shard.address) as channel:
            follow = channel.unary_stream(FOLLOW, None, None)
            body = pb.FollowRequest(shard=0, num_shards=1).SerializeToString()
            streams = [follow(body) for _ in range(2)]
            for s in streams:
                next(s)
            list_tables = channel.unary_unary("/ps.v1.ParameterServer/ListTables", None, None)
            pb.ListTablesResponse.FromString(list_tables(b"", timeout=5))  # the call slot is free
            third = follow(body)
            with pytest.raises(grpc.RpcError) as err:
                next(third)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 streams open" in (err.value.details() or "")
            for s in streams:
                s.cancel()
    finally:
        stop_shard(shard)


def test_ps_infer_call_counters_start_at_zero() -> None:
    from prometheus_client import CollectorRegistry

    from protos.rpc.guard import Guard, RpcMetrics

    registry = CollectorRegistry(auto_describe=False)
    Guard("ps-infer", {"/ps.v1.Predictor/Predict": "read"}, metrics=RpcMetrics("ps_infer", registry))
    for code in ("OK", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNAVAILABLE"):
        assert registry.get_sample_value("ps_infer_rpcs_total", {"method": "Predict", "code": code}) == 0
