"""PSClient's retries and errors, against three real ``Shard``s through
``tests.fakes.InProcessTransport`` (no network): which failures are retried (pushes stay
applied once), and which status becomes which ``PSError``."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from client import (
    ClientConfig,
    DeadlineExceededError,
    InternalServerError,
    InvalidRequestError,
    PreconditionError,
    PSClient,
    PSError,
    PushResult,
    ResourceExhaustedError,
    ShardUnavailableError,
    TableExistsError,
    TableNotFoundError,
    WrongShardError,
)
from client.errors import convert, error_for
from protos.keys import shard_of
from ps.shard import Shard
from tests.fakes import FakeRpcError, InProcessTransport
from tests.unit.client_cluster import DIM, KEYS, N, addresses, initial, requests_per_shard, spec_of

# -- retries --------------------------------------------------------------------------


def test_unavailable_once_is_retried(ps: PSClient, transport: InProcessTransport, shards: list[Shard]) -> None:
    transport.fail_next("Lookup", grpc.StatusCode.UNAVAILABLE, shard=1)
    rows = ps.lookup("t", KEYS)
    np.testing.assert_array_equal(rows, initial(spec_of(shards), KEYS))
    assert requests_per_shard(transport, "Lookup") == [1, 2, 1]


def test_push_retried_after_deadline_exceeded_is_applied_once(
    ps: PSClient, transport: InProcessTransport, shards: list[Shard]
) -> None:
    start = ps.lookup("t", KEYS)
    transport.fail_next("Push", grpc.StatusCode.DEADLINE_EXCEEDED, after_apply=True, shard=0)

    result = ps.push("t", KEYS, np.ones((KEYS.size, DIM), np.float32))

    assert result.duplicates == 1
    assert requests_per_shard(transport, "Push") == [2, 1, 1]
    assert shards[0].duplicate_pushes() == 1
    np.testing.assert_array_equal(ps.lookup("t", KEYS), start - np.float32(0.5))  # moved once
    assert [s["duplicate_pushes"] for s in ps.admin.stats()] == [1, 0, 0]


def test_unavailable_before_push_applies_it_on_retry(
    ps: PSClient, transport: InProcessTransport, shards: list[Shard]
) -> None:
    start = ps.lookup("t", KEYS)
    transport.fail_next("Push", grpc.StatusCode.UNAVAILABLE, times=2, shard=2)
    result = ps.push("t", KEYS, np.ones((KEYS.size, DIM), np.float32))
    assert result == PushResult(rows_updated=KEYS.size, duplicates=0)
    assert requests_per_shard(transport, "Push") == [1, 1, 3]
    np.testing.assert_array_equal(ps.lookup("t", KEYS), start - np.float32(0.5))


def test_invalid_argument_is_not_retried(ps: PSClient, transport: InProcessTransport, shards: list[Shard]) -> None:
    key = int(KEYS[shard_of(KEYS, N) == 1][0])
    before = ps.lookup("t", [key])
    grads = np.ones((1, DIM), np.float32)
    grads[0, 2] = np.nan

    with pytest.raises(InvalidRequestError, match=r"NaN/Inf") as info:
        ps.push("t", [key], grads)

    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.shard == 1
    assert "shard 1 (inproc:1)" in str(info.value)
    # Every shard hears of the push (its seq); shard 1 refused it, the others had no keys.
    assert requests_per_shard(transport, "Push") == [1, 1, 1]
    np.testing.assert_array_equal(ps.lookup("t", [key]), before)


@pytest.mark.parametrize(
    ("code", "cls"),
    [(grpc.StatusCode.UNAVAILABLE, ShardUnavailableError), (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError)],
)
def test_exhausted_attempts_raise_with_shard_and_code(
    shards: list[Shard], transport: InProcessTransport, code: grpc.StatusCode, cls: type[PSError]
) -> None:
    config = ClientConfig(max_attempts=3, backoff_initial_s=0.001, backoff_max_s=0.002, tune_malloc=False)
    with PSClient(addresses(), config, transport=transport) as ps:
        ps.create_table("t", DIM)
        transport.fail_next("Lookup", code, times=100, shard=2)
        with pytest.raises(cls, match=r"gave up after 3 attempts") as info:
            ps.lookup("t", KEYS)
    assert info.value.shard == 2 and info.value.code == code
    assert "shard 2 (inproc:2)" in str(info.value)
    assert transport.count("Lookup", 2) == 3


def test_shutting_down_shard_is_unavailable_after_retries(shards: list[Shard], transport: InProcessTransport) -> None:
    config = ClientConfig(max_attempts=2, backoff_initial_s=0.001, tune_malloc=False)
    with PSClient(addresses(), config, transport=transport) as ps:
        ps.create_table("t", DIM)
        shards[1].close()
        with pytest.raises(ShardUnavailableError, match="shutting down") as info:
            ps.lookup("t", KEYS)
    assert info.value.shard == 1 and info.value.code == grpc.StatusCode.UNAVAILABLE
    assert transport.count("Lookup", 1) == 2


# -- errors ---------------------------------------------------------------------------

ERRORS: list[tuple[type[PSError], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (TableNotFoundError, grpc.StatusCode.NOT_FOUND),
    (TableExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ShardUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (InternalServerError, grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize(("cls", "code"), ERRORS, ids=[c.__name__ for c, _ in ERRORS])
def test_every_error_carries_its_code_when_raised_client_side(cls: type[PSError], code: grpc.StatusCode) -> None:
    err = cls("something")
    assert isinstance(err, PSError)
    assert err.code == code and err.shard is None
    assert error_for(code) is cls


@pytest.mark.parametrize(
    ("cls", "code"),
    [
        *[e for e in ERRORS if e[1] not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)],
        (InternalServerError, grpc.StatusCode.UNKNOWN),
        (InternalServerError, grpc.StatusCode.DATA_LOSS),
    ],
)
def test_status_from_a_shard_maps_to_its_error(
    ps: PSClient, transport: InProcessTransport, cls: type[PSError], code: grpc.StatusCode
) -> None:
    transport.fail_next("Lookup", code, shard=0)
    with pytest.raises(cls) as info:
        ps.lookup("t", KEYS)
    assert type(info.value) is cls
    assert info.value.code == code and info.value.shard == 0  # the original code is kept
    assert isinstance(info.value.__cause__, grpc.RpcError)
    assert transport.count("Lookup", 0) == 1


def test_keys_a_shard_does_not_own_are_a_wrong_shard_error_naming_the_owner() -> None:
    refusal = FakeRpcError(
        grpc.StatusCode.FAILED_PRECONDITION, "Lookup refused: key 7 ... belongs to shard 1", (("ps-wrong-shard", "1"),)
    )
    err = convert(refusal, 0, "h:1")
    assert type(err) is WrongShardError and isinstance(err, PreconditionError)
    assert (err.owner, err.shard, err.code) == (1, 0, grpc.StatusCode.FAILED_PRECONDITION)
    assert str(err) == "shard 0 (h:1): Lookup refused: key 7 ... belongs to shard 1"
    again = err.reworded(f"{err} (gave up)")  # how the retry loop adds to a message: the owner stays
    assert type(again) is WrongShardError and again.owner == 1 and str(again).endswith("(gave up)")
    other = convert(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "read-only"), 0)
    assert type(other) is PreconditionError


def test_every_error_a_caller_sees_is_a_ps_error() -> None:
    from client import CheckpointError, PredictError
    from deploy.local import ShardStartError
    from deploy.reshard import AdminError
    from deploy.scale import ScaleError

    for cls in (PredictError, CheckpointError, AdminError, ScaleError, ShardStartError):
        assert issubclass(cls, PSError), cls
    assert issubclass(ScaleError, AdminError)
    assert PredictError("no", grpc.StatusCode.UNAVAILABLE).code == grpc.StatusCode.UNAVAILABLE
