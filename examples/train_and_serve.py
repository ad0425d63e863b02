"""Train, serve and predict on one machine: the whole path of a model through the system.

    python examples/train_and_serve.py                       # generated Criteo-like data
    python examples/train_and_serve.py --data ../shared/data/criteo_kaggle_train_head10k.txt
    python examples/train_and_serve.py --data ../shared/data/avazu_train_head10k.csv --schema avazu
    python examples/train_and_serve.py --data clicks.csv --schema clicks.toml   # your own log (docs/guides/custom-data.md)

1. starts --num-shards (default 2) training shards (data dirs in a temporary directory) and as many serving shards
   (``--mode serve --follow``) that stream every change of their training shard (holding the rows as
   ``--eval-serve-dtype`` says: ``int8`` serves 8-bit rows, and training reports the score they give);
2. trains DLRM on the training shards (every trainer flag works here: ``--model deepfm``,
   ``--train-samples``...); the run, with its exported model, goes to runs/<UTC time>/;
3. waits until the serving shards hold every row training wrote, and says how far behind
   they were when training ended;
4. starts ``ps-infer`` on the serving shards, sends one request (a context and 100
   candidates, raw values as in the training data) and prints the best candidates, and
   checks the scores against the same model run in this process;
5. stops everything (the run directory stays).
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from client import PredictClient, PSClient
from deploy import LocalCluster
from worker.command import parse
from worker.data import raw_columns
from worker.dataset import open_data, schema_of
from worker.mistakes import run_or_explain
from worker.predictor import Predictor
from worker.trainer import train

CANDIDATES = 100


def caught_up(train: PSClient, serve: PSClient) -> bool:
    """Whether every serving shard applied its training shard's newest version."""
    leader = [s["version"] for s in train.admin.stats()]
    follow = [s["follow"] for s in serve.admin.stats()]
    return all(f["connected"] and f["applied_version"] >= v for f, v in zip(follow, leader, strict=True))


def request(config: Any, train_rows: int) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """A context, 100 candidates and a label per candidate, as an online request would carry them."""
    if config.data == "synthetic":
        # Generated data: categorical columns are integer ids, dense columns counts. One
        # user context (C1, I1) and 100 items that differ in every other column.
        ids = np.arange(CANDIDATES)
        candidates = {f"C{i}": (ids * 7 + i) % 101 for i in range(2, 27)} | {f"I{j}": ids % 5 for j in range(2, 14)}
        return {"C1": 3, "I1": 2}, candidates, [f"item {i}" for i in ids]
    # A click log: 100 held-out rows, their fields as text exactly as in the file.
    columns = raw_columns(config.data, schema_of(config.schema), train_rows, CANDIDATES)
    n = len(next(iter(columns.values())))
    return {}, columns, [f"row {train_rows + i}" for i in range(n)]


WHAT = (
    "Train a model, serve it from following shards and score one request with ps-infer, all on this "
    "machine: --num-shards training shards and as many serving shards are started on 127.0.0.1 and "
    "stopped at the end (--addresses is not taken: this example starts its own shards). Every other "
    "trainer flag works as in examples/train_dlrm.py."
)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse(sys.argv[1:] if argv is None else argv, local_shards=False, description=WHAT)
    if config.addresses:
        print("train_and_serve: --addresses is not taken: this example starts its own shards", file=sys.stderr)
        return 2
    n = config.num_shards
    data = run_or_explain(lambda: open_data(config), config, "train_and_serve")  # a wrong schema: before any shard
    with tempfile.TemporaryDirectory(prefix="ps-train-and-serve-") as tmp:
        root = Path(tmp)
        trainers = LocalCluster(n, root / "train", extra_args=(f"--data-dir={root / 'train' / 'data-{shard}'}",))
        # --eval-serve-dtype int8: the serving shards hold the rows as the trainer's second score assumed
        held = () if config.eval_serve_dtype == "stored" else (f"--serve-dtype={config.eval_serve_dtype}",)
        with trainers, LocalCluster(n, root / "serve", follow=trainers.addresses, extra_args=held) as servers:
            print(
                f"training shards {','.join(trainers.addresses)}; serving shards (following) "
                f"{','.join(servers.addresses)}",
                flush=True,
            )
            trained = dataclasses.replace(config, addresses=tuple(trainers.addresses))
            metrics = run_or_explain(lambda: train(trained, trainers.addresses, data=data), config, "train_and_serve")
            run = Path(metrics["output_dir"])
            print(
                f"trained: AUC {metrics['final']['auc']:.4f} on {int(metrics['final']['samples'])} held-out samples; "
                f"model exported to {run}",
                flush=True,
            )
            if "final_served" in metrics:
                print(f"served as {config.eval_serve_dtype}: AUC {metrics['final_served']['auc']:.4f}", flush=True)
            with PSClient(trainers.addresses) as train_client, PSClient(servers.addresses) as serve_client:
                lag = [s["follow"]["lag_versions"] for s in serve_client.admin.stats()]
                started = time.monotonic()
                while not caught_up(train_client, serve_client):
                    time.sleep(0.01)
                print(
                    f"serving shards caught up: {lag} versions behind when training ended, "
                    f"{1000 * (time.monotonic() - started):.0f} ms to catch up",
                    flush=True,
                )

                port_file = root / "ps-infer.port"
                infer = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "worker.serving",
                        "--model",
                        str(run),
                        "--ps",
                        ",".join(servers.addresses),
                        "--port-file",
                        str(port_file),
                    ]
                )
                try:
                    while not port_file.exists():
                        if infer.poll() is not None:
                            raise SystemExit(f"ps-infer exited {infer.returncode} before serving")
                        time.sleep(0.05)
                    context, candidates, names = request(config, metrics["data"]["train_rows"])
                    address = f"127.0.0.1:{port_file.read_text().strip()}"
                    with PredictClient(address) as predictor:
                        started = time.monotonic()
                        scores = predictor.predict(context, candidates)
                        took = 1000 * (time.monotonic() - started)
                    local = Predictor.load(run, serve_client).predict(context, candidates)
                finally:
                    # SIGINT: finishes calls in progress and exits 0 at once (SIGTERM would first drain
                    # for --drain-s, so that load balancers move away: nobody here to move)
                    infer.send_signal(signal.SIGINT)
                    infer.wait(30)
    best = np.argsort(-scores)[:5]
    print(
        f"ps-infer at {address} scored {len(scores)} candidates in {took:.1f} ms "
        f"(model {run}); best: " + ", ".join(f"{names[i]} {scores[i]:.4f}" for i in best)
    )
    same = np.array_equal(scores, local)
    print(f"scores equal the in-process model's to the bit: {same}")
    return 0 if same and infer.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
