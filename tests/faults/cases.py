"""The fuzz's requests (tests/faults/test_adversarial.py): ``Generator`` makes ``Case``s for
every method the servers answer, valid ones and every kind of broken one, from a seeded
generator, and ``TARGETS`` weighs the methods. ``Servers`` is what the fuzz runs against.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from protos import infer_pb2 as ipb
from protos import ps_pb2 as pb
from protos.columns import Column, request_of
from tests.fakes import InProcessTransport
from tests.faults import mutations as mut
from tests.faults.oracles import (
    ShardModel,
)
from tests.integration.shards import RunningShard

PS, HEALTH = "/ps.v1.ParameterServer/", "/grpc.health.v1.Health/"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
PREDICT = "/ps.v1.Predictor/Predict"
SHARD_LIMIT_BYTES = 1 << 20
INFER_LIMIT_BYTES = 64 << 20  # ps-infer's receive limit
MAX_CANDIDATES = 64


@dataclass
class Infer:
    proc: subprocess.Popen[bytes]
    address: str
    log: Path
    accepts: dict[str, tuple[str, ...]]
    dense: tuple[str, ...]
    categorical: dict[str, str]


@dataclass
class Servers:
    train: RunningShard
    serve: RunningShard
    infer: Infer
    train_model: ShardModel
    serve_model: ShardModel
    twin: InProcessTransport
    creates: list[bytes]  # CreateTable requests of the tables set up before the run


@dataclass(frozen=True)
class Case:
    target: str  # "train", "serve" or "infer"
    method: str  # full path
    how: str  # what made the bytes
    payload: bytes | tuple[bytes, ...]  # a tuple for the reflection stream
    metadata: mut.MetadataCase | None = None


def lookup_request(table: str, keys: np.ndarray[Any, Any], **kw: Any) -> bytes:
    return pb.LookupRequest(
        entries=[pb.LookupEntry(table=table, keys=keys.astype("<i8").tobytes(), **kw)], num_shards=1, shard=0
    ).SerializeToString()


def push_request(entries: list[tuple[str, bytes, bytes, int]], client_id: str, seq: int, **kw: Any) -> bytes:
    kw = {"num_shards": 1, "shard": 0, **kw}
    return pb.PushRequest(
        entries=[pb.PushEntry(table=t, keys=k, grads=g, dtype=d) for t, k, g, d in entries],  # type: ignore[arg-type]
        client_id=client_id,
        seq=seq,
        **kw,
    ).SerializeToString()


class Generator:
    """Makes ``Case``s from a seeded ``numpy`` generator; knows valid requests for every method."""

    def __init__(self, rng: np.random.Generator, servers: Servers) -> None:
        self.rng, self.servers = rng, servers
        self.seq = 0

    # valid requests ------------------------------------------------------------------
    def keys(self, n: int | None = None) -> np.ndarray[Any, Any]:
        n = int(self.rng.integers(1, 9)) if n is None else n
        pool = self.rng.integers(0, 4096, n) if self.rng.random() < 0.8 else self.rng.integers(-(1 << 62), 1 << 62, n)
        return np.asarray(pool, np.int64)

    def valid_push(self) -> bytes:
        self.seq += 1
        table, dim = ("emb", 8) if self.rng.random() < 0.5 else ("count", 4)
        keys = np.unique(self.keys())
        grads = self.rng.normal(0, 0.1, (keys.shape[0], dim)).astype("<f4")
        return push_request([(table, keys.astype("<i8").tobytes(), grads.tobytes(), 1)], "fuzz", self.seq)

    def valid_shard(self, method: str, target: str) -> bytes:
        if method == "CreateTable":
            return self.servers.creates[int(self.rng.integers(0, 2))]
        if method == "Lookup":
            return lookup_request("emb" if self.rng.random() < 0.5 else "count", self.keys())
        if method == "Push":
            return self.valid_push()
        if method == "Checkpoint":
            return pb.CheckpointRequest(path=f"ck-{self.rng.integers(1 << 40)}").SerializeToString()
        if method == "Follow":
            return pb.FollowRequest(shard=0, num_shards=1).SerializeToString()
        if method == "ServeFrom":
            return pb.ServeFromRequest(checkpoint=str(self.rng.choice(["", "1", "000001"]))).SerializeToString()
        if method == "Erase":  # only asks (verify): an erase would make the shard differ from its twin
            return self.erase_request(verify=True, checkpoints=bool(self.rng.random() < 0.2))
        return b""  # ListTables, Stats

    def erase_request(self, **kw: Any) -> bytes:
        fields = {"table": "emb" if self.rng.random() < 0.5 else "count", "num_shards": 1, "shard": 0, **kw}
        if "keys" not in fields:
            fields["keys"] = self.keys().astype("<i8").tobytes()
        return pb.EraseRequest(**fields).SerializeToString()

    def columns(self, n: int) -> dict[str, Column]:
        infer = self.servers.infer
        out = {}
        for name, kind in infer.categorical.items():
            ids = self.rng.zipf(1.3, n).astype(np.int64) - 1
            out[name] = Column.of(ids if kind == "int64" else [str(i) for i in ids])
        for name in infer.dense:
            out[name] = Column.of(np.floor(self.rng.lognormal(1.0, 1.2, n)))
        return out

    def valid_predict(self) -> bytes:
        n = int(self.rng.integers(1, 9))
        cols = self.columns(n)
        context = {k: Column.of(cols[k].values[:1]) for k in list(cols)[:2]}
        return request_of(n, context, {k: v for k, v in cols.items() if k not in context}).SerializeToString()

    def valid(self, target: str, method: str) -> bytes | tuple[bytes, ...]:
        if method == PREDICT:
            return self.valid_predict()
        if method.startswith(HEALTH):
            service = "ps.v1.Predictor" if target == "infer" else "ps.v1.ParameterServer"
            return health_pb2.HealthCheckRequest(service=str(self.rng.choice(["", service]))).SerializeToString()
        if method == REFLECTION:
            return (
                reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString(),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="grpc.health.v1.Health"
                ).SerializeToString(),
            )
        return self.valid_shard(method.removeprefix(PS), target)

    # targeted bad requests -------------------------------------------------------------
    def targeted(self, target: str, method: str) -> tuple[str, bytes | tuple[bytes, ...]]:
        r = self.rng
        name = method.rsplit("/", 1)[1]
        choices: list[tuple[str, Callable[[], bytes | tuple[bytes, ...]]]]
        if name == "Lookup":
            choices = [
                ("unknown-table", lambda: lookup_request("nope", self.keys())),
                ("empty-table", lambda: lookup_request("", self.keys())),
                (
                    "keys-not-int64",
                    lambda: pb.LookupRequest(
                        entries=[pb.LookupEntry(table="emb", keys=r.bytes(int(r.choice([1, 7, 9, 15]))))]
                    ).SerializeToString(),
                ),
                ("bad-dtype", lambda: lookup_request("emb", self.keys(), dtype=int(r.choice([4, 99, -1])))),
                (
                    "wrong-num-shards",
                    lambda: pb.LookupRequest(
                        entries=[pb.LookupEntry(table="emb", keys=self.keys().tobytes())],
                        num_shards=int(r.choice([2, 3, (1 << 32) - 1])),
                    ).SerializeToString(),
                ),
                (
                    "wrong-shard",
                    lambda: pb.LookupRequest(
                        entries=[pb.LookupEntry(table="emb", keys=self.keys().tobytes())],
                        shard=int(r.choice([1, 7, (1 << 32) - 1])),
                    ).SerializeToString(),
                ),
                ("response-too-large", lambda: lookup_request("emb", np.arange(100_000))),
                (
                    "many-entries",
                    lambda: pb.LookupRequest(
                        entries=[
                            pb.LookupEntry(table=str(r.choice(["emb", "nope"])), keys=self.keys().tobytes())
                            for _ in range(2000)
                        ]
                    ).SerializeToString(),
                ),
                (
                    "huge-key-values",
                    lambda: lookup_request("count", np.array([-(1 << 63), (1 << 63) - 1, 0, -1], np.int64)),
                ),
                ("valid", lambda: self.valid_shard("Lookup", target)),
            ]
        elif name == "Push":
            k4 = lambda: np.unique(self.keys(4)).astype("<i8").tobytes()  # noqa: E731

            def grads(n_keys: int, dim: int, fill: float | None = None, dtype: str = "<f4") -> bytes:
                g = r.normal(0, 0.1, (n_keys, dim)).astype(dtype)
                if fill is not None:
                    g.reshape(-1)[int(r.integers(0, g.size))] = fill
                return g.tobytes()

            def keys_grads(dim: int, fill: float | None = None, dtype: str = "<f4") -> tuple[bytes, bytes]:
                k = k4()
                return k, grads(len(k) // 8, dim, fill, dtype)

            def entry(table: str, dim: int, fill: float | None = None, dtype: str = "<f4", code: int = 1) -> bytes:
                self.seq += 1
                return push_request([(table, *keys_grads(dim, fill, dtype), code)], "fuzz", self.seq)

            def bf16_nan() -> bytes:
                k = k4()
                g = np.full((len(k) // 8, 8), 0x3F80, "<u2")
                g.reshape(-1)[-1] = int(r.choice([0x7FC0, 0x7F80, 0xFF80]))  # NaN, +Inf, -Inf
                self.seq += 1
                return push_request([("emb", k, g.tobytes(), 3)], "fuzz", self.seq)

            choices = [
                ("wrong-dim", lambda: entry("emb", int(r.choice([1, 7, 9, 16])))),
                ("nan-grad", lambda: entry("emb", 8, float("nan"))),
                ("inf-grad", lambda: entry("count", 4, float(r.choice([np.inf, -np.inf])))),
                ("f16-inf-grad", lambda: entry("emb", 8, float("inf"), "<f2", 2)),
                ("bf16-nan-grad", bf16_nan),
                (
                    "grads-off-by-one",
                    lambda: push_request([("emb", k4(), r.bytes(4 * 8 * 4 + int(r.choice([-1, 1, 3]))), 1)], "fuzz", 1),
                ),
                ("keys-not-int64", lambda: push_request([("emb", r.bytes(12), r.bytes(48), 1)], "fuzz", 1)),
                ("bad-dtype", lambda: entry("emb", 8, None, "<f4", int(r.choice([4, 77, -3])))),
                ("unknown-table", lambda: entry("nope", 8)),
                ("empty-table", lambda: entry("", 8)),
                ("wrong-num-shards", lambda: push_request([("emb", *keys_grads(8), 1)], "fuzz", 1, num_shards=2)),
                (
                    "wrong-shard",
                    lambda: push_request([("emb", *keys_grads(8), 1)], "fuzz", 1, shard=int(r.choice([1, 9]))),
                ),
                (
                    "one-bad-entry-of-two",
                    lambda: push_request(
                        [("count", *keys_grads(4), 1), ("emb", *keys_grads(8, float("nan")), 1)],
                        "fuzz",
                        10**9 + self.seq,
                    ),
                ),
                ("max-seq", lambda: push_request([("count", *keys_grads(4), 1)], "fuzz-max", (1 << 64) - 1)),
                ("no-seq", lambda: push_request([("count", *keys_grads(4), 1)], "", 0)),
                ("replayed-seq", lambda: push_request([("count", *keys_grads(4), 1)], "fuzz", max(1, self.seq))),
                ("valid", self.valid_push),
            ]
        elif name == "CreateTable":

            def spec(**kw: Any) -> bytes:
                base: dict[str, Any] = {"name": f"fz{r.integers(1 << 30)}", "dim": 4}
                return pb.CreateTableRequest(spec=pb.TableSpec(**{**base, **kw})).SerializeToString()

            bad_float = lambda: float(r.choice([np.nan, np.inf, -np.inf]))  # noqa: E731
            choices = [
                ("dim-0", lambda: spec(dim=0)),
                ("dim-huge", lambda: spec(dim=int(r.choice([65537, 1 << 31, (1 << 32) - 1])))),
                ("bad-name", lambda: spec(name=str(r.choice(["", "bad name!", "x" * 129, "é", "a\x00b", "../x"])))),
                ("nan-lr", lambda: spec(optimizer=pb.OptimizerSpec(kind=pb.OptimizerSpec.ADAGRAD, lr=bad_float()))),
                ("negative-lr", lambda: spec(optimizer=pb.OptimizerSpec(lr=-1.0))),
                (
                    "nan-init",
                    lambda: spec(initializer=pb.InitializerSpec(kind=pb.InitializerSpec.UNIFORM, high=bad_float())),
                ),
                ("bad-kinds", lambda: spec(optimizer=pb.OptimizerSpec(kind=int(r.choice([6, 99, -1]))))),  # type: ignore[arg-type]
                ("bad-dtype", lambda: spec(dtype=int(r.choice([4, 9, 99])))),  # type: ignore[arg-type]
                ("bad-lifecycle", lambda: spec(lifecycle=pb.Lifecycle(admit_after=256, ttl_seconds=-1.0))),
                (
                    "bad-admit-probability",
                    lambda: spec(lifecycle=pb.Lifecycle(admit_probability=float(r.choice([0.0, 1.5, np.nan])))),
                ),
                ("exists-other-dim", lambda: spec(name="emb", dim=16)),
                ("valid-again", lambda: self.servers.creates[0]),
            ]
        elif name == "Checkpoint":
            choices = [
                (
                    "dot-dot",
                    lambda: pb.CheckpointRequest(path=str(r.choice(["../x", "a/../../b", ".."]))).SerializeToString(),
                ),
                (
                    "outside-root",
                    lambda: pb.CheckpointRequest(
                        path=str(r.choice(["/tmp/fz-outside", "/etc/ps-x", "/"]))
                    ).SerializeToString(),
                ),
                ("nul", lambda: pb.CheckpointRequest(path="a\x00b").SerializeToString()),
                ("too-long", lambda: pb.CheckpointRequest(path="x" * int(r.choice([300, 5000]))).SerializeToString()),
                ("exists", lambda: pb.CheckpointRequest(path="000001").SerializeToString()),
                ("valid", lambda: self.valid_shard("Checkpoint", target)),
            ]
        elif name == "Follow":
            choices = [
                (
                    "wrong-shard",
                    lambda: pb.FollowRequest(
                        shard=int(r.choice([1, 5])), num_shards=int(r.choice([1, 2]))
                    ).SerializeToString(),
                ),
                ("no-shard-count", lambda: pb.FollowRequest().SerializeToString()),
                ("valid", lambda: self.valid_shard("Follow", target)),
            ]
        elif name == "ServeFrom":
            choices = [
                ("dot-dot", lambda: pb.ServeFromRequest(checkpoint="../../x").SerializeToString()),
                ("outside-root", lambda: pb.ServeFromRequest(checkpoint="/etc").SerializeToString()),
                ("nul", lambda: pb.ServeFromRequest(checkpoint="1\x000").SerializeToString()),
                (
                    "missing",
                    lambda: pb.ServeFromRequest(checkpoint=str(r.choice(["nope", "999999", "0"]))).SerializeToString(),
                ),
                ("valid", lambda: self.valid_shard("ServeFrom", target)),
            ]
        elif name == "Erase":  # each broken one is refused before anything is erased
            choices = [
                ("odd-keys", lambda: self.erase_request(keys=b"\x01" * int(r.choice([1, 7, 9, 15])))),
                ("odd-others", lambda: self.erase_request(others=b"\x01" * int(r.choice([1, 7, 9, 15])))),
                ("unknown-table", lambda: self.erase_request(table=f"nope{r.integers(1 << 20)}")),
                ("no-table", lambda: self.erase_request(table="")),
                ("wrong-shard", lambda: self.erase_request(shard=int(r.choice([1, 3])), num_shards=4)),
                ("later-epoch", lambda: self.erase_request(epoch=int(r.choice([1, 7])))),
                ("valid", lambda: self.valid_shard("Erase", target)),
            ]
        elif name == "Predict":
            choices = list(self.predict_targeted())
        elif method.startswith(HEALTH):
            choices = [
                (
                    "unknown-service",
                    lambda: health_pb2.HealthCheckRequest(
                        service=str(r.choice(["nope", "x" * 10000, "ps.v1"]))
                    ).SerializeToString(),
                ),
                ("valid", lambda: self.valid(target, method)),  # type: ignore[return-value]
            ]
        elif method == REFLECTION:
            ask = reflection_pb2.ServerReflectionRequest
            choices = [
                (
                    "bad-file",
                    lambda: (
                        ask(file_by_filename=str(r.choice(["../../etc/passwd", "", "x" * 5000]))).SerializeToString(),
                    ),
                ),
                (
                    "bad-symbol",
                    lambda: (ask(file_containing_symbol=str(r.choice(["nope.Nope", "", "."]))).SerializeToString(),),
                ),
                (
                    "bad-extension",
                    lambda: (
                        ask(
                            file_containing_extension=reflection_pb2.ExtensionRequest(
                                containing_type="x", extension_number=-5
                            )
                        ).SerializeToString(),
                    ),
                ),
                ("many-questions", lambda: tuple(ask(list_services="").SerializeToString() for _ in range(50))),
                ("valid", lambda: self.valid(target, method)),
            ]
        else:  # ListTables, Stats: no fields, so any well-formed bytes are valid
            choices = [("unknown-fields", lambda: mut.tag(7, 2) + mut.varint(5) + b"hello" + mut.tag(9, 0) + b"\x01")]
        how, make = choices[int(r.integers(0, len(choices)))]
        return how, make()

    def predict_targeted(self) -> list[tuple[str, Callable[[], bytes]]]:
        r = self.rng

        def request(change: Callable[[dict[str, Column], dict[str, Column]], Any]) -> bytes:
            n = 4
            cols = self.columns(n)
            context = {k: Column.of(cols[k].values[:1]) for k in list(cols)[:1]}
            candidates = {k: v for k, v in cols.items() if k not in context}
            n = int(change(context, candidates) or n)
            return request_of(n, context, candidates).SerializeToString()

        infer = self.servers.infer
        cat, num = next(iter(infer.categorical)), infer.dense[-1]
        wrong = "string" if infer.categorical[cat] != "string" else "int64"

        def wrong_bytes() -> bytes:
            msg = ipb.PredictRequest.FromString(request(lambda ctx, cand: None))
            column = msg.candidates[int(r.integers(0, len(msg.candidates)))]
            column.values = column.values[: -int(r.integers(1, 8))] if column.values else b"\x01"
            return msg.SerializeToString()

        return [
            (
                "num-candidates",
                lambda: request(lambda ctx, cand: int(r.choice([(1 << 32) - 1, MAX_CANDIDATES + 1, 10**6]))),
            ),
            ("zero-candidates", lambda: ipb.PredictRequest(num_candidates=0).SerializeToString()),
            ("unknown-feature", lambda: request(lambda ctx, cand: cand.update(nope=Column.of(np.zeros(4, np.int64))))),
            ("missing-feature", lambda: request(lambda ctx, cand: cand.pop(num) and None)),
            ("feature-twice", lambda: request(lambda ctx, cand: ctx.update({num: Column.of([1.0])}))),
            (
                "wrong-type",
                lambda: request(
                    lambda ctx, cand: cand.update(
                        {cat: Column.of(["a", "b", "c", "d"] if wrong == "string" else np.arange(4))}
                    )
                ),
            ),
            (
                "wrong-count",
                lambda: request(lambda ctx, cand: cand.update({num: Column.of(np.ones(int(r.choice([1, 3, 5]))))})),
            ),
            (
                "inf-dense",
                lambda: request(lambda ctx, cand: cand.update({num: Column.of(np.array([1.0, np.inf, 2.0, -np.inf]))})),
            ),
            ("text-dense", lambda: request(lambda ctx, cand: cand.update({num: Column.of(["1", "x", "", "2"])}))),
            ("bad-byte-lengths", wrong_bytes),
            (
                "bad-string-lengths",
                lambda: ipb.PredictRequest(
                    num_candidates=2,
                    candidates=[
                        ipb.Column(
                            name=num,
                            type=ipb.VALUE_TYPE_STRING,
                            values=b"12",
                            lengths=np.array([[1, 2], [-1, 3], [1, 0]][int(r.integers(0, 3))], "<i4").tobytes()[
                                : int(r.choice([4, 8, 5]))
                            ],
                        )
                    ],
                ).SerializeToString(),
            ),
            (
                "unknown-type",
                lambda: ipb.PredictRequest(
                    num_candidates=1,
                    candidates=[ipb.Column(name=num, type=int(r.choice([0, 4, 99])), values=b"\x00" * 8)],
                ).SerializeToString(),
            ),  # type: ignore[arg-type]
            ("valid", self.valid_predict),
        ]

    # one case ----------------------------------------------------------------------------
    def case(self, target: str, method: str) -> Case:
        r = self.rng
        roll = r.random()
        payload: bytes | tuple[bytes, ...]
        if roll < 0.2:
            how, payload = "random", mut.random_bytes(r)
            if method == REFLECTION:
                payload = (payload,)
            return Case(target, method, how, payload)
        base = self.valid(target, method)
        if roll < 0.5:
            how = "bitflip"
            payload = (
                tuple(mut.flip_bits(r, p) if r.random() < 0.5 else p for p in base)
                if isinstance(base, tuple)
                else mut.flip_bits(r, base)
            )
        elif roll < 0.6:
            how, payload = "truncate" if r.random() < 0.5 else "append-junk", base
            change = mut.truncate if how == "truncate" else mut.append_junk
            payload = tuple(change(r, p) for p in base) if isinstance(base, tuple) else change(r, base)
        elif roll < 0.72:
            if isinstance(base, tuple):
                name, first = mut.structural(r, base[0])
                how, payload = name, (first, *base[1:])
            else:
                how, payload = mut.structural(r, base)
        elif roll < 0.92:
            how, payload = self.targeted(target, method)
        else:
            md = mut.metadata_cases(r)
            meta = md[int(r.integers(0, len(md)))]
            return Case(target, method, f"metadata-{meta.name}", base, meta)
        return Case(target, method, how, payload)

    def oversized(self, target: str, method: str) -> Case:
        limit = INFER_LIMIT_BYTES if target == "infer" else SHARD_LIMIT_BYTES
        payload = mut.oversized(limit + int(self.rng.integers(1, 1 << 20)))
        return Case(target, method, "oversized", (payload,) if method == REFLECTION else payload)


SHARD_METHODS = ["CreateTable", "ListTables", "Lookup", "Push", "Stats", "Checkpoint", "Follow", "ServeFrom", "Erase"]
TARGETS: list[tuple[str, str, float]] = (
    [("train", PS + m, 3.0) for m in SHARD_METHODS]
    + [("serve", PS + m, 1.0) for m in SHARD_METHODS]
    + [("infer", PREDICT, 8.0)]
    + [(t, HEALTH + m, 1.0) for t in ("train", "serve", "infer") for m in ("Check", "Watch")]
    + [(t, REFLECTION, 1.0) for t in ("train", "serve", "infer")]
)
STREAMS = {PS + "Follow", HEALTH + "Watch"}
