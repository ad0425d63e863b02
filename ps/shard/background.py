"""A shard's background work: which loops are failing, and rates sampled over time.

``LoopHealth`` keeps, per background loop of a shard (the evictor, the interval flush,
the TTL sweep, storage recovery), whether its latest run failed: the error, when the
failures began, the latest one and how many in a row. A loop that fails is logged
once when it starts failing and once when it recovers (with the traceback for
anything but a storage error, which the shard reports itself); in between, its
record is in ``Stats`` and the shard's ``Background`` health service is NOT_SERVING
(see ``ps.service.server``). A run that succeeds clears the loop's record.

``RateWindow`` turns running totals (rows spilled, rows faulted in) into per-second
rates over the last ~10 s.

Example:
    >>> health = LoopHealth()
    >>> with health.run("ttl-sweep"):
    ...     raise OSError("disk on fire")
    >>> [(f.loop, f.error, f.failures) for f in health.failing()]
    [('ttl-sweep', 'OSError: disk on fire', 1)]
    >>> with health.run("ttl-sweep"):
    ...     pass
    >>> health.failing(), health.healthy
    ([], True)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from ps.errors import ShardError

__all__ = [
    "EVICTOR",
    "INTERVAL_FLUSH",
    "STORAGE_RECOVERY",
    "TTL_SWEEP",
    "Listeners",
    "LoopFailure",
    "LoopHealth",
    "RateWindow",
]

log = logging.getLogger(__name__)

# The loops of a shard, as Stats names them.
EVICTOR = "evictor"
INTERVAL_FLUSH = "interval-flush"
TTL_SWEEP = "ttl-sweep"
STORAGE_RECOVERY = "storage-recovery"

_RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class LoopFailure:
    """A background loop whose latest run failed."""

    loop: str
    error: str  # the latest error, as "Type: message" (a ShardError: its message)
    failures: int  # runs failed in a row
    first_failure_unix_s: float  # when this run of failures began
    last_failure_unix_s: float


class Listeners:
    """Callbacks told a yes/no state (``state()``, True at first) each time it changes.

    ``tell()`` after each change: the state is read again under a lock of its own and a
    repeat is skipped, so two changes racing on two threads (a failure, a recovery) cannot
    leave the listeners with the older of the two. Listeners run on the telling thread.
    """

    def __init__(self, state: Callable[[], bool]) -> None:
        self._state = state
        self._listeners: list[Callable[[bool], None]] = []
        self._lock = threading.Lock()
        self._told = True

    def add(self, listener: Callable[[bool], None]) -> None:
        self._listeners.append(listener)

    def tell(self) -> None:
        with self._lock:
            state = self._state()
            if state == self._told:
                return
            self._told = state
            for listener in list(self._listeners):
                listener(state)


class LoopHealth:
    """Which background loops are failing now (see the module docstring). Thread-safe.

    Listeners (``on_change``) hear ``healthy`` (no loop failing) each time it changes,
    on the thread of the loop that changed it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failing: dict[str, LoopFailure] = {}
        self._listeners = Listeners(lambda: self.healthy)

    @property
    def healthy(self) -> bool:
        with self._lock:
            return not self._failing

    def failing(self) -> list[LoopFailure]:
        """The loops failing now, by name."""
        with self._lock:
            return [self._failing[name] for name in sorted(self._failing)]

    def on_change(self, listener: Callable[[bool], None]) -> None:
        """Call ``listener(healthy)`` whenever the shard goes from no loop failing to some, or back."""
        self._listeners.add(listener)

    @contextlib.contextmanager
    def run(self, loop: str) -> Iterator[None]:
        """Run one pass of ``loop`` in the block: an exception is recorded and logged (not
        raised); finishing clears the loop's record."""
        try:
            yield
        except Exception as exc:
            self.failed(loop, exc)
        else:
            self.succeeded(loop)

    def failed(self, loop: str, exc: BaseException) -> None:
        """Record that a run of ``loop`` failed with ``exc``."""
        error = str(exc) if isinstance(exc, ShardError) else f"{type(exc).__name__}: {exc}"
        now = time.time()
        with self._lock:
            was_healthy = not self._failing
            old = self._failing.get(loop)
            if old is None:
                self._failing[loop] = LoopFailure(loop, error, 1, now, now)
            else:
                self._failing[loop] = replace(old, error=error, failures=old.failures + 1, last_failure_unix_s=now)
        if old is None:
            if isinstance(exc, ShardError):
                log.error("background loop %s failing: %s", loop, error)
            else:
                log.error("background loop %s failing", loop, exc_info=exc)
        if was_healthy:
            self._listeners.tell()

    def succeeded(self, loop: str) -> None:
        """Record that a run of ``loop`` succeeded: it is no longer failing."""
        with self._lock:
            old = self._failing.pop(loop, None)
            healthy = not self._failing
        if old is None:
            return
        log.warning(
            "background loop %s recovered after %d failed runs over %.1f s",
            loop,
            old.failures,
            time.time() - old.first_failure_unix_s,
        )
        if healthy:
            self._listeners.tell()


class RateWindow:
    """Per-second rates of running totals over the last ~10 s, per name. Thread-safe
    enough for its use: one thread samples, any thread reads."""

    def __init__(self, window_s: float = _RATE_WINDOW_S) -> None:
        self._window_s = window_s
        self._samples: deque[tuple[float, dict[str, tuple[int, ...]]]] = deque()

    def sample(self, now: float, totals: dict[str, tuple[int, ...]]) -> None:
        """Record the running ``totals`` per name at monotonic time ``now``."""
        self._samples.append((now, totals))
        while len(self._samples) > 2 and now - self._samples[0][0] > self._window_s:
            self._samples.popleft()

    def rates(self, name: str, width: int) -> tuple[float, ...]:
        """Per-second increase of each of ``name``'s ``width`` totals over the window (zeros
        until two samples exist)."""
        samples = list(self._samples)
        if len(samples) < 2:
            return (0.0,) * width
        (t0, c0), (t1, c1) = samples[0], samples[-1]
        dt = max(t1 - t0, 1e-9)
        zero = (0,) * width
        return tuple((b - a) / dt for a, b in zip(c0.get(name, zero), c1.get(name, zero), strict=True))
