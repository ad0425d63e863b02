"""PSClient against three real ``Shard``s through ``tests.fakes.InProcessTransport`` (no network).

Expected rows come from ``initial_rows`` and the SGD formula; expected routing from
``protos.keys.shard_of``. Faults are injected in the transport, before or after the
shard handled a call.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import grpc
import numpy as np
import pytest

from client import (
    ClientConfig,
    InvalidRequestError,
    PreconditionError,
    PSClient,
    PushResult,
    ResourceExhaustedError,
    TableExistsError,
    TableNotFoundError,
)
from protos.keys import shard_of
from ps.shard import Shard
from ps.table import InitializerKind, InitializerParams, OptimizerKind, OptimizerParams, TableSpec
from ps.table.ledger import PushLedger
from tests.fakes import InProcessTransport
from tests.unit.client_cluster import (
    DIM,
    F32,
    FAST,
    KEYS,
    N,
    addresses,
    initial,
    requests_per_shard,
    spec_of,
    stored_keys,
)

# -- lookup and push ------------------------------------------------------------------


def test_lookup_and_push_round_trip_routes_every_key_to_its_shard(ps: PSClient, shards: list[Shard]) -> None:
    spec = spec_of(shards)
    rows = ps.lookup("t", KEYS)

    assert rows.dtype == np.float32 and rows.shape == (KEYS.size, DIM)
    np.testing.assert_array_equal(rows, initial(spec, KEYS))
    owner = shard_of(KEYS, N)
    for i, shard in enumerate(shards):
        assert stored_keys(shard) == sorted(KEYS[owner == i].tolist())
        assert len(shard.table("t")) > 0

    grads = np.linspace(-2, 2, KEYS.size * DIM, dtype=np.float32).reshape(-1, DIM)
    result = ps.push("t", KEYS, grads)

    assert result == PushResult(rows_updated=KEYS.size, duplicates=0)
    # lr=0.5: 0.5*g is exact, so ``row - 0.5*g`` rounds once, as the fused kernel does.
    np.testing.assert_array_equal(ps.lookup("t", KEYS), rows - np.float32(0.5) * grads)
    assert sum(len(s.table("t")) for s in shards) == KEYS.size


def test_a_plan_stands_in_for_its_keys_in_lookups_and_pushes(
    ps: PSClient, shards: list[Shard], transport: InProcessTransport
) -> None:
    keys = np.array([9, 3, 9, 1000, 3, -5, 9], dtype=np.int64)
    grads = np.arange(keys.size * DIM, dtype=np.float32).reshape(-1, DIM) / 8
    plan = ps.plan("t", keys)
    assert plan.keys.tolist() == keys.tolist() and plan.unique.size == 4
    by_plan = ps.lookup_many({"t": plan})["t"]
    np.testing.assert_array_equal(by_plan, ps.lookup("t", keys))
    assert ps.push_many({"t": (plan, grads)}) == PushResult(rows_updated=4, duplicates=0)
    assert ps.push_many_async({"t": (plan, grads)}).result() == PushResult(rows_updated=4, duplicates=0)
    # Bit for bit what the same pushes given as keys do, on a twin table.
    ps.create_table("twin", DIM, lr=0.5, seed=3)
    ps.push_many({"twin": (keys, grads)})
    ps.push_many({"twin": (keys, grads)})
    np.testing.assert_array_equal(ps.lookup_many({"t": plan})["t"], ps.lookup("twin", keys))
    assert not np.array_equal(ps.lookup("t", keys), by_plan)
    # A plan belongs to its table and dim; one routed for another cluster size (made before
    # a live reshard) has its keys routed again.
    ps.create_table("u", DIM + 1)
    with pytest.raises(InvalidRequestError, match="table 'u': a plan made for table 't', dim 4 does not fit dim 5"):
        ps.lookup_many({"u": plan})
    elsewhere = PSClient(addresses(2), FAST, transport=InProcessTransport(shards[:2]))
    np.testing.assert_array_equal(ps.lookup_many({"t": elsewhere.plan("t", keys)})["t"], ps.lookup("t", keys))
    with pytest.raises(InvalidRequestError, match="does not fit dim 5"):
        ps.push_many({"t": (plan, np.zeros((keys.size, DIM + 1), np.float32))})
    with pytest.raises(InvalidRequestError, match="grads shape"):
        ps.push_many({"t": (plan, grads[:3])})


def test_a_plans_unique_keys_are_planned_without_a_second_dedup(ps: PSClient, transport: InProcessTransport) -> None:
    keys = np.array([9, 3, 9, 1000, 3, -5, 9], dtype=np.int64)
    plan = ps.plan("t", keys)
    once = plan.of_unique()
    assert once.keys.tolist() == plan.unique.tolist() == [9, 3, 1000, -5] and not once.has_duplicates
    assert once.order is plan.order and once.bounds is plan.bounds  # the same routing, not a new one
    assert once.of_unique() is once
    rows = ps.lookup_many({"t": once})["t"]
    np.testing.assert_array_equal(rows[plan.inverse], ps.lookup("t", keys))  # the caller's fan-out
    before = transport.count("Push")
    grads = np.ones((4, DIM), np.float32)
    assert ps.push_many({"t": (once, grads)}) == PushResult(rows_updated=4, duplicates=0)
    assert len({s for s in shard_of(once.keys, N).tolist()}) < N  # some shard holds none of the keys...
    assert transport.count("Push") - before == N  # ...and still hears of the push (its seq)


def test_duplicates_and_caller_order_are_preserved(ps: PSClient, shards: list[Shard]) -> None:
    spec = spec_of(shards)
    keys = np.array([9, 3, 9, 1000, 3, -5, 9], dtype=np.int64)
    np.testing.assert_array_equal(ps.lookup("t", keys), initial(spec, keys))
    assert sum(len(s.table("t")) for s in shards) == 4

    grads = np.arange(7 * DIM, dtype=np.float32).reshape(7, DIM)
    assert ps.push("t", keys, grads).rows_updated == 4  # distinct rows

    summed = {9: grads[0] + grads[2] + grads[6], 3: grads[1] + grads[4], 1000: grads[3], -5: grads[5]}
    expected = np.stack([initial(spec, [k])[0] - np.float32(0.5) * summed[k] for k in keys.tolist()])
    np.testing.assert_array_equal(ps.lookup("t", keys), expected)


def test_lookup_accepts_python_lists_and_unsigned_keys(ps: PSClient, shards: list[Shard]) -> None:
    spec = spec_of(shards)
    as_uint = np.array([2**64 - 1, 5], dtype=np.uint64)
    np.testing.assert_array_equal(ps.lookup("t", as_uint), initial(spec, [-1, 5]))
    np.testing.assert_array_equal(ps.lookup("t", [7, 8]), initial(spec, [7, 8]))


def test_lookup_fills_out_buffer(ps: PSClient, shards: list[Shard]) -> None:
    keys = np.array([1, 2, 1, 77], dtype=np.int64)
    out = np.full((4, DIM), np.nan, dtype=np.float32)
    returned = ps.lookup("t", keys, out=out)
    assert returned is out
    np.testing.assert_array_equal(out, initial(spec_of(shards), keys))


@pytest.mark.parametrize(
    "out",
    [
        np.zeros((3, DIM), np.float32),  # wrong length
        np.zeros((4, DIM + 1), np.float32),  # wrong dim
        np.zeros((4, DIM), np.float64),  # wrong dtype
        np.zeros((DIM, 4), np.float32).T,  # not C-contiguous
    ],
    ids=["rows", "dim", "dtype", "layout"],
)
def test_lookup_rejects_bad_out_buffer_before_any_rpc(ps: PSClient, transport: InProcessTransport, out: F32) -> None:
    with pytest.raises(InvalidRequestError, match=r"expected C-contiguous float32\[4, 4\]") as info:
        ps.lookup("t", [1, 2, 3, 4], out=out)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.shard is None
    assert transport.count("Lookup") == 0


def test_bad_keys_and_grads_are_rejected_client_side(ps: PSClient, transport: InProcessTransport) -> None:
    with pytest.raises(InvalidRequestError, match="expected 1-D"):
        ps.lookup("t", np.zeros((2, 2), np.int64))
    with pytest.raises(InvalidRequestError, match="expected integers"):
        ps.lookup("t", np.array([1.5]))
    with pytest.raises(InvalidRequestError, match=r"grads shape \(3, 4\), expected \(2, dim\)"):
        ps.push("t", [1, 2], np.zeros((3, DIM), np.float32))
    with pytest.raises(InvalidRequestError, match="expected a float dtype"):
        ps.push("t", [1, 2], np.zeros((2, DIM), np.int32))
    assert transport.count("Lookup") == transport.count("Push") == 0


def test_empty_keys(ps: PSClient, transport: InProcessTransport) -> None:
    rows = ps.lookup("t", np.array([], dtype=np.int64))
    assert rows.shape == (0, DIM) and rows.dtype == np.float32
    assert ps.lookup("t", []).shape == (0, DIM)
    assert ps.push("t", [], np.zeros((0, DIM), np.float32)) == PushResult(0, 0)
    assert transport.count("Lookup") == transport.count("Push") == 0  # nothing to send

    ps.create_table("u", 2)
    mixed = ps.lookup_many({"t": [], "u": [1]})
    assert mixed["t"].shape == (0, DIM) and mixed["u"].shape == (1, 2)
    assert transport.count("Lookup") == 1  # only the shard of key 1


def test_multi_table_calls_send_one_request_per_shard(
    ps: PSClient, transport: InProcessTransport, shards: list[Shard]
) -> None:
    ps.create_table("u", 7, seed=1)
    keys_t, keys_u = KEYS[:100], KEYS[50:]

    rows = ps.lookup_many({"t": keys_t, "u": keys_u})

    assert requests_per_shard(transport, "Lookup") == [1, 1, 1]
    np.testing.assert_array_equal(rows["t"], initial(spec_of(shards, "t"), keys_t))
    np.testing.assert_array_equal(rows["u"], initial(spec_of(shards, "u"), keys_u))

    result = ps.push_many(
        {"t": (keys_t, np.ones((keys_t.size, DIM), np.float32)), "u": (keys_u, np.ones((keys_u.size, 7), np.float32))}
    )

    assert requests_per_shard(transport, "Push") == [1, 1, 1]
    assert result == PushResult(rows_updated=keys_t.size + keys_u.size)
    np.testing.assert_array_equal(ps.lookup("t", keys_t), rows["t"] - np.float32(0.5))
    u_expected = (rows["u"].astype(np.float64) - np.float64(np.float32(0.01))).astype(np.float32)
    np.testing.assert_array_equal(ps.lookup("u", keys_u), u_expected)


def test_small_max_message_bytes_splits_requests_with_same_results(shards: list[Shard]) -> None:
    limit = 1 << 16
    dim = 64  # 264 bytes per key on the wire: about 230 keys per request
    keys = np.arange(2000, dtype=np.int64)
    transport = InProcessTransport(shards, max_message_bytes=limit)
    config = ClientConfig(max_message_bytes=limit, backoff_initial_s=0.001, tune_malloc=False)
    grads = np.full((keys.size, dim), 0.5, np.float32)

    with PSClient(addresses(), config, transport=transport) as ps:
        ps.create_table("big", dim, lr=0.5)
        spec = spec_of(shards, "big")
        np.testing.assert_array_equal(ps.lookup("big", keys), initial(spec, keys))
        assert ps.push("big", keys, grads) == PushResult(rows_updated=keys.size)
        np.testing.assert_array_equal(ps.lookup("big", keys), initial(spec, keys) - np.float32(0.25))

    per_shard = np.bincount(shard_of(keys, N), minlength=N)
    for method in ("Lookup", "Push"):
        counts = requests_per_shard(transport, method)
        assert all(c >= 2 for c in counts), (method, counts)
        assert sum(counts) >= 2000 * 264 // limit
    assert all(len(req) <= limit for _, _, req in transport.calls)
    assert [len(s.table("big")) for s in shards] == per_shard.tolist()


def test_unsplit_request_over_the_shard_limit_is_resource_exhausted(shards: list[Shard]) -> None:
    transport = InProcessTransport(shards, max_message_bytes=1 << 16)
    with PSClient(addresses(), FAST, transport=transport) as ps:  # client limit 64 MiB
        ps.create_table("big", 64)
        with pytest.raises(ResourceExhaustedError) as info:
            ps.lookup("big", np.arange(2000))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert transport.count("Lookup") == N  # not retried


def test_transport_dtype_float16_rounds_rows_and_grads(shards: list[Shard], transport: InProcessTransport) -> None:
    config = ClientConfig(transport_dtype="float16", backoff_initial_s=0.001, tune_malloc=False)
    with PSClient(addresses(), config, transport=transport) as ps:
        ps.create_table("h", DIM, lr=1.0, initializer="constant", value=0.5)
        keys = np.arange(20, dtype=np.int64)
        np.testing.assert_array_equal(ps.lookup("h", keys), np.full((20, DIM), 0.5, np.float32))
        g = np.full((20, DIM), 0.1, np.float32)  # 0.1 is not a float16: it travels rounded
        ps.push("h", keys, g)
        stored = np.concatenate([s.table("h").export().values for s in shards])
        expected = np.float32(0.5) - np.float32(np.float16(0.1))
        np.testing.assert_array_equal(stored, np.full((20, DIM), expected, np.float32))


def test_serving_shards_read_zeros_and_refuse_pushes(ps: PSClient, shards: list[Shard]) -> None:
    ps.lookup("t", [1, 2, 3])
    serving = [Shard(i, N, mode="serve") for i in range(N)]
    for trained, served in zip(shards, serving):  # serving shards holding the training shards' rows
        served.swap_tables({"t": trained.table("t")})
    with PSClient(addresses(), FAST, transport=InProcessTransport(serving)) as reader:
        rows = reader.lookup("t", [1, 10_000])
        np.testing.assert_array_equal(rows[0], initial(spec_of(shards), [1])[0])
        np.testing.assert_array_equal(rows[1], np.zeros(DIM, np.float32))
        assert sum(len(s.table("t")) for s in serving) == 3
        with pytest.raises(PreconditionError, match="read-only") as info:
            reader.push("t", [1], np.ones((1, DIM), np.float32))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_client_with_fewer_addresses_than_shards_is_refused(shards: list[Shard], transport: InProcessTransport) -> None:
    with PSClient(addresses(2), FAST, transport=transport) as ps:
        ps.create_table("t", DIM)  # CreateTable carries no routing
        with pytest.raises(PreconditionError, match=r"routed for num_shards=2.*cluster of 3") as info:
            ps.lookup("t", np.arange(100))
    assert info.value.shard in (0, 1) and info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert sum(len(s.table("t")) for s in shards[:2]) == 0


def test_single_shard_push_with_duplicates() -> None:
    shard = Shard(0, 1)
    with PSClient(["inproc:0"], FAST, transport=InProcessTransport([shard])) as ps:
        ps.create_table("t", DIM, lr=0.5)
        keys = np.array([3, 1, 3, 2], dtype=np.int64)
        start = ps.lookup("t", [3, 1, 2])
        grads = np.array([[1.0] * DIM, [2.0] * DIM, [4.0] * DIM, [8.0] * DIM], np.float32)
        assert ps.push("t", keys, grads) == PushResult(rows_updated=3)
        summed = np.stack([grads[0] + grads[2], grads[1], grads[3]])
        np.testing.assert_array_equal(ps.lookup("t", [3, 1, 2]), start - np.float32(0.5) * summed)


def test_table_created_elsewhere_is_found_and_unknown_table_is_not(ps: PSClient, shards: list[Shard]) -> None:
    with PSClient(addresses(), FAST, transport=InProcessTransport(shards)) as other:
        np.testing.assert_array_equal(other.lookup("t", [4]), initial(spec_of(shards), [4]))
        assert set(other.admin.tables()) == {"t"}
        with pytest.raises(TableNotFoundError, match=r"'nope' does not exist \(tables: t\)") as info:
            other.lookup("nope", [1])
    assert info.value.code == grpc.StatusCode.NOT_FOUND and info.value.shard is None


def test_pushes_of_two_clients_are_not_duplicates_of_each_other(ps: PSClient, shards: list[Shard]) -> None:
    start = ps.lookup("t", [1])
    with PSClient(addresses(), FAST, transport=InProcessTransport(shards)) as other:  # seqs start at 1 too
        assert other.push("t", [1], np.ones((1, DIM), np.float32)) == PushResult(1, 0)
    assert ps.push("t", [1], np.ones((1, DIM), np.float32)) == PushResult(1, 0)
    np.testing.assert_array_equal(ps.lookup("t", [1]), start - np.float32(0.5) - np.float32(0.5))


def test_every_shard_hears_every_push_so_its_ledger_stays_a_watermark(ps: PSClient, shards: list[Shard]) -> None:
    only_shard_0 = KEYS[shard_of(KEYS, N) == 0][:5]
    for _ in range(20):  # pushes whose keys all live on shard 0
        ps.push("t", only_shard_0, np.ones((5, DIM), np.float32))
    for shard in shards:  # no gaps anywhere: each shard's entry is its watermark alone
        assert PushLedger.decode(shard.table("t").ledger.encode(ps.client_id)) == (20, [])


def test_a_second_client_with_the_same_id_and_seqs_is_a_duplicate(ps: PSClient, shards: list[Shard]) -> None:
    # What a trainer resumed from a checkpoint does: it sends its steps again with the
    # seqs they had; the shards skip what they applied before, and take what is new.
    grads = np.ones((KEYS.size, DIM), np.float32)
    first = PSClient(addresses(), FAST, transport=InProcessTransport(shards), client_id="job-7/epoch-0")
    start = first.lookup("t", KEYS)
    for step in (1, 2):
        assert first.push("t", KEYS, grads, seq=step) == PushResult(KEYS.size, 0)
    after_two = first.lookup("t", KEYS)
    resumed = PSClient(addresses(), FAST, transport=InProcessTransport(shards), client_id="job-7/epoch-0")
    assert resumed.push("t", KEYS, grads, seq=2) == PushResult(0, N)  # applied before, on every shard
    np.testing.assert_array_equal(resumed.lookup("t", KEYS), after_two)
    assert resumed.push("t", KEYS, grads, seq=3) == PushResult(KEYS.size, 0)
    np.testing.assert_array_equal(resumed.lookup("t", KEYS), after_two - np.float32(0.5))
    assert not np.array_equal(after_two, start)


@pytest.mark.parametrize("bad", [0, -1, 2**64, 1.0, True])
def test_a_bad_seq_is_refused_before_anything_is_sent(ps: PSClient, transport: InProcessTransport, bad: object) -> None:
    with pytest.raises(InvalidRequestError, match=r"seq=.*must be an integer"):
        ps.push("t", [1], np.ones((1, DIM), np.float32), seq=bad)  # type: ignore[arg-type]
    assert transport.count("Push") == 0


@pytest.mark.parametrize("bad", ["", "x" * 129, "tab\t", "é"])
def test_a_bad_client_id_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="client_id"):
        PSClient(addresses(), FAST, client_id=bad)


def test_a_push_over_the_message_limit_takes_several_numbered_rounds(shards: list[Shard]) -> None:
    small = dataclasses.replace(FAST, max_message_bytes=1 << 16)
    with PSClient(addresses(), small, transport=InProcessTransport(shards)) as ps:
        ps.create_table("t", DIM, lr=0.5, seed=3)
        keys = np.arange(20_000, dtype=np.int64)  # about 160 KB of a push a shard: 3 requests each
        start = ps.lookup("t", keys)
        assert ps.push("t", keys, np.ones((keys.size, DIM), np.float32)).rows_updated == keys.size
        np.testing.assert_array_equal(ps.lookup("t", keys), start - np.float32(0.5))
        entries = [PushLedger.decode(s.table("t").ledger.encode(ps.client_id)) for s in shards]
        assert entries[0][0] >= 3 and entries == [(entries[0][0], [])] * N  # a seq a round, heard everywhere
        with pytest.raises(InvalidRequestError, match="needs .* requests for one shard"):
            ps.push("t", keys, np.ones((keys.size, DIM), np.float32), seq=100)


def test_stats_report_rows_per_shard(ps: PSClient, shards: list[Shard]) -> None:
    ps.lookup("t", KEYS)
    stats = ps.admin.stats()
    assert [s["shard"] for s in stats] == [0, 1, 2]
    assert all(s["num_shards"] == N and s["mode"] == "train" for s in stats)
    rows = [s["tables"][0]["rows"] for s in stats]
    assert rows == np.bincount(shard_of(KEYS, N), minlength=N).tolist()


# -- create_table ---------------------------------------------------------------------


def test_create_table_options_reach_every_shard(ps: PSClient, shards: list[Shard]) -> None:
    config = ps.create_table(
        "emb",
        6,
        optimizer="AdaGrad",
        initializer="normal",
        seed=2**64 - 1,
        lr=0.05,
        eps=1e-6,
        initial_accumulator_value=0.1,
        mean=0.5,
        std=0.2,
    )

    expected = TableSpec(
        "emb",
        6,
        initializer=InitializerParams(InitializerKind.NORMAL, mean=0.5, std=0.2),
        optimizer=OptimizerParams(OptimizerKind.ADAGRAD, lr=0.05, eps=1e-6, initial_accumulator_value=0.1),
        seed=2**64 - 1,
    )
    assert [s.table("emb").spec for s in shards] == [expected] * N
    assert (config.name, config.dim, config.seed) == ("emb", 6, 2**64 - 1)
    assert (config.optimizer, config.initializer) == ("adagrad", "normal")
    assert config.optimizer_params["lr"] == 0.05 and config.optimizer_params["beta1"] == 0.9  # default filled
    assert config.initializer_params["std"] == 0.2 and config.initializer_params["low"] == -0.05
    assert (
        ps.create_table(
            "emb",
            6,
            optimizer="adagrad",
            initializer="normal",
            seed=2**64 - 1,
            lr=0.05,
            eps=1e-6,
            initial_accumulator_value=0.1,
            mean=0.5,
            std=0.2,
        )
        == config
    )


def test_create_table_defaults(ps: PSClient, shards: list[Shard]) -> None:
    config = ps.create_table("plain", 3)
    assert [s.table("plain").spec for s in shards] == [TableSpec("plain", 3)] * N
    assert (config.optimizer, config.initializer, config.seed) == ("sgd", "uniform", 0)


def test_create_table_unknown_option_is_a_type_error(ps: PSClient, transport: InProcessTransport) -> None:
    before = transport.count("CreateTable")
    with pytest.raises(
        TypeError, match=r"unknown option 'learning_rate'; valid: lr, weight_decay, .*beta, low, .*value"
    ):
        ps.create_table("x", 4, learning_rate=0.1)
    with pytest.raises(
        InvalidRequestError, match=r"optimizer='adamw': expected one of sgd, adagrad, adam, ftrl, rowwise_adagrad"
    ):
        ps.create_table("x", 4, optimizer="adamw")
    with pytest.raises(InvalidRequestError, match=r"initializer='xavier'"):
        ps.create_table("x", 4, initializer="xavier")
    assert transport.count("CreateTable") == before


def test_create_table_bad_value_is_rejected_by_the_shards(ps: PSClient, shards: list[Shard]) -> None:
    with pytest.raises(InvalidRequestError, match=r"lr=-1\.0: must be > 0") as info:
        ps.create_table("x", 4, lr=-1.0)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert all(not any(t.spec.name == "x" for t in s.tables()) for s in shards)


def test_create_table_with_another_spec_names_the_difference(ps: PSClient, shards: list[Shard]) -> None:
    with pytest.raises(TableExistsError, match=r"dim: 4 != 8") as info:
        ps.create_table("t", 8, lr=0.5, seed=3)
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert all(s.table("t").dim == DIM for s in shards)


# -- push_async, lifecycle ------------------------------------------------------------


def test_push_async_returns_a_future(ps: PSClient, shards: list[Shard]) -> None:
    start = ps.lookup("t", KEYS)
    grads = np.ones((KEYS.size, DIM), np.float32)
    future = ps.push_async("t", KEYS, grads)
    grads[:] = np.nan  # the inputs were copied: reusing them does not change the push
    assert isinstance(future, Future)
    assert future.result(timeout=10) == PushResult(rows_updated=KEYS.size)
    np.testing.assert_array_equal(ps.lookup("t", KEYS), start - np.float32(0.5))


def test_push_async_surfaces_errors(ps: PSClient) -> None:
    grads = np.full((2, DIM), np.inf, np.float32)
    future = ps.push_async("t", [1, 2], grads)
    err = future.exception(timeout=10)
    assert isinstance(err, InvalidRequestError) and err.code == grpc.StatusCode.INVALID_ARGUMENT
    missing = ps.push_many_async({"nope": ([1], np.ones((1, DIM), np.float32))})
    with pytest.raises(TableNotFoundError):
        missing.result(timeout=10)


def test_constructor_does_no_io_and_with_opens_and_closes(shards: list[Shard]) -> None:
    transport = InProcessTransport(shards)
    client = PSClient(addresses(), FAST, transport=transport)
    assert (transport.starts, transport.closes, transport.calls) == (0, 0, [])

    with client as ps:
        assert ps is client
        assert (transport.starts, transport.calls) == (1, [])
        ps.create_table("t", DIM)
    assert (transport.starts, transport.closes) == (1, 1)


def test_first_use_starts_the_client(shards: list[Shard]) -> None:
    transport = InProcessTransport(shards)
    client = PSClient(addresses(), FAST, transport=transport)
    try:
        client.create_table("t", DIM)
        assert transport.starts == 1
        client.lookup("t", [1])
        client.start()  # idempotent
        assert transport.starts == 1
    finally:
        client.close()
    assert transport.closes == 1


def test_constructor_rejects_bad_addresses() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        PSClient([])
    with pytest.raises(ValueError, match="non-empty list"):
        PSClient("127.0.0.1:1")  # a str is a Sequence[str], but not a list of addresses
