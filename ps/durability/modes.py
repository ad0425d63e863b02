"""When acknowledged pushes reach disk: a shard's durability mode (``--durability``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from protos.rpc.settings import ConfigError

__all__ = ["Durability"]


@dataclass(frozen=True)
class Durability:
    """When acknowledged pushes reach disk (with ``--data-dir``; the WAL is always on).

    * ``every-push``: a push is acknowledged only after its rows, their optimizer state
      and its exactly-once record are in one RocksDB write, and a lookup that creates
      rows answers only after they are written (one write per table). A killed process
      loses no acknowledged push and no row it showed (the WAL is in the OS page cache;
      power loss is not covered).
    * ``interval:S``: dirty rows are written every S seconds (and when spilled, and at
      checkpoints and shutdown). A crash loses, per row, at most the updates of the
      last S seconds plus one write's duration; no push is ever applied twice.
    * ``checkpoint-only``: rows are written only when spilled, at checkpoints and at
      a clean shutdown; a crash goes back to the last of those, per row.

    >>> Durability.parse("interval:2.5")
    Durability(kind='interval', interval_s=2.5)
    """

    kind: str
    interval_s: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Durability:
        if text in ("every-push", "checkpoint-only"):
            return cls(text)
        kind, sep, seconds = text.partition(":")
        if kind == "interval" and sep:
            try:
                value = float(seconds)
            except ValueError:
                value = -1.0
            if math.isfinite(value) and value > 0:
                return cls("interval", value)
        raise ConfigError(
            f"durability={text!r}: expected every-push, interval:SECONDS (SECONDS > 0) or checkpoint-only"
        )

    def __str__(self) -> str:
        return f"interval:{self.interval_s:g}" if self.kind == "interval" else self.kind
