"""Every bad input gets its status code and a message naming the table and field,
and the shard keeps serving afterwards."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import (
    ClientConfig,
    DeadlineExceededError,
    InvalidRequestError,
    PreconditionError,
    PSClient,
    ResourceExhaustedError,
    ShardUnavailableError,
    TableExistsError,
    TableNotFoundError,
    WrongShardError,
)
from client.errors import convert
from protos import ps_pb2 as pb
from protos.keys import shard_of
from tests.integration.shards import RunningShard, start_shard, stop_shard

PATH = "/ps.v1.ParameterServer/"


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[RunningShard]:
    """One shard (of 1) with a 1 MiB message limit and a table 'emb' of dim 8."""
    s = start_shard(0, 1, tmp_path, "--max-message-bytes=1048576")
    try:
        with PSClient([s.address]) as ps:
            ps.create_table("emb", 8)
        yield s
    finally:
        stop_shard(s)


def raw(address: str, method: str, request: bytes) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(PATH + method, None, None)(request, timeout=10)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def push_bytes(table: str = "emb", keys: bytes = b"", grads: bytes = b"", dtype: int = 1, **kw: int) -> bytes:
    return pb.PushRequest(
        entries=[pb.PushEntry(table=table, keys=keys, grads=grads, dtype=dtype)], **kw
    ).SerializeToString()  # type: ignore[arg-type]


KEYS2 = np.array([1, 2], dtype="<i8").tobytes()
ROWS2 = np.ones((2, 8), dtype="<f4").tobytes()

BAD_REQUESTS = [
    (
        "Lookup",
        pb.LookupRequest(entries=[pb.LookupEntry(table="nope", keys=KEYS2)]).SerializeToString(),
        grpc.StatusCode.NOT_FOUND,
        "table 'nope' does not exist",
    ),
    ("Push", push_bytes("nope", KEYS2, ROWS2), grpc.StatusCode.NOT_FOUND, "'nope'"),
    (
        "Lookup",
        pb.LookupRequest(entries=[pb.LookupEntry(table="emb", keys=b"\x01" * 12)]).SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "entries[0].keys (table 'emb'): 12 bytes is not a multiple of 8",
    ),
    (
        "Lookup",
        pb.LookupRequest(entries=[pb.LookupEntry(table="emb", keys=KEYS2, dtype=9)]).SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "entries[0].dtype: unknown dtype 9",
    ),
    (
        "Lookup",
        pb.LookupRequest(entries=[pb.LookupEntry(table="", keys=KEYS2)]).SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "entries[0].table: table name is empty",
    ),
    (
        "Push",
        push_bytes(keys=KEYS2, grads=ROWS2[:-4]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "entries[0] (table 'emb').grads: 60 bytes, expected 64",
    ),
    (
        "Push",
        push_bytes(keys=KEYS2, grads=np.ones((2, 4), "<f4").tobytes()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "expected 64 (2 keys x dim 8",
    ),
    (
        "Push",
        push_bytes(keys=KEYS2, grads=np.full((2, 8), np.nan, "<f4").tobytes()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "table 'emb': grads[0][0] is nan",
    ),
    ("Push", push_bytes(keys=KEYS2, grads=ROWS2, dtype=7), grpc.StatusCode.INVALID_ARGUMENT, "unknown dtype 7"),
    ("Push", b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "malformed request"),
    ("Lookup", b"\x0a\xff\xff\xff\x0f", grpc.StatusCode.INVALID_ARGUMENT, "malformed request"),
    ("CreateTable", b"\x0a\x03\x12", grpc.StatusCode.INVALID_ARGUMENT, "malformed request"),
    ("Stats", b"\xff", grpc.StatusCode.INVALID_ARGUMENT, "Stats: malformed request"),
    ("Stats", b"\x0a\x05ab", grpc.StatusCode.INVALID_ARGUMENT, "Stats: malformed request"),
    ("ListTables", b"\x08", grpc.StatusCode.INVALID_ARGUMENT, "ListTables: malformed request"),
    ("ListTables", b"\x0b", grpc.StatusCode.INVALID_ARGUMENT, "ListTables: malformed request"),
    ("Checkpoint", b"\x0a\x05ab", grpc.StatusCode.INVALID_ARGUMENT, "Checkpoint: malformed request"),
    (
        "Checkpoint",
        pb.CheckpointRequest(path="ck").SerializeToString(),
        grpc.StatusCode.FAILED_PRECONDITION,
        "has no checkpoint root: start it with --checkpoint-root",
    ),
    (
        "Lookup",
        pb.LookupRequest(entries=[pb.LookupEntry(table="emb", keys=KEYS2)], num_shards=3).SerializeToString(),
        grpc.StatusCode.FAILED_PRECONDITION,
        "routed for num_shards=3",
    ),
    (
        "Push",
        push_bytes(keys=KEYS2, grads=ROWS2, shard=1),
        grpc.StatusCode.FAILED_PRECONDITION,
        "request for shard 1 reached shard 0",
    ),
    (
        "Lookup",
        pb.LookupRequest(
            entries=[pb.LookupEntry(table="emb", keys=np.arange(40_000, dtype="<i8").tobytes())]
        ).SerializeToString(),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "over this shard's max_message_bytes=1048576",
    ),
    (
        "Push",
        push_bytes(keys=np.arange(40_000, dtype="<i8").tobytes(), grads=np.ones((40_000, 8), "<f4").tobytes()),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "",
    ),
    (
        "CreateTable",
        pb.CreateTableRequest(spec=pb.TableSpec(name="z", dim=0)).SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "table 'z': dim=0",
    ),
    (
        "CreateTable",
        pb.CreateTableRequest(
            spec=pb.TableSpec(name="z", dim=4, optimizer=pb.OptimizerSpec(lr=-1))
        ).SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "optimizer.lr=-1.0: must be > 0",
    ),
    (
        "CreateTable",
        pb.CreateTableRequest(spec=pb.TableSpec(name="bad name!", dim=4)).SerializeToString(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "table name 'bad name!'",
    ),
    (
        "CreateTable",
        pb.CreateTableRequest(spec=pb.TableSpec(name="emb", dim=16)).SerializeToString(),
        grpc.StatusCode.ALREADY_EXISTS,
        "dim: 8 != 16",
    ),
]


def test_every_bad_input_gets_its_status_and_the_shard_keeps_serving(shard: RunningShard) -> None:
    for method, request, code, message in BAD_REQUESTS:
        got_code, details = raw(shard.address, method, request)
        assert got_code == code, f"{method} {message!r}: got {got_code} {details!r}"
        assert message in details, f"{method}: {details!r} does not name {message!r}"
    # Nothing bad was applied, and the shard still answers.
    assert shard.proc.poll() is None
    with PSClient([shard.address]) as ps:
        rows = ps.lookup("emb", np.array([1, 2]))
        assert rows.shape == (2, 8) and np.isfinite(rows).all()
        assert ps.admin.stats()[0]["tables"][0]["pushes"] == 0


def test_empty_requests_with_unknown_fields_are_accepted(shard: RunningShard) -> None:
    # As protobuf decodes them: an unknown field is skipped, so the request is valid.
    for method in ("Stats", "ListTables"):
        assert raw(shard.address, method, b"\x78\x01") == (grpc.StatusCode.OK, ""), method


def checkpoint(address: str, path: str) -> tuple[grpc.StatusCode, str, str]:
    """(code, details, written path) of a Checkpoint RPC for ``path``."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(PATH + "Checkpoint", None, pb.CheckpointResponse.FromString)
        try:
            reply = call(pb.CheckpointRequest(path=path).SerializeToString(), timeout=30)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", ""
    return grpc.StatusCode.OK, "", reply.path


def test_checkpoints_are_written_only_under_the_checkpoint_root(tmp_path: Path) -> None:
    work, root = tmp_path / "work", tmp_path / "data" / "checkpoints"  # the default root
    s = start_shard(0, 1, work, f"--data-dir={tmp_path / 'data'}")
    try:
        with PSClient([s.address]) as ps:
            ps.create_table("emb", 4)
            ps.lookup("emb", np.arange(10))
        (tmp_path / "plain-file").write_text("x")
        bad = [
            (str(tmp_path / "outside"), "is not under this shard's checkpoint root"),
            ("../../outside", "'..' component"),
            ("a\0b", "NUL byte"),
            ("x" * 5000, "over the limit of 4095"),
            ("y" * 300, "over 255 bytes"),
            (str(tmp_path / "plain-file" / "ck"), "is not under"),
            (".", "is not under"),
        ]
        for path, message in bad:
            code, details, _ = checkpoint(s.address, path)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{path[:40]!r}: {code} {details}"
            assert message in details, f"{path[:40]!r}: {details}"
        assert not (tmp_path / "outside").exists() and not (work / "rel").exists()

        # Relative paths resolve under the root, not the working directory.
        code, details, written = checkpoint(s.address, "rel/one")
        assert code == grpc.StatusCode.OK, details
        part = root / "rel" / "one" / "shard-00000-of-00001"  # the shard's part of the checkpoint "rel/one"
        assert Path(written) == part and (part / "manifest.json").exists()
        code, details, _ = checkpoint(s.address, str(root / "rel" / "one"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "exists" in details
        (root / "file").write_text("x")
        code, details, _ = checkpoint(s.address, "file/ck")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "is not a directory" in details
        code, details, written = checkpoint(s.address, "")
        assert code == grpc.StatusCode.OK and Path(written) == root / "000001" / "shard-00000-of-00001", details
        with PSClient([s.address]) as ps:
            assert ps.admin.stats()[0]["writable"] is True  # refusals never made the shard read-only
    finally:
        stop_shard(s)


def test_client_raises_one_exception_tree(shard: RunningShard) -> None:
    with PSClient([shard.address]) as ps:
        with pytest.raises(TableNotFoundError) as not_found:
            ps.lookup("missing", np.array([1]))
        assert not_found.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(TableExistsError, match="dim: 8 != 4") as exists:
            ps.create_table("emb", 4)
        assert exists.value.shard == 0 and exists.value.code == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(InvalidRequestError, match=r"grads\[1\]\[3\] is inf"):
            grads = np.zeros((2, 8), np.float32)
            grads[1, 3] = np.inf
            ps.push("emb", np.array([5, 6]), grads)
        with pytest.raises(InvalidRequestError, match="keys shape"):
            ps.lookup("emb", np.zeros((2, 2), np.int64))
        with pytest.raises(InvalidRequestError, match="grads shape"):
            ps.push("emb", np.array([1, 2]), np.zeros((3, 8), np.float32))
        with pytest.raises(TypeError, match="unknown option 'learning_rate'"):
            ps.create_table("x", 4, learning_rate=0.1)
        with pytest.raises(InvalidRequestError, match="optimizer='rmsprop'"):
            ps.create_table("x", 4, optimizer="rmsprop")
    # A client that thinks the cluster has 2 shards is refused (the same shard under a
    # second name: the client itself refuses an address listed twice).
    with PSClient([shard.address, shard.address.replace("127.0.0.1", "localhost")]) as wrong:
        with pytest.raises(PreconditionError, match="num_shards=2") as mismatch:
            wrong.create_table("emb", 8)
            wrong.lookup("emb", np.arange(10))
        assert mismatch.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with PSClient([shard.address], ClientConfig(max_message_bytes=4 << 20)) as big:
        with pytest.raises(ResourceExhaustedError):
            big.lookup("emb", np.arange(100_000))  # the shard's limit is 1 MiB


def test_keys_of_another_shard_are_refused_naming_their_owner(tmp_path: Path) -> None:
    shards = [start_shard(i, 2, tmp_path) for i in range(2)]
    try:
        with PSClient([s.address for s in shards]) as ps:
            ps.create_table("emb", 8)
        keys = np.arange(50, dtype=np.int64)
        theirs = keys[shard_of(keys, 2) == 1]  # shard 1's keys, sent to shard 0
        lookup = pb.LookupRequest(
            entries=[pb.LookupEntry(table="emb", keys=np.concatenate([keys[:1], theirs]).astype("<i8").tobytes())]
        )
        grads = np.ones((theirs.size, 8), "<f4").tobytes()
        for method, request in [
            ("Lookup", lookup.SerializeToString()),
            ("Push", push_bytes(keys=theirs.astype("<i8").tobytes(), grads=grads, num_shards=2, shard=0)),
        ]:
            with grpc.insecure_channel(shards[0].address) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    channel.unary_unary(PATH + method, None, None)(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert info.value.details() == (
                f"{method} refused: key {theirs[0]} (table 'emb') belongs to shard 1 of 2, not shard 0; "
                f"{theirs.size} of {theirs.size + (method == 'Lookup')} keys in this request are not this shard's: "
                "route keys with protos.keys.shard_of and the cluster's address list"
            )
            err = convert(info.value, 0, shards[0].address)
            assert isinstance(err, WrongShardError) and isinstance(err, PreconditionError) and err.owner == 1
        with PSClient([shards[0].address], ClientConfig(deadline_s=10)) as one:
            (stats,) = one.admin.stats()  # nothing of either request was applied
        assert stats["tables"][0]["rows"] == 0 and stats["version"] == 1  # the table's creation, and no write since
    finally:
        for s in shards:
            stop_shard(s)


def test_unreachable_shard_is_retried_then_reported(tmp_path: Path) -> None:
    s = start_shard(0, 1, tmp_path)
    address = s.address
    stop_shard(s)  # nothing listens there any more
    config = ClientConfig(deadline_s=1.5, backoff_initial_s=0.05, max_attempts=100)
    started = time.monotonic()
    with PSClient([address], config) as ps:
        with pytest.raises((ShardUnavailableError, DeadlineExceededError)) as err:
            ps.create_table("t", 4)
    elapsed = time.monotonic() - started
    assert err.value.shard == 0 and address in str(err.value)
    assert 1.0 < elapsed < 5.0, f"gave up after {elapsed:.2f}s, deadline was 1.5s"


def test_health_and_reflection(shard: RunningShard) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(shard.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in (
            "",
            "ps.v1.ParameterServer",
            "ps.v1.ParameterServer.Writes",
            "ps.v1.ParameterServer.Background",
        ):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service="ps.v1.ParameterServer"), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        unknown = health.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/grpc.health.v1.Health/Check")(b"\xff", timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "grpc.health.v1.Health/Check: the request does not decode" in str(refused.value.details())
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert "ps.v1.ParameterServer" in names


def test_sigterm_drains_in_flight_calls_and_exits_0(tmp_path: Path) -> None:
    s = start_shard(0, 1, tmp_path)
    errors: list[BaseException] = []
    done = threading.Event()
    calls = [0]

    def hammer() -> None:
        with PSClient([s.address], ClientConfig(deadline_s=5, max_attempts=1)) as ps:
            ps.create_table("t", 64)
            keys = np.arange(50_000)
            while not done.is_set():
                try:
                    rows = ps.lookup("t", keys)
                    assert rows.shape == (50_000, 64)
                    calls[0] += 1
                except (ShardUnavailableError, DeadlineExceededError):
                    return  # refused after shutdown started: expected
                except BaseException as exc:  # anything else is a bug
                    errors.append(exc)
                    return

    worker = threading.Thread(target=hammer)
    worker.start()
    while calls[0] < 3 and worker.is_alive():
        time.sleep(0.01)
    stop_shard(s)  # SIGTERM mid-stream; fails unless the exit code is 0
    done.set()
    worker.join(30)
    assert not errors, errors
    assert calls[0] >= 3
    assert "stopped" in s.log.read_text()


def test_sigterm_again_while_a_shard_exits_still_ends_it_cleanly(tmp_path: Path) -> None:
    # A launcher may signal a group and then each process: a repeat must neither hang
    # the shutdown nor, arriving as the interpreter exits, kill the process (-SIGTERM).
    s = start_shard(0, 1, tmp_path)
    with PSClient([s.address]) as ps:
        ps.create_table("t", 4)
        ps.push("t", np.arange(100), np.ones((100, 4), np.float32))
    deadline = time.monotonic() + 30
    signals = 0
    while s.proc.poll() is None and time.monotonic() < deadline:
        s.proc.send_signal(signal.SIGTERM)
        signals += 1
        time.sleep(0.002)
    assert s.proc.wait(5) == 0, s.log.read_text()[-2000:]
    assert signals > 1
    assert "stopped" in s.log.read_text()


def test_a_port_file_in_a_missing_directory_is_a_bad_setting(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "port"
    proc = subprocess.run(
        [sys.executable, "-m", "ps", "--shard=0", "--num-shards=1", "--listen=127.0.0.1:0", f"--port-file={missing}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == f"ps-server: --port-file {missing}: no directory {missing.parent}", proc.stderr
