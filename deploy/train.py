"""``python -m deploy.train``: train, starting local shards first when no addresses are given.

This is the zero-config mode of the examples: the same ``worker.trainer`` run, with
``--num-shards`` shard processes started on 127.0.0.1 and stopped at the end. Under
torchrun, rank 0 starts them and broadcasts their addresses; every rank must finish
before rank 0 stops them. Local shards serve one machine only, so a multi-node job must
pass ``--addresses`` (or run under ``ps-launch``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from deploy.local import LocalCluster, threads_beside_local_shards
from worker.command import parse, report
from worker.dataset import open_data
from worker.distributed import Dist, init_distributed
from worker.mistakes import run_or_explain
from worker.resume import CheckpointError
from worker.stream import is_stream
from worker.trainer import TrainerConfig, train

__all__ = ["main", "run"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _shards(config: TrainerConfig, d: Dist) -> Iterator[list[str]]:
    if config.addresses:
        yield list(config.addresses)
        return
    if config.checkpoint_dir is not None:
        # A resumed run needs the rows its pushes left on the shards; shards started here
        # for one process's lifetime would come back empty.
        raise CheckpointError(
            "--checkpoint-dir resumes a run on the shards that hold its rows, and local shards started for this "
            "process end with it: pass --addresses (or run under ps-launch, which keeps its shards across restarts)"
        )
    if d.world > 1 and int(os.environ.get("LOCAL_WORLD_SIZE", d.world)) != d.world:
        raise ValueError("local shards serve one machine: a multi-node job needs --addresses")
    cluster = LocalCluster(config.num_shards) if d.rank == 0 else None
    error = ""
    addresses: list[str] = []
    if cluster is not None:
        try:
            addresses = cluster.start().addresses
        except Exception as exc:  # every rank must hear of it, or the others wait forever
            error = f"rank 0 could not start {config.num_shards} local shards: {exc}"
    if d.world > 1:
        box: list[Any] = [(addresses, error)]
        dist.broadcast_object_list(box, src=0)
        addresses, error = box[0]
    if error:
        raise RuntimeError(error)
    log.info("started %d local shards: %s", config.num_shards, ",".join(addresses))
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:  # an explicit setting (torchrun sets 1) wins
        torch.set_num_threads(min(threads, threads_beside_local_shards()))
    ok = False
    try:
        yield addresses
        ok = True
    finally:
        # Wait for every rank only when all got here normally: a rank that failed is
        # not coming, and the others learn of it from their own collectives.
        if ok and d.world > 1:
            dist.barrier()
        if cluster is not None:
            cluster.stop()
        # Back to the caller's count once the shards are gone: a program that trains in
        # process and then serves or evaluates computes as it did before (float results
        # of matrix kernels may differ in the last bit between thread counts).
        torch.set_num_threads(threads)


def run(config: TrainerConfig) -> dict[str, Any]:
    """Train ``config``, with local shards if it names no addresses; returns the metrics.

    The data is read (or, streamed, its first rows) before any shard starts: a file that
    does not read as its schema costs no shard start-up, and leaves no shard behind."""
    d = init_distributed(config.device)
    try:
        data = None if is_stream(config.data) else open_data(config)
        with _shards(config, d) as addresses:
            return train(config, addresses, d, data)
    finally:
        if d.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


@record  # under torchrun, the error reaches ps-launch's one-line summary of a failed worker
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Entry point: the trainer's flags (``python -m worker.trainer --help``)."""
    config = parse(sys.argv[1:] if argv is None else argv)
    metrics = run_or_explain(lambda: run(config), config, "train")
    report(metrics)
    return metrics


if __name__ == "__main__":
    main()
