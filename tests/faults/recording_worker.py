"""A training worker that records every push its client saw acknowledged.

Run by torchrun (under ``ps-launch``) in the fault tests, and as the online trainer in
``test_online``: it is ``python -m worker.trainer`` with the trainer's ``PSClient``
replaced by a subclass that, after
each ``create_table`` and each acknowledged ``push_many``, appends the call to a log.
The log is pickled to ``$RECORD_PUSHES`` when training ends, so the test can replay
exactly the acknowledged pushes into an in-process twin cluster and compare rows.

A worker that may be killed streams instead: with ``$RECORD_STREAM`` (a directory) each
process appends to a file of its own (``<start time>-<pid>.pkl``) a ``("table", ...)``
record per table, a ``("send", seq, pushes)`` record before each push and an ``("ack",
seq, monotonic time)`` record once it was acknowledged, flushed each time; and one line
``seq time`` per acknowledged push to ``acks.txt`` there (the progress a test watches).
What a killed process sent but never saw acknowledged stays a send without an ack.

With ``$RECORD_HOLD`` (a path) the worker, once trained, writes ``<path>.trained`` and
waits up to 15 minutes for the path to exist before it exits: the launch, and the shards
it stops with its workers, stay up until the test has done what needs them.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import worker.online as online
import worker.trainer as trainer
from client import PSClient, PushResult, TableConfig, TablePlan
from client.client import Keys

LOG: dict[str, list[Any]] = {"tables": [], "pushes": []}
STREAM = Path(os.environ["RECORD_STREAM"]) if os.environ.get("RECORD_STREAM") else None
_OUT = (STREAM / f"{time.time():.6f}-{os.getpid()}.pkl").open("ab") if STREAM is not None else None


def _record(*item: Any) -> None:
    if _OUT is not None:
        pickle.dump(item, _OUT)
        _OUT.flush()


class RecordingClient(PSClient):
    """A real ``PSClient`` that also logs what the cluster acknowledged."""

    def create_table(self, name: str, dim: int, **options: Any) -> TableConfig:
        table = super().create_table(name, dim, **options)
        LOG["tables"].append((name, dim, options))
        _record("table", name, dim, options)
        return table

    def push_many(self, updates: Mapping[str, tuple[Keys, npt.ArrayLike]], *, seq: int | None = None) -> PushResult:
        # Keys as given, or the keys of a plan (DistributedEmbedding pushes plans).
        sent = {
            t: (np.array(k.keys if isinstance(k, TablePlan) else k, copy=True), np.array(g, copy=True))
            for t, (k, g) in updates.items()
        }
        _record("send", seq, sent)
        result = super().push_many(updates, seq=seq)  # raises unless every shard acknowledged it
        if STREAM is not None:
            now = time.monotonic()
            _record("ack", seq, now)
            with (STREAM / "acks.txt").open("a") as acks:
                acks.write(f"{seq} {now:.6f}\n")
            return result  # streamed: kept on disk, not in memory
        LOG["pushes"].append(sent)
        # The caller's arrays must not change while a push is in flight (or the shards
        # would get something else than what the trainer computed).
        if any(not np.array_equal(np.asarray(g), sent[t][1]) for t, (_, g) in updates.items()):
            LOG.setdefault("mutated", []).append(len(LOG["pushes"]) - 1)
        return result


if __name__ == "__main__":
    trainer.PSClient = RecordingClient  # type: ignore[misc]
    online.PSClient = RecordingClient  # type: ignore[misc]  # a run on a stream (worker.online)
    trainer.main(sys.argv[1:])
    if os.environ.get("RECORD_HOLD"):
        hold, deadline = Path(os.environ["RECORD_HOLD"]), time.monotonic() + 900
        hold.with_name(hold.name + ".trained").touch()
        while not hold.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    if STREAM is None:
        with open(os.environ["RECORD_PUSHES"], "wb") as f:
            pickle.dump(LOG, f)
