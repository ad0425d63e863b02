"""Pauses between tries, one way everywhere: a client retrying a call, a follower or a new
owner reconnecting to a shard, a shard retrying a data dir that refused a write.

A pause starts at ``initial_s`` and doubles after every failed try up to ``max_s``; a
success starts it over. ``jitter`` is the share of each pause drawn at random, so that
many callers failing together do not try again together: 1 draws it anywhere below the
pause (full jitter), 0.5 between half of it and all of it, 0 not at all.

Example:
    >>> b = Backoff(0.5, 5.0, jitter=0.0)
    >>> [b.next_s() for _ in range(5)]
    [0.5, 1.0, 2.0, 4.0, 5.0]
    >>> b.reset(); b.next_s()
    0.5
    >>> 0.0 <= pause_s(3, 0.01, 1.0) <= 0.08
    True
"""

from __future__ import annotations

import random

__all__ = ["Backoff", "pause_s"]


def pause_s(attempt: int, initial_s: float, max_s: float, jitter: float = 1.0) -> float:
    """The pause after failed try ``attempt`` (0-based): ``initial_s * 2**attempt`` capped at
    ``max_s``, its ``jitter`` share drawn at random."""
    cap = min(max_s, initial_s * (2.0 ** min(attempt, 60)))
    return cap * (1.0 - jitter * random.random())


class Backoff:
    """The pauses of one caller's tries (see the module docstring). Not thread-safe: one
    per loop that retries."""

    def __init__(self, initial_s: float, max_s: float, *, jitter: float = 0.5) -> None:
        if not (0 < initial_s <= max_s and 0.0 <= jitter <= 1.0):
            raise ValueError(
                f"initial_s={initial_s}, max_s={max_s}, jitter={jitter}: need 0 < initial <= max, jitter in [0, 1]"
            )
        self.initial_s, self.max_s, self.jitter = initial_s, max_s, jitter
        self._failures = 0

    def next_s(self) -> float:
        """The pause before the next try, after one more failure."""
        pause = pause_s(self._failures, self.initial_s, self.max_s, self.jitter)
        self._failures += 1
        return pause

    def reset(self) -> None:
        """A try succeeded: the next failure pauses ``initial_s`` again."""
        self._failures = 0
