"""A server process's life, alike for ``ps-server`` and ``ps-infer``: read the settings,
start, tell the launcher the port, serve until SIGTERM or SIGINT, drain, stop.

``run_server`` is the whole of it; ``write_port_file`` tells launchers the real port.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from protos.rpc.logs import configure_logging

__all__ = ["Served", "ServerSettings", "Stop", "run_server", "settle_heap", "stop_on_signals", "write_port_file"]

log = logging.getLogger(__name__)


def write_port_file(path: Path, port: int) -> None:
    """Write ``port`` to ``path`` through a temporary file and a rename: a reader never
    sees half a port."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


class Stop:
    """Set by the first SIGTERM or SIGINT (``stop_on_signals``); ``signum`` says which,
    and a second signal sets ``now`` (a drain in progress ends at once)."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.now = threading.Event()
        self.signum: int | None = None

    def wait(self, timeout_s: float) -> bool:
        return self.requested.wait(timeout_s)

    @staticmethod
    def ignore_more() -> None:
        """Ignore SIGTERM and SIGINT from now on (the process is stopping)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def stop_on_signals(drains: bool = False) -> Stop:
    """A ``Stop`` set by the first SIGTERM or SIGINT. From then on both are ignored, but
    for a server that ``drains`` on SIGTERM: a second signal during the drain sets ``now``
    (the drain ends), and ``Stop.ignore_more`` ignores them once the drain is over.

    Python restores every signal's default action as the interpreter exits, so a signal
    arriving after the shutdown finished (a launcher stopping a group, then each process)
    would still kill the process and turn its exit status 0 into -SIGTERM: the handler
    ignores further signals at once, at the C level, rather than from Python code that a
    main thread blocked in the shutdown would run only at its end.
    """
    stop = Stop()

    def on_signal(signum: int, frame: object) -> None:
        if stop.requested.is_set():
            stop.ignore_more()
            stop.now.set()
            return
        stop.signum = signum
        if not (drains and signum == signal.SIGTERM):
            stop.ignore_more()
        stop.requested.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop


def settle_heap() -> None:
    """Move everything a server built while starting (modules, compiled kernels, tables'
    metadata) out of the garbage collector's reach, once it is ready to serve.

    A full collection walks every tracked object: 40 ms in a ps-server heap (118K objects)
    and 106 ms in ps-infer's (257K, torch loaded), a stall for the requests in flight.
    Frozen objects are never walked again (0.01 ms after freezing); what requests
    allocate is still collected as before.
    """
    gc.collect()
    gc.freeze()


class ServerSettings(Protocol):
    """What ``run_server`` reads of a server's settings."""

    @property
    def log_level(self) -> str: ...
    @property
    def port_file(self) -> Path | None: ...
    @property
    def grace_s(self) -> float: ...
    @property
    def drain_s(self) -> float | None: ...


class Served(Protocol):
    """A started server, as ``run_server`` sees it."""

    @property
    def port(self) -> int: ...
    @property
    def about(self) -> str:
        """What the "listening" log line says besides the port (``key=value`` words)."""
        ...

    def drain(self) -> None:
        """Report NOT_SERVING (health) while still answering every call: clients that
        check health, and load balancers, move their calls elsewhere."""
        ...

    def stop_and_report(self, grace_s: float) -> int:
        """Stop (calls in progress get ``grace_s`` seconds), log how it went; the exit status."""
        ...


_S = TypeVar("_S", bound=ServerSettings)


def run_server(prog: str, parse: Callable[[], _S], start: Callable[[_S], Served], describe: Callable[[_S], str]) -> int:
    """The life of a server process (``ps-server``, ``ps-infer``); returns its exit status.

    ``parse()`` reads the settings (a ``ValueError``: one line on stderr, exit 2); logging is
    configured and the settings logged on one line (``describe``); ``start`` builds and
    starts the server (a ``RuntimeError`` or ``ValueError``: one log line, exit 1); the real
    port goes to the port file. On SIGTERM (how schedulers stop a process) the server
    first drains for ``drain_s`` seconds (``Served.drain``: health NOT_SERVING, every call
    still answered) so that clients move away, unless a second signal cuts it short; on
    SIGINT (Ctrl-C) it does not drain. Then it stops, given ``grace_s``, and its
    ``stop_and_report`` gives the exit status. Every step logs
    one line (starting, listening, shutting down, and how it stopped) in ``protos.rpc.logs``'
    format.
    """
    try:
        settings = parse()
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if settings.port_file is not None and not settings.port_file.parent.is_dir():
        print(f"{prog}: --port-file {settings.port_file}: no directory {settings.port_file.parent}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    log = logging.getLogger(prog)  # the process's own lines: logger=ps-server, logger=ps-infer
    log.info("starting %s", describe(settings))
    log.debug("settings %s", " ".join(f"{k}={v}" for k, v in vars(settings).items()))  # every one, as used
    try:
        served = start(settings)
    except (RuntimeError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    drain_s = settings.drain_s or 0.0
    stop = stop_on_signals(drains=drain_s > 0)
    settle_heap()
    if settings.port_file is not None:
        try:
            write_port_file(settings.port_file, served.port)
        except OSError as exc:
            log.error("--port-file %s: cannot write it (%s); stopping", settings.port_file, exc.strerror)
            served.stop_and_report(0.0)
            return 1
    log.info("listening port=%d %s", served.port, served.about)
    while not stop.wait(1.0):
        pass
    if stop.signum == signal.SIGTERM and drain_s > 0:
        served.drain()
        log.info("draining drain_s=%s: health NOT_SERVING, still answering (a second signal stops now)", drain_s)
        stop.now.wait(drain_s)
        stop.ignore_more()
    log.info("shutting down grace_s=%s", settings.grace_s)
    try:
        return served.stop_and_report(settings.grace_s)
    finally:
        if settings.port_file is not None:  # a launcher waiting for it must not find a stopped server's port
            with contextlib.suppress(OSError):
                settings.port_file.unlink()
