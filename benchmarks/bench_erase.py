"""What an erase costs, and a check that it leaves nothing behind: ``ps-admin erase`` of 100K
keys out of a 10M-row table, on 2 training shards (data dirs) with 2 serving replicas
following them (their own data dirs) and 3 checkpoints.

The cluster: two ``ps-server`` training shards, each with a data dir, holding a dim-16 SGD
table of 10M rows (made by lookups: every row its initial value, each different), three
cluster checkpoints of it, and one ``--mode serve --follow`` replica per shard with a data
dir, caught up. Then ``deploy.erase.erase`` (what ``ps-admin erase`` runs) of 100K keys
drawn from the 10M: RAM, data dirs (compacted), every checkpoint part (rewritten and
compacted), the serving replicas (deleted by the stream, then compacted); the time is
reported per step.

Checked after, three ways: ``ps-admin erase --verify`` (``deploy.erase.verify``) asks every
place; every RocksDB (each data dir and checkpoint part, opened read-only here) is read
for the erased keys; and every file under the cluster's directories is searched for the
bytes of 40 of the erased rows (200 with ``--quick``; and, so the search is known to find
what is there, of a kept row).

The floor beside it, measured in the same run: the bytes an erase must rewrite (every
file of the data dirs and checkpoint parts that held the rows, compaction writes them
anew) copied once at this disk's speed (``shutil.copyfile`` of one data dir's files).

Usage: ``python benchmarks/bench_erase.py [--quick]`` (quick: 1M rows, 10K keys); prints a
table and writes ``benchmarks/results/erase.json`` and ``erase.png``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from a checkout

from client import PSClient  # noqa: E402
from deploy.erase import erase, verify  # noqa: E402
from deploy.operations import checkpoint_cluster  # noqa: E402
from protos import ps_pb2 as pb  # noqa: E402
from ps.store import Storage  # noqa: E402
from ps.table import spec_from_proto  # noqa: E402

TABLE, DIM, SEED, CHUNK = "users", 16, 7, 262_144
RESULTS = REPO / "benchmarks" / "results"


def start(tmp: Path, name: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    port_file = tmp / f"{name}.port"
    cmd = [sys.executable, "-m", "ps", "--listen=127.0.0.1:0", f"--port-file={port_file}", "--grace-s=5", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=(tmp / f"{name}.log").open("wb"))
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ps-server ({name}) did not start:\n{(tmp / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def stores(tmp: Path) -> list[Path]:
    """Every RocksDB of the cluster: data dirs (training and serving) and checkpoint parts."""
    return sorted(p.parent for p in tmp.rglob("db") if p.is_dir() and (p / "CURRENT").exists())


def rows_in_stores(tmp: Path, keys: np.ndarray) -> dict[str, int]:
    """Per RocksDB, the rows of ``keys`` it holds, read directly (read-only)."""
    found = {}
    for path in stores(tmp):
        with Storage(path, shard=-1, num_shards=0, read_only=True) as st:
            blob = st.specs().get(TABLE)
            if blob is None:
                continue
            rows = st.table(TABLE, spec_from_proto(pb.TableSpec.FromString(blob)).row_format)
            hit, _ = rows.get(keys)
            found[str(path.relative_to(tmp))] = int(hit.sum())
    return found


def files_holding(tmp: Path, needles: list[bytes]) -> dict[str, int]:
    """Files under ``tmp`` whose bytes hold any of ``needles``, with how many."""
    found = {}
    for path in tmp.rglob("*"):
        if not path.is_file() or path.stat().st_size == 0:
            continue
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            n = sum(data.find(needle) >= 0 for needle in needles)
        if n:
            found[str(path.relative_to(tmp))] = n
    return found


def copy_rate(src: Path, dst: Path) -> float:
    """Bytes a second of copying every file of ``src`` (read and write, synced)."""
    dst.mkdir()
    total, t0 = 0, time.perf_counter()
    for path in src.rglob("*.sst"):
        target = dst / path.name
        shutil.copyfile(path, target)
        with target.open("rb+") as f:
            os.fsync(f.fileno())
        total += path.stat().st_size
    seconds = time.perf_counter() - t0
    shutil.rmtree(dst)
    return total / seconds if seconds else float("inf")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(tmp: Path, n_rows: int, n_erase: int, n_needles: int) -> dict[str, Any]:
    rng = np.random.default_rng(SEED)
    keys = np.unique(rng.integers(-(1 << 62), 1 << 62, size=int(n_rows * 1.001), dtype=np.int64))[:n_rows]
    rng.shuffle(keys)
    procs = []
    try:
        train = []
        for i in range(2):
            proc, address = start(
                tmp, f"train-{i}", f"--shard={i}", "--num-shards=2", f"--data-dir={tmp / f'train-{i}'}"
            )
            procs.append(proc)
            train.append(address)
        t0 = time.perf_counter()
        with PSClient(train) as client:
            client.create_table(TABLE, DIM, optimizer="sgd")
            for start_at in range(0, n_rows, CHUNK):
                client.lookup(TABLE, keys[start_at : start_at + CHUNK])  # each makes its rows
            erased = np.sort(rng.choice(keys, n_erase, replace=False))
            sample = erased[:: max(1, n_erase // n_needles)][:n_needles]
            needles = [r.tobytes() for r in client.lookup(TABLE, sample)]
            kept_needle = client.lookup(TABLE, np.setdiff1d(keys[:10], erased)[:1])[0].tobytes()
        fill_s = time.perf_counter() - t0
        for name in ("mon", "tue", "wed"):
            checkpoint_cluster(train, name)
        serving = []
        for i in range(2):
            proc, address = start(
                tmp,
                f"serve-{i}",
                f"--shard={i}",
                "--num-shards=2",
                "--mode=serve",
                f"--follow={train[i]}",
                f"--data-dir={tmp / f'serve-{i}'}",
            )
            procs.append(proc)
            serving.append(address)
        t0 = time.perf_counter()
        with PSClient(serving) as reader:
            deadline = time.monotonic() + 1800
            while True:
                follow = [s["follow"] for s in reader.admin.stats()]
                if all(f["source"] == "follow" and f["lag_versions"] == 0 and f["applied_version"] > 0 for f in follow):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the serving replicas did not catch up: {follow}")
                time.sleep(0.5)
        follow_s = time.perf_counter() - t0
        before_bytes = {str(p.relative_to(tmp)): dir_bytes(p) for p in stores(tmp)}
        rate = copy_rate(tmp / "train-0", tmp / "copy")
        assert files_holding(tmp, needles[:5]), "the search does not find rows that are there"

        (tmp / "keys.txt").write_text("\n".join(map(str, erased)) + "\n")
        t0 = time.perf_counter()
        receipt = erase(train, TABLE, erased, serving=serving)
        erase_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        places = verify(receipt, train, serving=serving)
        verify_s = time.perf_counter() - t0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(120)
    in_stores = rows_in_stores(tmp, erased)
    holding = files_holding(tmp, needles)
    kept_found = files_holding(tmp, [kept_needle])
    rewritten = sum(before_bytes.values())
    training = receipt["training"]
    return {
        "rows": n_rows,
        "dim": DIM,
        "erased_keys": n_erase,
        "fill_s": fill_s,
        "follow_s": follow_s,
        "erase_s": erase_s,
        "verify_s": verify_s,
        "rows_erased_on_training": sum(t["rows_in_ram"] + t["rows_on_disk"] for t in training),
        "checkpoint_parts_rewritten": sum(len(t["checkpoints_rewritten"]) for t in training),
        "rows_erased_from_checkpoints": sum(c["rows"] for t in training for c in t["checkpoints_rewritten"]),
        "training_compact_s": [t["compact_s"] for t in training],
        "serving_compact_s": [s["compact_s"] for s in receipt["serving_erased"]],
        "places_checked": len(places),
        "places_present": [p["place"] for p in places if p["present"]],
        "receipt_absent_everywhere": receipt["absent_everywhere"],
        "stores_read": len(in_stores),
        "rows_found_in_stores": in_stores,
        "files_holding_erased_bytes": holding,
        "erased_rows_searched_in_files": len(needles),
        "kept_row_found_in_files": len(kept_found),
        "bytes_to_rewrite": rewritten,
        "copy_rate_bytes_per_s": rate,
        "floor_s": rewritten / rate,
        "absent_everywhere": receipt["absent_everywhere"]
        and not any(p["present"] for p in places)
        and not any(in_stores.values())
        and not holding,
    }


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    names = ["erase (ps-admin erase)", "floor: rewrite the bytes once", "verify (every place)"]
    values = [res["erase_s"], res["floor_s"], res["verify_s"]]
    ax.barh(names, values, color=["tab:blue", "tab:gray", "tab:green"])
    ax.set(
        xlabel="seconds",
        title=f"Erase {res['erased_keys']:,} of {res['rows']:,} rows (2 shards, 2 replicas, 3 checkpoints)",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1M rows, 10K keys erased")
    args = ap.parse_args()
    n_rows, n_erase = (1_000_000, 10_000) if args.quick else (10_000_000, 100_000)
    with tempfile.TemporaryDirectory(prefix="bench-erase-") as tmp:
        res = run(Path(tmp), n_rows, n_erase, 200 if args.quick else 40)
    print(
        f"erase {res['erased_keys']:,} keys of {res['rows']:,} rows x {DIM} (2 shards, 2 serving replicas, 3 checkpoints)"
    )
    print(f"{'step':44} {'seconds':>9}")
    for name, seconds in (
        ("fill: lookups making every row", res["fill_s"]),
        ("serving replicas' first copy", res["follow_s"]),
        ("ps-admin erase (all of it)", res["erase_s"]),
        ("  of which: training data dir compaction", max(res["training_compact_s"])),
        ("  of which: serving data dir compaction", max(res["serving_compact_s"] or [0.0])),
        ("floor: rewrite every byte once (same disk)", res["floor_s"]),
        ("ps-admin erase --verify", res["verify_s"]),
    ):
        print(f"{name:44} {seconds:9.2f}")
    print(
        f"erased {res['rows_erased_on_training']:,} rows on the training shards and "
        f"{res['rows_erased_from_checkpoints']:,} from {res['checkpoint_parts_rewritten']} checkpoint parts"
    )
    print(
        f"absent: receipt {res['receipt_absent_everywhere']}, verify {res['places_checked']} places "
        f"(present: {res['places_present'] or 'none'}), {res['stores_read']} RocksDBs read directly "
        f"(rows found: {sum(res['rows_found_in_stores'].values())}), files holding erased rows' bytes: "
        f"{len(res['files_holding_erased_bytes'])} (a kept row's bytes found in {res['kept_row_found_in_files']})"
    )
    print(f"ABSENT EVERYWHERE: {res['absent_everywhere']}")
    if args.quick:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "erase.json").write_text(json.dumps(res, indent=2))
    chart(res, RESULTS / "erase.png")
    print(f"wrote {RESULTS / 'erase.json'} and erase.png")


if __name__ == "__main__":
    main()
