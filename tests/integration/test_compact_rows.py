"""16-bit tables through real shard processes: kill -9, restart, checkpoint, offline
reshard and Follow keep every row bit for bit in its stored type.

The reference is an in-process ``ps.table.Table`` with the same spec, given the same
pushes (distinct keys per push, so no summation order differs). Values are compared
through lookups; state and version through the next push, whose result depends on
both: a row whose state or version changed on the way would come out different.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import numpy.typing as npt

from client import PSClient
from ps.store import precision
from ps.table import OptimizerKind, OptimizerParams, Table, TableSpec
from tests.integration.shards import RunningShard, start_shard, stop_shard
from tests.integration.test_admin import ok, ps_admin
from tests.integration.test_serving import wait_caught_up

DIM = 8
SPEC = TableSpec(
    "emb",
    DIM,
    optimizer=OptimizerParams(OptimizerKind.ADAGRAD, lr=0.1),
    seed=3,
    storage_dtype="bfloat16",
    state_dtype="bfloat16",
)
KEYS = np.unique(np.random.default_rng(9).integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64))


def push_round(addresses: list[str], twin: Table, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with PSClient(addresses) as ps:
        for _ in range(4):
            keys = rng.choice(KEYS, 800, replace=False)
            grads = rng.standard_normal((800, DIM)).astype(np.float32)
            ps.lookup("emb", keys)
            twin.lookup(keys)
            ps.push("emb", keys, grads)
            twin.push(keys, grads)


def assert_same(addresses: list[str], twin: Table, what: str) -> None:
    with PSClient(addresses) as ps:
        got = ps.lookup("emb", KEYS)
    want = twin.lookup(KEYS, touch=False)
    differ = int((got.view(np.uint32) != want.view(np.uint32)).any(axis=1).sum())
    assert differ == 0, f"{what}: {differ} of {KEYS.shape[0]} rows differ from the twin"


def lookups(addresses: list[str]) -> npt.NDArray[np.float32]:
    with PSClient(addresses) as ps:
        return ps.lookup("emb", KEYS)


def test_a_bfloat16_table_survives_kill_restart_checkpoint_reshard_and_follow(
    tmp_path: Path, procs: list[RunningShard]
) -> None:
    args = (f"--data-dir={tmp_path / 'data'}", "--durability=every-push", f"--checkpoint-root={tmp_path / 'ckpts'}")
    shard = start_shard(0, 1, tmp_path, *args)
    procs.append(shard)
    twin = Table(SPEC)
    with PSClient([shard.address]) as ps:
        config = ps.create_table(
            "emb", DIM, optimizer="adagrad", lr=0.1, seed=3, storage_dtype="bfloat16", state_dtype="bfloat16"
        )
        assert (config.storage_dtype, config.state_dtype) == ("bfloat16", "bfloat16")
    push_round([shard.address], twin, 1)
    assert_same([shard.address], twin, "before any fault")

    shard.proc.kill()  # kill -9: every acknowledged push was written first
    shard.proc.wait()
    shard = start_shard(0, 1, tmp_path, *args)
    procs.append(shard)
    assert_same([shard.address], twin, "after kill -9 and restart")
    push_round([shard.address], twin, 2)  # state and versions came back too
    assert_same([shard.address], twin, "pushed after the restart")

    follower = start_shard(0, 1, tmp_path / "serve", "--mode=serve", f"--follow={shard.address}")
    procs.append(follower)
    wait_caught_up(follower.address, shard.address)
    assert_same([follower.address], twin, "the follower")
    push_round([shard.address], twin, 3)
    wait_caught_up(follower.address, shard.address)
    assert_same([follower.address], twin, "the follower after more pushes")
    stop_shard(follower)

    ckpt = tmp_path / "ckpts" / "one"
    ok(ps_admin("checkpoint", "--addresses", shard.address, "--out", ckpt, cwd=tmp_path))
    stop_shard(shard)
    spec = json.loads((ckpt / "manifest.json").read_text())
    assert spec["num_shards"] == 1
    two = tmp_path / "two"
    ok(ps_admin("reshard", "--from", ckpt, "--to-shards", "2", "--out", two, cwd=tmp_path))
    shards = [
        start_shard(
            j,
            2,
            tmp_path / f"r{j}",
            f"--data-dir={tmp_path / f'r{j}'}",
            f"--restore-from={two / f'shard-{j:05d}-of-00002'}",
        )
        for j in range(2)
    ]
    procs.extend(shards)
    addresses = [s.address for s in shards]
    assert_same(addresses, twin, "restored from a checkpoint resharded to 2 shards")
    push_round(addresses, twin, 4)
    assert_same(addresses, twin, "pushed after the reshard")
    with PSClient(addresses) as ps:
        stats = [t for s in ps.admin.stats() for t in s["tables"]]
    # values 8 x 2 B, state 8 x 2 B, version, last use and use count 3 x 4 B
    assert [(t["name"], t["storage_dtype"], t["state_dtype"], t["record_bytes"]) for t in stats] == [
        ("emb", 3, 3, 44)
    ] * 2
    printed = ok(ps_admin("stats", "--addresses", ",".join(addresses), cwd=tmp_path))
    assert "bf16/bf16" in printed, printed
    create = ("create-table", "--addresses", ",".join(addresses), "--dim", "4", "--json")
    made = ok(ps_admin(*create, "--name", "f16", "storage_dtype=float16", cwd=tmp_path))
    assert json.loads(made)["storage_dtype"] == "float16", made
    refused = ps_admin(*create, "--name", "x", "storage_dtype=int4", cwd=tmp_path)
    assert refused.returncode != 0 and "storage_dtype='int4'" in refused.stderr and "Traceback" not in refused.stderr, (
        refused.stderr
    )
    for s in shards:
        stop_shard(s)


def train_two_tables(ps: PSClient, rng: np.random.Generator) -> dict[str, npt.NDArray[np.float32]]:
    """A float32 and a bfloat16 Adagrad table ("f32", "b16", dim 16), pushed once: their rows."""
    ps.create_table("f32", 16, optimizer="adagrad", lr=0.1)
    ps.create_table("b16", 16, optimizer="adagrad", lr=0.1, storage_dtype="bfloat16")
    push_both(ps, rng)
    return {name: ps.lookup(name, KEYS) for name in ("f32", "b16")}


def push_both(ps: PSClient, rng: np.random.Generator) -> None:
    for name in ("f32", "b16"):
        ps.push(name, KEYS, rng.standard_normal((KEYS.shape[0], 16)).astype(np.float32))


def test_a_serving_shard_holds_8_bit_rows_of_its_training_shard(tmp_path: Path, procs: list[RunningShard]) -> None:
    leader = start_shard(0, 1, tmp_path / "train")
    procs.append(leader)
    serve_args = ("--mode=serve", f"--follow={leader.address}", "--serve-dtype=int8", f"--data-dir={tmp_path / 'sd'}")
    follower = start_shard(0, 1, tmp_path / "serve", *serve_args)
    procs.append(follower)
    with PSClient([leader.address]) as ps:
        trained = train_two_tables(ps, np.random.default_rng(5))
    wait_caught_up(follower.address, leader.address)

    def served() -> dict[str, npt.NDArray[np.float32]]:
        with PSClient([follower.address]) as ps:
            return {name: ps.lookup(name, KEYS) for name in ("f32", "b16")}

    got = served()
    for name, rows in trained.items():
        codes, params = precision.quantize(rows)
        assert np.array_equal(got[name].view(np.uint32), precision.dequantize(codes, params).view(np.uint32)), name
        assert (np.abs(got[name] - rows) <= params[:, :1] / 2 + 1e-6).all(), name
    with PSClient([follower.address]) as ps:
        tables = {t["name"]: t for t in ps.admin.stats()[0]["tables"]}
    assert {(t["storage_dtype"], t["record_bytes"]) for t in tables.values()} == {(4, 16 + 8 + 8)}
    printed = ok(ps_admin("stats", "--addresses", follower.address, cwd=tmp_path)).splitlines()
    assert {line.split()[1]: line.split()[2] for line in printed[2:4]} == {"f32": "i8/-", "b16": "i8/-"}, printed

    stop_shard(follower)  # its data dir keeps the 8-bit rows and their type
    follower = start_shard(0, 1, tmp_path / "serve", *serve_args)
    procs.append(follower)
    wait_caught_up(follower.address, leader.address)
    assert all(np.array_equal(a, got[name]) for name, a in served().items())
    stop_shard(follower)
    stop_shard(leader)


def test_a_checkpoint_is_served_as_8_bit_rows_opened_or_pinned(tmp_path: Path, procs: list[RunningShard]) -> None:
    checkpoints = tmp_path / "train" / "data" / "checkpoints"
    leader = start_shard(0, 1, tmp_path / "train", f"--data-dir={tmp_path / 'train' / 'data'}")
    procs.append(leader)
    rng = np.random.default_rng(6)
    with PSClient([leader.address]) as ps:
        trained = train_two_tables(ps, rng)
        (written,) = ps.admin.checkpoint()
        push_both(ps, rng)  # later rows: a pinned shard must not serve them

    def served_as_8_bit(address: str) -> None:
        with PSClient([address]) as ps:
            got = {name: ps.lookup(name, KEYS) for name in trained}
            assert {t["storage_dtype"] for t in ps.admin.stats()[0]["tables"]} == {4}
        for name, rows in trained.items():
            want = precision.dequantize(*precision.quantize(rows))
            assert np.array_equal(got[name].view(np.uint32), want.view(np.uint32)), name

    opened = start_shard(0, 1, tmp_path / "open", "--mode=serve", f"--data-dir={written['path']}", "--serve-dtype=int8")
    procs.append(opened)
    served_as_8_bit(opened.address)
    stop_shard(opened)

    follow_args = (f"--follow={leader.address}", "--serve-dtype=int8", f"--checkpoint-root={checkpoints}")
    follower = start_shard(0, 1, tmp_path / "serve", "--mode=serve", *follow_args)
    procs.append(follower)
    wait_caught_up(follower.address, leader.address)
    with PSClient([follower.address]) as ps:
        assert ps.admin.serve_from(written["name"])[0]["source"] == "checkpoint"
    served_as_8_bit(follower.address)
    stop_shard(follower)
    stop_shard(leader)


def test_serve_dtype_is_refused_on_a_training_shard(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "ps", "--serve-dtype=int8"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode != 0 and "needs mode=serve" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
