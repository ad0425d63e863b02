"""Erasing rows (``AdminClient.erase``, the ``Erase`` RPC) on real shard processes: a training
shard with a data dir and a serving shard following it.

* Erased keys are new again on the training shard (their initial rows), gone from the
  serving shard (its default, zeros), and the rows kept are untouched.
* The erased rows' bytes are in no file of the training shard's data dir once it compacted,
  nor in the checkpoint taken before the erase: the files are read directly, for the exact
  bytes of each erased row. Every place, asked, says it holds none of the keys, and a shard
  restored from that checkpoint has none of them.
* A push applied before the erase and sent again is still a duplicate: it does not bring
  the row back.
* A serving shard with a data dir keeps the deleted rows' bytes in its files until the
  erase reaches it too (``erase_served``), which compacts them away.
* A training shard killed half way through an erase (``kill -9``) completes it when it
  starts again; ``ps-admin erase`` says the erase is incomplete meanwhile, and run again
  writes a receipt of every place absent.
* A serving shard pinned to a checkpoint (``serve-from``) serves it as the erase rewrote
  it, and the followed rows it kept aside lose the keys too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from client import ClientConfig, PreconditionError, PSClient
from deploy.erase import erase as erase_cluster
from protos.keys import hash_feature
from tests.integration.shards import RunningShard, start_shard
from worker.schema import feature_seed

DIM = 8


def files_holding(root: Path, needles: list[bytes]) -> dict[str, int]:
    """Files under ``root`` (its checkpoints too) holding any of ``needles``, with how many."""
    found = {}
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            n = sum(needle in data for needle in needles)
            if n:
                found[str(path.relative_to(root))] = n
    return found


def test_erased_rows_are_gone_from_ram_disk_and_serving_and_new_again(
    tmp_path: Path, procs: list[RunningShard]
) -> None:
    train = start_shard(0, 1, tmp_path, "--data-dir=train", "--durability=every-push")
    procs.append(train)
    serve = start_shard(0, 1, tmp_path / "serve", "--mode=serve", f"--follow={train.address}", "--data-dir=rows")
    procs.append(serve)
    keys = np.arange(1, 2001, dtype=np.int64)
    erased = keys[::2]  # the odd keys are kept
    rng = np.random.default_rng(0)
    with PSClient([train.address], client_id="trainer") as client:
        client.create_table("emb", DIM, optimizer="sgd", lr=1.0)
        client.create_table("fresh", DIM, optimizer="sgd", lr=1.0)  # same seed: the same initial rows
        grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
        client.push("emb", keys, grads, seq=7)
        before = client.lookup("emb", keys)
        needles = [before[i].tobytes() for i in range(0, len(keys), 2)]
        client.admin.checkpoint("before")  # a checkpoint holding the rows to erase
        assert files_holding(tmp_path / "train" / "checkpoints", needles)
        deadline = time.monotonic() + 30
        while not files_holding(tmp_path / "serve" / "rows", needles[:1]):  # the follower wrote them
            assert time.monotonic() < deadline, "the serving shard did not write its rows in 30 s"
            time.sleep(0.2)
        answers = client.admin.erase("emb", erased, compact=True, checkpoints=True)
        (answer,) = answers
        assert (answer["erased_ram"] + answer["erased_disk"], answer["compacted"]) == (len(erased), True)
        assert [(Path(c["path"]).parent.name, c["rows"]) for c in answer["checkpoints"]] == [("before", len(erased))]
        version = answer["version"]

        # The serving shard deletes them when it applies the erase (before any training lookup
        # makes them new again).
        with PSClient([serve.address]) as reader:
            deadline = time.monotonic() + 30
            while reader.admin.stats()[0]["follow"]["applied_version"] < version:
                assert time.monotonic() < deadline, "the serving shard did not apply the erase in 30 s"
                time.sleep(0.05)
            served = reader.lookup("emb", keys)
        assert np.array_equal(served[1::2], before[1::2])
        assert not served[::2].any(), "the serving shard still serves erased rows"
        # Its data dir keeps the deleted rows' bytes in its files until it compacts.
        assert files_holding(tmp_path / "serve" / "rows", needles)
        with PSClient([serve.address]) as reader:
            ((on_serving,),) = [
                [(f["erased_ram"] + f["erased_disk"], f["compacted"]) for f in reader.admin.erase_served("emb", erased)]
            ]
        assert on_serving == (0, True)  # the stream had deleted them; now the bytes are gone too
        assert files_holding(tmp_path / "serve" / "rows", needles) == {}
        assert files_holding(tmp_path / "serve" / "rows", [before[1].tobytes()])

        # Every place says it holds none of them: the training shard (RAM, disk, checkpoint)
        # and the serving shard.
        found = client.admin.find_erased("emb", erased)
        assert [(f["erased_ram"], f["erased_disk"], [c["rows"] for c in f["checkpoints"]]) for f in found] == [
            (0, 0, [0])
        ]
        with PSClient([serve.address]) as reader:
            ((where,),) = [
                [(f["erased_ram"], f["erased_disk"], f["verified"]) for f in reader.admin.find_erased("emb", erased)]
            ]
        assert where == (0, 0, True)

        # A push applied before the erase, sent again (same client, same seq): still a duplicate.
        again = client.push("emb", keys, grads, seq=7)
        assert again.duplicates == 1 and again.rows_updated == 0
        after = client.lookup("emb", keys)
        initial = client.lookup("fresh", erased)
    assert np.array_equal(after[1::2], before[1::2]), "a kept row changed"
    assert np.array_equal(after[::2], initial), "an erased row is not its initial row"
    assert not np.array_equal(before[::2], initial)

    # The data dir's files (RocksDB's SSTs, WAL, manifests; the checkpoint's too) hold none of
    # the erased rows' bytes; the kept rows' bytes are there (the search finds what it looks for).
    assert files_holding(tmp_path / "train", needles) == {}
    assert files_holding(tmp_path / "train", [before[1].tobytes()])

    # A shard restored from the checkpoint taken before the erase does not bring them back.
    (part,) = answer["checkpoints"]
    restored = start_shard(0, 1, tmp_path / "restored", "--data-dir=data", f"--restore-from={part['path']}")
    procs.append(restored)
    with PSClient([restored.address]) as client:
        ((held,),) = [[(f["erased_ram"], f["erased_disk"]) for f in client.admin.find_erased("emb", erased)]]
        assert held == (0, 0), "an erased row came back from the checkpoint"
        assert np.array_equal(client.lookup("emb", keys[1::2]), before[1::2])


def ps_admin(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.admin", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_ps_admin_erase_writes_a_receipt_verify_checks_it_and_a_write_token_may_not(
    tmp_path: Path, procs: list[RunningShard]
) -> None:
    admin, write = "admin-token-0123456789", "write-token-0123456789"
    (tmp_path / "tokens").write_text(f"admin {admin}\nwrite {write}\n")
    (tmp_path / "admin.token").write_text(admin + "\n")
    (tmp_path / "write.token").write_text(write + "\n")
    auth = f"--auth-token-file={tmp_path / 'tokens'}"
    train = [start_shard(i, 2, tmp_path, "--data-dir=train-{shard}", auth) for i in range(2)]
    procs.extend(train)
    addresses = ",".join(s.address for s in train)
    client_token = f"--client-token-file={tmp_path / 'admin.token'}"
    serve = [
        start_shard(i, 2, tmp_path / "serve", "--mode=serve", f"--follow={train[i].address}", auth, client_token)
        for i in range(2)
    ]
    procs.extend(serve)
    serving = ",".join(s.address for s in serve)
    user = hash_feature("u42", feature_seed("user"))  # as training hashes user "u42"
    keys = np.concatenate([np.arange(1, 301, dtype=np.int64), [user]])
    with PSClient([s.address for s in train], ClientConfig(token=admin)) as client:
        client.create_table("user", DIM)
        client.lookup("user", keys)
        client.admin.checkpoint("nightly")
    (tmp_path / "keys.txt").write_text("\n".join(str(k) for k in range(1, 101)) + "\n")
    (tmp_path / "values.txt").write_text("u42\n")

    refused = ps_admin(
        "--token-file",
        tmp_path / "write.token",
        "erase",
        "--addresses",
        addresses,
        "--table",
        "user",
        "--keys",
        "keys.txt",
        cwd=tmp_path,
    )
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr, refused.stderr

    as_admin = ("--token-file", tmp_path / "admin.token")
    done = ps_admin(
        *as_admin,
        "erase",
        "--addresses",
        addresses,
        "--serving",
        serving,
        "--table",
        "user",
        "--keys",
        "keys.txt",
        "--receipt",
        "r1.json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    receipt = json.loads((tmp_path / "r1.json").read_text())
    assert receipt["keys"] == 100 and receipt["absent_everywhere"] is True
    assert sum(t["rows_in_ram"] + t["rows_on_disk"] for t in receipt["training"]) == 100
    rewritten = [c for t in receipt["training"] for c in t["checkpoints_rewritten"]]
    assert sorted(Path(c["path"]).parent.name for c in rewritten) == ["nightly", "nightly"]
    assert sum(c["rows"] for c in rewritten) == 100
    # Places: each training shard (RAM and disk), its checkpoint part, each serving shard.
    assert len(receipt["places"]) == 6 and not any(p["present"] for p in receipt["places"])

    by_value = ps_admin(
        *as_admin,
        "erase",
        "--addresses",
        addresses,
        "--serving",
        serving,
        "--table",
        "user",
        "--values",
        "values.txt",
        "--feature",
        "user",
        "--receipt",
        "r2.json",
        cwd=tmp_path,
    )
    assert by_value.returncode == 0, by_value.stderr
    assert json.loads((tmp_path / "r2.json").read_text())["erased_keys"] == [user]

    verified = ps_admin(
        *as_admin, "erase", "--verify", "r1.json", "--addresses", addresses, "--serving", serving, cwd=tmp_path
    )
    assert verified.returncode == 0 and verified.stdout.count("absent") == 6, verified.stdout

    # A key of the receipt made again (a lookup makes an erased key new): verify says where.
    with PSClient([s.address for s in train], ClientConfig(token=admin)) as client:
        client.lookup("user", np.array([1], np.int64))
    again = ps_admin(*as_admin, "erase", "--verify", "r1.json", "--addresses", addresses, cwd=tmp_path)
    assert again.returncode == 1 and again.stdout.count("PRESENT") == 1, again.stdout

    bad = ps_admin(
        *as_admin, "erase", "--addresses", addresses, "--table", "user", "--values", "values.txt", cwd=tmp_path
    )
    assert bad.returncode == 1 and "--feature" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "bad.txt").write_text("12\nnot-a-key\n")
    bad = ps_admin(*as_admin, "erase", "--addresses", addresses, "--table", "user", "--keys", "bad.txt", cwd=tmp_path)
    assert bad.returncode == 1 and "bad.txt:2" in bad.stderr and "Traceback" not in bad.stderr


def test_a_shard_killed_mid_erase_completes_it_when_it_starts_again(tmp_path: Path, procs: list[RunningShard]) -> None:
    args = ("--data-dir=train", "--durability=every-push")
    train = start_shard(0, 1, tmp_path, *args)
    procs.append(train)
    keys = np.arange(1, 120_001, dtype=np.int64)
    erased = keys[::4]
    with PSClient([train.address]) as client:
        client.create_table("emb", 32)
        rows = client.lookup("emb", keys)  # every row made, and written (every-push)
        for name in ("mon", "tue", "wed"):
            client.admin.checkpoint(name)
    needles = [rows[i].tobytes() for i in range(0, 4000, 20)]  # 200 of the erased rows, whole
    (tmp_path / "keys.txt").write_text("\n".join(map(str, erased)) + "\n")
    assert len(files_holding(tmp_path / "train", needles)) >= 4  # the data dir and three checkpoints

    def command(address: str) -> list[str]:
        erase = ("erase", "--addresses", address, "--table", "emb", "--keys", "keys.txt", "--receipt", "r.json")
        return [sys.executable, "-m", "deploy.admin", *erase]

    admin = subprocess.Popen(
        command(train.address),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while "gone from RAM and the data dir" not in train.log_tail(100_000):  # journaled, and under way
        assert admin.poll() is None and time.monotonic() < deadline, train.log_tail()
        time.sleep(0.002)
    train.proc.kill()  # kill -9, while it rewrites the checkpoints
    train.proc.wait()
    _, stderr = admin.communicate(timeout=60)
    assert admin.returncode == 1 and "INCOMPLETE" in stderr and "Traceback" not in stderr, stderr
    assert not (tmp_path / "r.json").exists()

    again = start_shard(0, 1, tmp_path, *args)
    procs.append(again)
    assert "completed an erase that a stop cut short" in again.log_tail(100_000), again.log_tail()
    assert files_holding(tmp_path / "train", needles) == {}  # RAM, data dir, checkpoints: all before it serves
    done = subprocess.run(
        command(again.address),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    receipt = json.loads((tmp_path / "r.json").read_text())
    assert receipt["absent_everywhere"] and len(receipt["places"]) == 4  # RAM and data dir, 3 checkpoints
    with PSClient([again.address]) as client:
        kept = client.lookup("emb", keys[1::4])
    assert np.array_equal(kept, rows[1::4])


def test_a_serving_shard_pinned_to_a_checkpoint_serves_the_rewritten_checkpoint(
    tmp_path: Path, procs: list[RunningShard]
) -> None:
    train = start_shard(0, 1, tmp_path, "--data-dir=train")
    procs.append(train)
    root = tmp_path / "train" / "checkpoints"
    serve = start_shard(
        0, 1, tmp_path / "serve", "--mode=serve", f"--follow={train.address}", f"--checkpoint-root={root}"
    )
    procs.append(serve)
    keys = np.arange(1, 501, dtype=np.int64)
    erased = keys[::2]
    with PSClient([train.address]) as client, PSClient([serve.address]) as reader:
        client.create_table("emb", DIM)
        rows = client.lookup("emb", keys)
        (written,) = client.admin.checkpoint("known-good")
        assert reader.admin.serve_from(written["name"])[0]["source"] == "checkpoint"
        np.testing.assert_array_equal(reader.lookup("emb", keys), rows)
        with pytest.raises(PreconditionError, match="read-only"):  # an erase sent to serving shards by mistake
            reader.admin.erase("emb", erased)
        # What ps-admin erase --serving does: it does not wait for a pinned shard to apply the
        # erase (it follows nothing meanwhile), and has it load the rewritten checkpoint again.
        receipt = erase_cluster([train.address], "emb", erased, serving=[serve.address], timeout_s=60)
        assert receipt["absent_everywhere"], receipt["places"]
        ((answer,), (served,)) = receipt["training"], receipt["serving_erased"]
        assert [c["rows"] for c in answer["checkpoints_rewritten"]] == [len(erased)]
        assert served["rows"] == len(erased)  # its followed rows, kept aside
        pinned = reader.lookup("emb", keys)
        assert reader.admin.stats()[0]["follow"]["source"] == "checkpoint"
        assert not pinned[::2].any(), "the pinned checkpoint still serves erased rows"
        np.testing.assert_array_equal(pinned[1::2], rows[1::2])
        ((found,),) = [[(f["erased_ram"], f["erased_disk"]) for f in reader.admin.find_erased("emb", erased)]]
        assert found == (0, 0)

        reader.admin.serve_from(None)  # following again: the rows it kept aside lack them too
        deadline = time.monotonic() + 30
        while reader.admin.stats()[0]["follow"]["applied_version"] < answer["version"]:
            assert time.monotonic() < deadline, "the serving shard did not catch up in 30 s"
            time.sleep(0.05)
        followed = reader.lookup("emb", keys)
        assert not followed[::2].any()
        np.testing.assert_array_equal(followed[1::2], rows[1::2])
