"""How ``ps-launch`` brings back what dies under it: shards on their address and data dir,
serving replicas anew, and when to give up (``RestartPolicy``: too many fast failures in a
row). Each restart, and each giving up with the shard's log tail, is one log line.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from deploy.local import LocalCluster, ShardProcess, ShardStartError
from deploy.replicas import ServingReplicas

__all__ = ["RestartPolicy", "describe_exit", "replace_followers", "revive"]

log = logging.getLogger("ps-launch")  # its lines are the launch's own


@dataclass
class RestartPolicy:
    """When to restart a dead shard, and when to give up.

    A shard that dies within ``fast_s`` of its (re)start, or fails to come back, counts
    as a fast failure; ``max_fast_failures`` in a row for one shard end the run. A shard
    that ran longer than ``fast_s`` starts its count afresh.
    """

    fast_s: float = 5.0
    max_fast_failures: int = 3
    _started: dict[int, float] = field(default_factory=dict)
    _fast: dict[int, int] = field(default_factory=dict)

    def started(self, shard: int) -> None:
        self._started[shard] = time.monotonic()

    def died(self, shard: int) -> bool:
        """Record a death (or failed restart) of ``shard``; True if it may be restarted again."""
        ran_s = time.monotonic() - self._started.get(shard, float("-inf"))
        self._fast[shard] = self._fast.get(shard, 0) + 1 if ran_s < self.fast_s else 0
        return self._fast[shard] < self.max_fast_failures


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def revive(cluster: LocalCluster, dead: Sequence[ShardProcess], policy: RestartPolicy) -> list[int]:
    """Restart every shard of ``dead`` until it serves, all of them together: each round
    spawns every shard still down, then waits for all (``LocalCluster.restart_all``).
    Returns the indices of those the policy gave up on (their log tails printed)."""
    reasons = {s.index: describe_exit(s.proc.returncode) for s in dead}
    down = [s.index for s in dead]
    lost: list[int] = []
    while down:
        again = []
        for index in down:
            shard = cluster.shards[index]
            if not policy.died(index):
                _give_up(shard, policy, reasons[index])
                lost.append(index)
                continue
            log.warning(
                "shard %d (%s, pid %d) died with %s; restarting it on the same address and data dir",
                index,
                shard.address,
                shard.proc.pid,
                reasons[index],
            )
            again.append(index)
        if not again:
            break
        t0 = time.monotonic()
        results = cluster.restart_all(again)
        down = []
        for index in again:
            policy.started(index)  # a start that failed counts as a fast failure too
            result = results[index]
            if isinstance(result, ShardStartError):
                reasons[index] = f"a failed restart ({str(result).splitlines()[0]})"
                down.append(index)
                continue
            log.info(
                "shard %d is back on %s (pid %d) after %.1f s",
                index,
                result.address,
                result.proc.pid,
                time.monotonic() - t0,
            )
    return lost


def _give_up(shard: ShardProcess, policy: RestartPolicy, reason: str) -> None:
    log.error(
        "shard %d (%s) failed %d times in a row within %.0f s of starting (last: %s); giving up. Its log (%s):\n%s",
        shard.index,
        shard.address,
        policy.max_fast_failures,
        policy.fast_s,
        reason,
        shard.log,
        shard.log_tail(),
    )


def replace_followers(followers: ServingReplicas, policy: RestartPolicy) -> bool:
    """Start a serving replica in place of each that died (one holds no rows of its own: a
    new one loads them from its training shard). True when one failed too often: give up."""
    for dead, new in followers.replace_dead():
        if isinstance(new, ShardStartError) or not policy.died(dead.index):
            log.error("serving replica %s of shard %d died and does not come back:\n%s", dead.address, dead.index, new)
            return True
        policy.started(dead.index)
        log.warning(
            "serving replica %s of shard %d died with %s; %s replaces it",
            dead.address,
            dead.index,
            describe_exit(dead.proc.returncode),
            new.address,
        )
    return False
