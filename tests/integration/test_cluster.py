"""Lookup and push semantics on two real shard processes."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from client import ClientConfig, PSClient, PushResult
from client.transport import GrpcTransport, Transport
from protos import ps_pb2 as pb
from protos import wire
from protos.keys import shard_of
from ps.table import InitializerKind, InitializerParams, OptimizerKind, OptimizerParams, optimizers
from ps.table.initializers import initial_rows
from tests.integration.shards import RunningShard, start_shard, stop_shard

RNG = np.random.default_rng(1234)


def random_keys(n: int) -> np.ndarray:
    return RNG.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)


def test_rows_are_deterministic_and_stable(addresses: list[str]) -> None:
    with PSClient(addresses) as ps:
        ps.create_table("user", 8, seed=11)
        keys = random_keys(5000)
        keys[100:200] = keys[:100]  # duplicates inside one call
        first = ps.lookup("user", keys)
        again = ps.lookup("user", keys[::-1].copy())[::-1]
        # The initial row is a function of (seed, key) only: compute it locally.
        expected = initial_rows(InitializerParams(), 11, keys, 8)
        np.testing.assert_array_equal(first, expected)
        np.testing.assert_array_equal(again, expected)
        # Both shards took part, and each holds only its own keys.
        per_shard = [s["tables"][0]["rows"] for s in ps.admin.stats()]
        assert sum(per_shard) == len(np.unique(keys))
        assert per_shard == np.bincount(shard_of(np.unique(keys), 2), minlength=2).tolist()


def test_same_rows_after_a_fresh_cluster_restart(tmp_path: Path) -> None:
    keys = random_keys(3000)
    seen = []
    for run in range(2):
        root = tmp_path / f"run{run}"
        root.mkdir()
        shards = [start_shard(i, 2, root) for i in range(2)]
        try:
            with PSClient([s.address for s in shards]) as ps:
                ps.create_table("item", 16, initializer="normal", std=0.5, seed=99)
                seen.append(ps.lookup("item", keys))
        finally:
            for s in shards:
                stop_shard(s)
    np.testing.assert_array_equal(seen[0], seen[1])
    np.testing.assert_array_equal(
        seen[0], initial_rows(InitializerParams(InitializerKind.NORMAL, std=0.5), 99, keys, 16)
    )


def test_sgd_push_moves_rows_exactly(addresses: list[str]) -> None:
    with PSClient(addresses) as ps:
        ps.create_table("t", 4, optimizer="sgd", lr=0.5)
        keys = np.array([1, 2, 3, 1, 2**40], dtype=np.int64)
        before = ps.lookup("t", keys)
        grads = RNG.standard_normal((5, 4)).astype(np.float32)
        result = ps.push("t", keys, grads)
        assert result == PushResult(rows_updated=4, duplicates=0)
        after = ps.lookup("t", keys)
        summed = grads.copy()
        summed[0] += grads[3]  # key 1 appears twice: gradients are summed
        summed[3] = summed[0]
        np.testing.assert_array_equal(after, before - np.float32(0.5) * summed)


def test_adagrad_pushes_match_torch(addresses: list[str]) -> None:
    dim, n = 16, 300
    with PSClient(addresses) as ps:
        ps.create_table("emb", dim, optimizer="adagrad", lr=0.1, initial_accumulator_value=0.1, seed=5)
        keys = random_keys(n)
        initial = ps.lookup("emb", keys).copy()
        weight = torch.nn.Parameter(torch.from_numpy(initial.copy()))
        opt = torch.optim.Adagrad([weight], lr=0.1, initial_accumulator_value=0.1)
        # The shard's own kernel, run here on the same rows: the shard must match it bit for bit.
        params = OptimizerParams(kind=OptimizerKind.ADAGRAD, lr=0.1, initial_accumulator_value=0.1)
        local, state = initial.copy(), np.empty((n, dim), np.float32)
        slots = np.arange(n, dtype=np.int64)
        optimizers.init_state(params, state, slots)
        pushed: list[tuple[np.ndarray, np.ndarray]] = []
        for _ in range(5):
            grads = RNG.standard_normal((n, dim)).astype(np.float32)
            before = grads.copy()  # the references never share the buffer the client was given
            ps.push("emb", keys, grads)
            pushed.append((grads, before))
            optimizers.apply(params, local, state, slots, before.copy())
            opt.zero_grad()
            weight.grad = torch.from_numpy(before.copy())
            opt.step()
        # A push leaves the caller's gradients as they were (checked after the last push returned).
        for given, copy in pushed:
            np.testing.assert_array_equal(given, copy)
        rows = ps.lookup("emb", keys)
        # Each push applied once, in order: a lost, repeated or reordered push moves rows by ~1e-2.
        np.testing.assert_array_equal(rows, local)
        # torch's float32 sqrt is not correctly rounded (tests/unit/test_optimizers.py holds the
        # ulp-level parity); on a loaded 2-core CI machine its reference has also come out up to
        # 3e-5 off in one half of the rows while the shard equalled the kernel above. Same
        # algorithm within 1e-4; a missed or doubled step is a hundred times further off.
        np.testing.assert_allclose(rows, weight.detach().numpy(), rtol=1e-4, atol=1e-4)


def test_many_tables_in_one_call(addresses: list[str]) -> None:
    with PSClient(addresses) as ps:
        ps.create_table("a", 4, optimizer="sgd", lr=1.0)
        ps.create_table("b", 8, optimizer="sgd", lr=1.0)
        ka, kb = random_keys(100), random_keys(50)
        rows = ps.lookup_many({"a": ka, "b": kb})
        assert rows["a"].shape == (100, 4) and rows["b"].shape == (50, 8)
        ps.push_many({"a": (ka, np.ones((100, 4), np.float32)), "b": (kb, np.ones((50, 8), np.float32))})
        after = ps.lookup_many({"a": ka, "b": kb})
        np.testing.assert_allclose(after["a"], rows["a"] - 1.0, atol=1e-6)
        np.testing.assert_allclose(after["b"], rows["b"] - 1.0, atol=1e-6)


def test_requests_over_the_message_limit_are_split(addresses: list[str]) -> None:
    keys = random_keys(20_000)
    with PSClient(addresses) as whole, PSClient(addresses, ClientConfig(max_message_bytes=1 << 18)) as split:
        whole.create_table("wide", 64, optimizer="sgd", lr=1.0)
        expected = whole.lookup("wide", keys)  # 5 MB of rows, ~20 requests of 256 KiB when split
        np.testing.assert_array_equal(split.lookup("wide", keys), expected)
        grads = RNG.standard_normal((20_000, 64)).astype(np.float32)
        assert split.push("wide", keys, grads).rows_updated == 20_000
        np.testing.assert_allclose(whole.lookup("wide", keys), expected - grads, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_transport(addresses: list[str], dtype: str) -> None:
    keys = random_keys(1000)
    with PSClient(addresses) as exact, PSClient(addresses, ClientConfig(transport_dtype=dtype)) as small:  # type: ignore[arg-type]
        exact.create_table("h", 8, initializer="normal", std=1.0)
        want = exact.lookup("h", keys)
        got = small.lookup("h", keys)
        rtol = 1e-3 if dtype == "float16" else 8e-3
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-4)
        assert not np.array_equal(got, want)  # really went through 16 bits


class _LoseFirstReply(Transport):
    """A transport whose first Push reaches the shard, but whose reply is lost (as on a timeout)."""

    def __init__(self, inner: GrpcTransport) -> None:
        self.inner = inner
        self.lost = 0

    def start(self) -> None:
        self.inner.start()

    def close(self) -> None:
        self.inner.close()

    def address(self, shard: int) -> str:
        return self.inner.address(shard)

    def call(self, shard: int, method: str, request: bytes, timeout_s: float):  # type: ignore[no-untyped-def]
        real = self.inner.call(shard, method, request, timeout_s)
        if method != "Push" or self.lost:
            return real
        real.result()  # the shard applied it
        self.lost += 1
        return _Failed(grpc.StatusCode.DEADLINE_EXCEEDED)


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "reply lost"

    def result(self, timeout_s: float | None = None) -> bytes:
        raise self

    def cancel(self) -> bool:
        return False


def test_retried_push_is_applied_once(addresses: list[str]) -> None:
    flaky = _LoseFirstReply(GrpcTransport(addresses))
    with PSClient(addresses, transport=flaky) as ps:
        ps.create_table("once", 4, optimizer="sgd", lr=1.0)
        key = np.array([7], dtype=np.int64)
        before = ps.lookup("once", key)
        result = ps.push("once", key, np.ones((1, 4), np.float32))
        assert flaky.lost == 1
        assert result.duplicates == 1  # the retry found the push already applied
        np.testing.assert_allclose(ps.lookup("once", key), before - 1.0, atol=1e-7)
        assert sum(s["duplicate_pushes"] for s in ps.admin.stats()) == 1


def test_same_raw_push_twice_is_applied_once(cluster: list[RunningShard]) -> None:
    with PSClient([s.address for s in cluster]) as ps:
        ps.create_table("raw", 2, optimizer="sgd", lr=1.0)
        key = np.array([3], dtype=np.int64)
        shard = int(shard_of(key, 2)[0])
        before = ps.lookup("raw", key)
    request = wire.encode_push_request([("raw", key, np.ones((1, 2), np.float32), wire.FLOAT32)], 2, "c1", 1, shard)
    with grpc.insecure_channel(cluster[shard].address) as channel:
        push = channel.unary_unary("/ps.v1.ParameterServer/Push", None, pb.PushResponse.FromString)
        assert push(request, timeout=10).applied
        assert not push(request, timeout=10).applied
        # A later sequence number from the same client is applied.
        request2 = wire.encode_push_request(
            [("raw", key, np.ones((1, 2), np.float32), wire.FLOAT32)], 2, "c1", 2, shard
        )
        assert push(request2, timeout=10).applied
    with PSClient([s.address for s in cluster]) as ps:
        np.testing.assert_allclose(ps.lookup("raw", key), before - 2.0, atol=1e-7)


def test_push_async_returns_a_future(addresses: list[str]) -> None:
    with PSClient(addresses) as ps:
        ps.create_table("f", 4, optimizer="sgd", lr=1.0)
        keys = random_keys(64)
        before = ps.lookup("f", keys)
        grads = np.ones((64, 4), np.float32)
        future = ps.push_async("f", keys, grads)
        grads[:] = 100.0  # the caller may reuse its buffer at once
        assert future.result(timeout=30).rows_updated == 64
        np.testing.assert_allclose(ps.lookup("f", keys), before - 1.0, atol=1e-6)
        bad = ps.push_async("f", keys, np.full((64, 4), np.inf, np.float32))
        from client import InvalidRequestError

        with pytest.raises(InvalidRequestError, match="Inf"):
            bad.result(timeout=30)
