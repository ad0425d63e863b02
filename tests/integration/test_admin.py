"""``ps-admin`` against real shard processes: checkpoint a cluster, reshard it, restore it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

from client import PSClient
from protos import ps_pb2 as pb
from protos.keys import shard_of
from ps.store import RowFormat, Rows, Storage
from ps.table import spec_from_proto
from tests.integration.shards import RunningShard, start_shard, stop_shard

REPO = Path(__file__).resolve().parents[2]
TABLES = {"user": 3000, "item": 1000}  # keys per table
BUDGET_BYTES = 80_000  # per shard: well under the ~170 KB the rows take, so many spill


def assert_bit_equal(mine: Rows, theirs: Rows, what: str) -> None:
    np.testing.assert_array_equal(mine.keys, theirs.keys, err_msg=f"{what}: keys")
    for field in ("values", "state", "last_access", "frequency"):
        a, b = getattr(mine, field), getattr(theirs, field)
        assert a.shape == b.shape, f"{what}: {field} shape {a.shape} != {b.shape}"
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{what}: {field} differs"


def ps_admin(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the installed ``ps-admin`` script (``python -m deploy.admin`` if it is not installed),
    with ``env`` added to an environment without any ``PS_`` variable."""
    script = Path(sys.executable).parent / "ps-admin"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "deploy.admin"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_")} | (env or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [*cmd, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def read_checkpoint(ckpt: Path) -> tuple[dict[str, Rows], int]:
    """Every table of a cluster checkpoint, merged over its shards; checks each row is on
    the shard ``shard_of`` assigns and each shard's identity. Returns (tables, ledgers)."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    n = manifest["num_shards"]
    assert manifest["kind"] == "cluster" and len(manifest["shards"]) == n
    parts: dict[str, list[Rows]] = {}
    ledgers = 0
    for i, name in enumerate(manifest["shards"]):
        shard_manifest = json.loads((ckpt / name / "manifest.json").read_text())
        assert (shard_manifest["shard"], shard_manifest["num_shards"]) == (i, n)
        assert not (ckpt / name / "ps.lock").exists()
        with Storage(ckpt / name, shard=-1, num_shards=0, read_only=True) as st:
            assert st.identity() == (i, n)
            for table, blob in st.specs().items():
                spec = spec_from_proto(pb.TableSpec.FromString(blob))
                rows = st.table(table, spec.row_format)
                ledgers += len(rows.ledgers())
                for rec in rows.scan(chunk=700):
                    assert (shard_of(rec.keys, n) == i).all(), f"{ckpt}/{name}: {table} holds another shard's keys"
                    parts.setdefault(table, []).append(rec)
    tables = {}
    for table, ps in parts.items():
        rows = Rows.concat(ps, RowFormat(ps[0].dim, ps[0].state_width))
        assert np.unique(rows.keys).shape == rows.keys.shape, f"{ckpt}: table {table} has a key on two shards"
        tables[table] = rows[np.argsort(rows.keys, kind="stable")]
        assert manifest["rows"][table] == len(rows), f"{ckpt}: manifest row count of {table}"
    return tables, ledgers


def train(addresses: list[str], rng: np.random.Generator) -> dict[str, npt.NDArray[np.int64]]:
    """Create the tables, look up every key and push to subsets in a few rounds."""
    keys = {t: np.unique(rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)) for t, n in TABLES.items()}
    with PSClient(addresses) as ps:
        ps.create_table("user", 8, optimizer="adagrad", lr=0.1, seed=7)
        ps.create_table("item", 4, optimizer="adam", lr=0.01, seed=8)
        for table, k in keys.items():
            ps.lookup(table, k)
        for _ in range(3):
            for table, k in keys.items():
                some = rng.choice(k, size=k.shape[0] // 2, replace=False)
                dim = 8 if table == "user" else 4
                ps.push(table, some, rng.standard_normal((some.shape[0], dim)).astype(np.float32))
        spilled = sum(t["spilled_rows"] for s in ps.admin.stats() for t in s["tables"])
        assert spilled > 0, "the memory budget should have moved rows to RocksDB"
    return keys


def lookup_all(addresses: list[str], keys: dict[str, npt.NDArray[np.int64]]) -> dict[str, npt.NDArray[np.float32]]:
    with PSClient(addresses) as ps:
        return {t: ps.lookup(t, k) for t, k in keys.items()}


def test_checkpoint_reshard_and_restore(tmp_path: Path) -> None:
    rng = np.random.default_rng(2024)
    shards: list[RunningShard] = []
    try:
        for i in range(2):
            shards.append(
                start_shard(
                    i,
                    2,
                    tmp_path,
                    f"--data-dir={tmp_path / f'data{i}'}",
                    f"--memory-budget-bytes={BUDGET_BYTES}",
                    f"--checkpoint-root={tmp_path / 'ckpts'}",
                )
            )
        addresses = [s.address for s in shards]
        keys = train(addresses, rng)
        before = lookup_all(addresses, keys)

        # The shards write only under their checkpoint root: --out elsewhere is refused by
        # every shard, says which root to configure, and leaves nothing behind.
        outside = ps_admin(
            "checkpoint", "--addresses", ",".join(addresses), "--out", tmp_path / "elsewhere", cwd=tmp_path
        )
        assert outside.returncode == 1, outside.stderr
        assert f"checkpoint root {tmp_path / 'ckpts'}" in outside.stderr and "--checkpoint-root" in outside.stderr
        assert addresses[0] in outside.stderr and addresses[1] in outside.stderr
        assert not (tmp_path / "elsewhere").exists()

        ckpt2 = tmp_path / "ckpts" / "ckpt2"
        out = ok(ps_admin("checkpoint", "--addresses", ",".join(addresses), "--out", ckpt2, cwd=tmp_path))
        assert str(ckpt2) in out and "table user: 3000 rows" in out
        manifest = json.loads((ckpt2 / "manifest.json").read_text())
        assert manifest["shards"] == ["shard-00000-of-00002", "shard-00001-of-00002"]
        assert [t["name"] for t in manifest["tables"]] == ["item", "user"]

        stats = ok(ps_admin("stats", "--addresses", ",".join(addresses), cwd=tmp_path))
        assert "user" in stats and "hit_rate" in stats and "0/2" in stats and "1/2" in stats

        # Errors a person can act on.
        again = ps_admin("checkpoint", "--addresses", ",".join(addresses), "--out", ckpt2, cwd=tmp_path)
        assert again.returncode == 1 and "exists" in again.stderr and "new directory" in again.stderr
        swapped = ps_admin(
            "checkpoint", "--addresses", ",".join(addresses[::-1]), "--out", tmp_path / "x", cwd=tmp_path
        )
        assert swapped.returncode == 1 and addresses[1] in swapped.stderr and "shard order" in swapped.stderr
        assert not (tmp_path / "x").exists()
        partial = ps_admin("checkpoint", "--addresses", addresses[0], "--out", tmp_path / "x", cwd=tmp_path)
        assert partial.returncode == 1 and "of 2 shards, but --addresses lists 1" in partial.stderr
    finally:
        for s in shards:
            stop_shard(s)
    gone = ps_admin("checkpoint", "--addresses", ",".join(addresses), "--out", tmp_path / "x", cwd=tmp_path)
    assert gone.returncode == 1 and "cannot reach" in gone.stderr and addresses[0] in gone.stderr
    assert not (tmp_path / "x").exists()

    original, ledgers = read_checkpoint(ckpt2)
    assert ledgers > 0, "a cluster checkpoint keeps the push ledgers"
    assert {t: r.keys.shape[0] for t, r in original.items()} == {t: k.shape[0] for t, k in keys.items()}
    for table, rows in original.items():
        np.testing.assert_array_equal(rows.keys, keys[table])
        # Lookups answered what the checkpoint holds (sorted keys both ways).
        assert np.array_equal(rows.values.view(np.uint32), before[table].view(np.uint32))
    assert (original["item"].state[:, -1] >= 1).any(), "Adam step counts should have been pushed"

    ckpt3, back2 = tmp_path / "ckpt3", tmp_path / "back2"
    out = ok(
        ps_admin("reshard", "--from", ckpt2, "--to-shards", "3", "--out", ckpt3, "--chunk-rows", "500", cwd=tmp_path)
    )
    assert "push ledgers were not carried over" in out
    ok(ps_admin("reshard", "--from", ckpt3, "--to-shards", "2", "--out", back2, cwd=tmp_path))
    manifest3 = json.loads((ckpt3 / "manifest.json").read_text())
    assert manifest3["num_shards"] == 3 and manifest3["push_ledgers"].startswith("dropped")
    assert manifest3["rows"] == {t: k.shape[0] for t, k in keys.items()}
    assert manifest3["tables"] == manifest["tables"]

    for ckpt in (ckpt3, back2):
        tables, ledgers = read_checkpoint(ckpt)
        assert ledgers == 0, f"{ckpt}: push ledgers must not be carried over"
        assert sorted(tables) == sorted(original)
        for table, rows in original.items():
            assert_bit_equal(rows, tables[table], f"{ckpt.name} table {table}")

    # The per-shard row counts of the 3 -> 2 output are exact.
    shard_rows = json.loads((back2 / "manifest.json").read_text())["shard_rows"]
    for i, counts in enumerate(shard_rows):
        for table, rows in original.items():
            assert counts[table] == int((shard_of(rows.keys, 2) == i).sum())

    # A 3-shard cluster starts from the resharded checkpoint and serves the same rows.
    restored: list[RunningShard] = []
    try:
        for j in range(3):
            restored.append(
                start_shard(
                    j,
                    3,
                    tmp_path / "r3",
                    f"--data-dir={tmp_path / f'new{j}'}",
                    f"--restore-from={ckpt3 / f'shard-{j:05d}-of-00003'}",
                )
            )
        after = lookup_all([s.address for s in restored], keys)
        for table in keys:
            assert np.array_equal(after[table].view(np.uint32), before[table].view(np.uint32)), table
    finally:
        for s in restored:
            stop_shard(s)


def test_row_counts_from_rocksdb_estimates_are_labelled(tmp_path: Path) -> None:
    # A shard counts the rows it spills exactly; reopened from disk, it starts from RocksDB's
    # estimate of the rows there. A checkpoint's counts say which they are, as Stats does.
    args = (f"--data-dir={tmp_path / 'data'}", f"--memory-budget-bytes={BUDGET_BYTES}")
    keys = np.arange(3000, dtype=np.int64)
    shard = start_shard(0, 1, tmp_path, *args)
    try:
        with PSClient([shard.address]) as ps:
            ps.create_table("user", 8)
            ps.lookup("user", keys)  # spills under the budget: counted exactly
        out = ok(ps_admin("checkpoint", "--addresses", shard.address, "--out", "exact", cwd=tmp_path))
    finally:
        stop_shard(shard)
    assert "table user: 3000 rows (by shard: 3000)" in out and "~" not in out, out
    part = tmp_path / "data" / "checkpoints" / "exact" / "shard-00000-of-00001"
    exact = json.loads((part / "manifest.json").read_text())
    assert exact["rows"] == {"user": 3000} and exact["rows_estimated"] == {"user": False}

    shard = start_shard(0, 1, tmp_path, *args)  # reopened: the rows on disk are an estimate now
    try:
        out = ok(ps_admin("checkpoint", "--addresses", shard.address, "--out", "after", cwd=tmp_path))
        reply = json.loads(
            ok(ps_admin("--json", "checkpoint", "--addresses", shard.address, "--out", "j", cwd=tmp_path))
        )
    finally:
        stop_shard(shard)
    part = tmp_path / "data" / "checkpoints" / "after" / "shard-00000-of-00001"
    after = json.loads((part / "manifest.json").read_text())
    assert after["rows_estimated"] == {"user": True}, after
    assert reply["rows_estimated"] == {"user": True} and reply["shard_rows_estimated"] == [{"user": True}]
    rows = after["rows"]["user"]
    assert f"table user: ~{rows} rows (by shard: ~{rows})" in out, out
    assert "~ about: RocksDB's estimate" in out, out

    listed = ok(ps_admin("list", "--root", tmp_path / "data" / "checkpoints", cwd=tmp_path))
    lines = {line.split(":")[0]: line for line in listed.splitlines()}
    assert lines["exact"].endswith(", 3000 rows") and lines["after"].endswith(f", ~{rows} rows"), listed
    assert "~ about: RocksDB's estimate" in listed, listed
    found = {c["name"]: c for c in json.loads(ok(ps_admin("--json", "list", "--root", part.parents[1], cwd=tmp_path)))}
    assert [p["rows_estimated"] for p in found["after"]["parts"]] == [True]
    assert [p["rows_estimated"] for p in found["exact"]["parts"]] == [False]


def test_bad_arguments_and_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    missing = ps_admin(
        "reshard", "--from", tmp_path / "empty", "--to-shards", "2", "--out", tmp_path / "o", cwd=tmp_path
    )
    assert missing.returncode == 1 and "no manifest.json" in missing.stderr and "incomplete" in missing.stderr
    assert not (tmp_path / "o").exists()

    zero = ps_admin("reshard", "--from", tmp_path / "empty", "--to-shards", "0", "--out", tmp_path / "o", cwd=tmp_path)
    assert zero.returncode == 2 and "--to-shards" in zero.stderr and ">= 1" in zero.stderr

    bad_address = ps_admin("checkpoint", "--addresses", "localhost", "--out", tmp_path / "o", cwd=tmp_path)
    assert bad_address.returncode == 2 and "HOST:PORT" in bad_address.stderr

    one_shard = tmp_path / "one"
    one_shard.mkdir()
    (one_shard / "manifest.json").write_text(json.dumps({"format": 1, "shard": 0, "num_shards": 1}))
    wrong = ps_admin("reshard", "--from", one_shard, "--to-shards", "2", "--out", tmp_path / "o", cwd=tmp_path)
    assert wrong.returncode == 1 and "one shard" in wrong.stderr

    unreachable = ps_admin("checkpoint", "--addresses", "127.0.0.1:1", "--out", tmp_path / "empty", cwd=tmp_path)
    assert unreachable.returncode == 1 and "cannot reach" in unreachable.stderr


def test_tables_create_table_health_and_json_with_a_token(tmp_path: Path) -> None:
    admin_token, read_token = "admin-token-0123456789", "read-token-0123456789"
    (tmp_path / "tokens").write_text(f"admin {admin_token}\nread {read_token}\n")
    (tmp_path / "admin.token").write_text(admin_token + "\n")
    (tmp_path / "read.token").write_text(read_token + "\n")
    shards = [start_shard(i, 2, tmp_path, f"--auth-token-file={tmp_path / 'tokens'}") for i in range(2)]
    addresses = ",".join(s.address for s in shards)
    try:
        as_admin = ("--token-file", tmp_path / "admin.token")
        created = json.loads(
            ok(
                ps_admin(
                    "--json",
                    *as_admin,
                    "create-table",
                    "--addresses",
                    addresses,
                    "--name",
                    "items",
                    "--dim",
                    "8",
                    "optimizer=adagrad",
                    "lr=0.05",
                    cwd=tmp_path,
                )
            )
        )
        assert (created["name"], created["dim"], created["optimizer"]) == ("items", 8, "adagrad")
        denied = ps_admin(
            "--token-file",
            tmp_path / "read.token",
            "create-table",
            "--addresses",
            addresses,
            "--name",
            "other",
            "--dim",
            "4",
            cwd=tmp_path,
        )
        assert (
            denied.returncode == 1
            and denied.stderr.startswith("ps-admin create-table: PERMISSION_DENIED: ")  # a script can tell
            and "CreateTable refused: needs a write token, this one is read" in denied.stderr
            and read_token not in denied.stderr
        )
        no_token = ps_admin("tables", "--addresses", addresses, cwd=tmp_path)
        assert no_token.returncode == 1 and "no bearer token" in no_token.stderr
        assert no_token.stderr.startswith("ps-admin tables: UNAUTHENTICATED: "), no_token.stderr
        assert "items: dim 8, optimizer adagrad" in ok(
            ps_admin(*as_admin, "tables", "--addresses", addresses, cwd=tmp_path)
        )
        tables = json.loads(ok(ps_admin("--json", *as_admin, "tables", "--addresses", addresses, cwd=tmp_path)))
        assert [t["name"] for t in tables] == ["items"]
        stats = json.loads(ok(ps_admin("--json", *as_admin, "stats", "--addresses", addresses, cwd=tmp_path)))
        assert [s["shard"] for s in stats] == [0, 1] and stats[0]["tables"][0]["name"] == "items"
        health = json.loads(ok(ps_admin("--json", "health", "--addresses", addresses, cwd=tmp_path)))  # no token
        assert all(h["serving"] for h in health) and "ps.v1.ParameterServer.Writes" in health[0]["services"]
        # A dns: entry is every address its name resolves to, each checked; one that does not
        # resolve is a line saying so.
        named = f"dns:{shards[0].address}+dns:nowhere.invalid:1,{shards[1].address}"
        checked = json.loads(ps_admin("--json", "health", "--addresses", named, cwd=tmp_path).stdout)
        assert {h["address"]: h["serving"] for h in checked} == {
            "dns:nowhere.invalid:1": False,
            shards[0].address: True,
            shards[1].address: True,
        }
        assert "does not resolve" in checked[0]["services"]["(server)"]
        bad = ps_admin("create-table", "--addresses", addresses, "--name", "x", "--dim", "4", "lr=fast", cwd=tmp_path)
        assert bad.returncode == 2 and "lr takes a number" in bad.stderr
    finally:
        stop_shard(shards[1])
    down = ps_admin("health", "--addresses", addresses, "--timeout-s", "1", cwd=tmp_path)
    assert down.returncode == 1 and "NOT SERVING" in down.stdout
    stop_shard(shards[0])


def test_checkpoint_list_serve_from_and_unpin_with_the_cli(tmp_path: Path) -> None:
    """The documented rollback flow, with the console script only and default checkpoint roots."""
    train_shards = [start_shard(i, 2, tmp_path / "t", f"--data-dir={tmp_path / f'train{i}'}") for i in range(2)]
    train = [s.address for s in train_shards]
    roots = [tmp_path / f"train{i}" / "checkpoints" for i in range(2)]  # the default: one per shard
    serve_shards = [
        start_shard(i, 2, tmp_path / "s", "--mode=serve", f"--follow={train[i]}", f"--checkpoint-root={roots[i]}")
        for i in range(2)
    ]
    serve = [s.address for s in serve_shards]
    env = {"PS_ADDRESSES": ",".join(train), "SERVING_ADDRESSES": ",".join(serve)}
    keys = np.arange(200)
    work = tmp_path / "elsewhere"  # ps-admin's working directory: no checkpoint lands here
    work.mkdir()
    try:
        with PSClient(train) as trainer, PSClient(serve) as server:
            trainer.create_table("item", 4, optimizer="sgd", lr=1.0)
            trainer.push("item", keys, np.ones((200, 4), np.float32))
            v1 = trainer.lookup("item", keys)

            out = ok(ps_admin("checkpoint", cwd=work, env=env))  # --addresses from $PS_ADDRESSES
            name = out.split()[1]
            assert name == "000001" and "of 2 shards written" in out, out
            assert f"--checkpoint {name}" in out and "different roots" in out
            for i, root in enumerate(roots):
                assert (root / name / f"shard-{i:05d}-of-00002" / "manifest.json").is_file()
            named = ok(ps_admin("checkpoint", "--out", "nightly", cwd=work, env=env))
            assert named.startswith("checkpoint nightly of 2 shards") and not (work / "nightly").exists()
            assert (roots[1] / "nightly" / "shard-00001-of-00002").is_dir()
            python_name = trainer.admin.checkpoint()[0]["name"]  # Python names them the same way
            assert python_name == "000002"

            trainer.push("item", keys, np.ones((200, 4), np.float32))  # a bad update, say
            latest = trainer.lookup("item", keys)
            assert not np.array_equal(v1, latest)

            listed = ok(ps_admin("list", "--root", roots[0], "--root", roots[1], cwd=work))
            assert f"{name}: shards 0,1 of 2 (all shards)" in listed and "nightly: shards 0,1 of 2" in listed
            assert "000002: shards 0,1 of 2 (all shards)" in listed

            for which in (name, "1", "nightly", python_name):
                pinned = ok(ps_admin("serve-from", "--checkpoint", which, cwd=work, env=env))
                assert pinned.count("serving ") == 2 and str(roots[0]) in pinned, pinned
                np.testing.assert_array_equal(server.lookup("item", keys), v1)
            stats = ok(ps_admin("stats", "--addresses", ",".join(serve), cwd=work)).splitlines()
            assert sum(f"pinned to {roots[0]}" in line for line in stats) == 1, stats
            assert stats[0].startswith("shard  table  stored  "), stats  # not padded to the checkpoint path's width
            missing = ps_admin("serve-from", "--checkpoint", "7", cwd=work, env=env)
            assert missing.returncode == 1 and "holds no checkpoint" in missing.stderr and name in missing.stderr

            ok(ps_admin("unpin", cwd=work, env=env))
            deadline = time.monotonic() + 30
            while not np.array_equal(server.lookup("item", keys), latest):
                assert time.monotonic() < deadline, "the serving shards did not follow the live rows again"
                time.sleep(0.05)
    finally:
        for s in serve_shards + train_shards:
            stop_shard(s)


def test_serve_from_with_one_checkpoint_root_for_training_and_serving_shards(tmp_path: Path) -> None:
    """deploy/k8s's layout: each training shard's rows on a data volume of its own, one
    checkpoint root on a volume every shard mounts (ps-checkpoints), serving shards with a
    data dir of their own and that same root."""
    shared = tmp_path / "ps-checkpoints" / "checkpoints"
    root = f"--checkpoint-root={shared}"
    train_shards = [
        start_shard(i, 2, tmp_path / "t", f"--data-dir={tmp_path / f'data{i}' / 'data'}", root) for i in range(2)
    ]
    serve_shards = [
        start_shard(
            i,
            2,
            tmp_path / "s",
            "--mode=serve",
            f"--follow={train_shards[i].address}",
            f"--data-dir={tmp_path / f'serve{i}'}",
            root,
        )
        for i in range(2)
    ]
    train, serve = [s.address for s in train_shards], [s.address for s in serve_shards]
    env = {"PS_ADDRESSES": ",".join(train), "SERVING_ADDRESSES": ",".join(serve)}
    keys = np.arange(200)
    try:
        with PSClient(train) as trainer, PSClient(serve) as server:
            trainer.create_table("item", 4, optimizer="sgd", lr=1.0)
            trainer.push("item", keys, np.ones((200, 4), np.float32))
            v1 = trainer.lookup("item", keys)
            out = ok(ps_admin("checkpoint", "--out", "good", cwd=tmp_path, env=env))
            assert f"cluster manifest: {shared / 'good' / 'manifest.json'}" in out, out  # one directory
            listed = ok(ps_admin("list", "--root", shared, cwd=tmp_path))
            assert listed.startswith("good: shards 0,1 of 2 (all shards)"), listed
            trainer.push("item", keys, np.ones((200, 4), np.float32))  # a bad update
            pinned = ok(ps_admin("serve-from", "--checkpoint", "good", cwd=tmp_path, env=env))
            assert pinned.count(f"serving {shared / 'good'}") == 2, pinned
            np.testing.assert_array_equal(server.lookup("item", keys), v1)
            ok(ps_admin("unpin", cwd=tmp_path, env=env))
    finally:
        for s in serve_shards + train_shards:
            stop_shard(s)
    assert sorted(p.name for p in shared.iterdir()) == ["good"], "the serving shards wrote nothing there"


def test_help_lists_every_command_with_one_line_each(tmp_path: Path) -> None:
    text = ok(ps_admin("--help", cwd=tmp_path))
    commands = ["checkpoint", "list", "reshard", "stats", "serve-from", "unpin", "tables", "create-table", "health"]
    for command in commands:
        assert any(line.split()[:1] == [command] and len(line.split()) > 1 for line in text.splitlines()), (
            command,
            text,
        )
    words = " ".join(text.split())
    assert "$PS_ADDRESSES" in words and "$SERVING_ADDRESSES" in words
    unset = ps_admin("stats", cwd=tmp_path)  # no --addresses and no $PS_ADDRESSES
    assert unset.returncode == 2 and "--addresses" in unset.stderr


def test_a_checkpoint_refused_names_the_parts_written_and_only_those(tmp_path: Path) -> None:
    # Shard 0 keeps a data dir (and so a checkpoint root), shard 1 has none: it refuses.
    mixed = [start_shard(0, 2, tmp_path / "a", f"--data-dir={tmp_path / 'd0'}"), start_shard(1, 2, tmp_path / "a")]
    bare = [start_shard(i, 2, tmp_path / "b") for i in range(2)]
    try:
        part = ps_admin("checkpoint", "--addresses", ",".join(s.address for s in mixed), "--out", "v1", cwd=tmp_path)
        assert part.returncode == 1 and "Traceback" not in part.stderr, part.stderr
        assert "the parts shards 0 wrote under 'v1' make an incomplete checkpoint" in part.stderr, part.stderr
        assert (tmp_path / "d0" / "checkpoints" / "v1" / "shard-00000-of-00002").is_dir()
        none = ps_admin("checkpoint", "--addresses", ",".join(s.address for s in bare), "--out", "v1", cwd=tmp_path)
        assert none.returncode == 1 and "checkpoint root" in none.stderr, none.stderr
        assert "incomplete" not in none.stderr, none.stderr  # nothing was written: nothing to clean up
    finally:
        for s in mixed + bare:
            stop_shard(s)


def test_ps_admin_waits_a_little_for_a_shard_that_is_starting(tmp_path: Path) -> None:
    shard = start_shard(0, 1, tmp_path / "s", f"--data-dir={tmp_path / 'd'}")
    address = shard.address
    stop_shard(shard)
    restarted: list[RunningShard] = []
    done = threading.Event()

    def restart() -> None:  # the thread that starts a shard lives as long as it (its death stops the shard)
        time.sleep(1.5)
        restarted.append(start_shard(0, 1, tmp_path / "s", f"--data-dir={tmp_path / 'd'}", listen=address))
        done.wait(120)

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        stats = ps_admin("stats", "--addresses", address, cwd=tmp_path)  # asked while the shard is down
        assert stats.returncode == 0 and "0/1" in stats.stdout, stats.stderr
    finally:
        while thread.is_alive() and not restarted:
            time.sleep(0.1)
        for s in restarted:
            stop_shard(s)
        done.set()
        thread.join()
    gone = ps_admin("stats", "--addresses", address, "--timeout-s", "1", cwd=tmp_path)
    assert gone.returncode == 1 and "cannot reach the shard" in gone.stderr and "--timeout-s" in gone.stderr
