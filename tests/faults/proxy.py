"""``FaultProxy``: a loopback TCP proxy in front of one server, with switchable network faults.

It listens on 127.0.0.1 port 0 (``address`` says where) and forwards each connection to
the target. ``set_mode`` switches what it does with the bytes, for connections already
open as for new ones:

* ``pass``: forward both ways.
* ``delay``: forward both ways, each chunk ``delay_ms`` after it was read (order kept).
* ``blackhole``: accept and read, never forward or answer (new connections are not
  even opened to the target).
* ``reset``: reset every open connection (TCP RST), and each new one as soon as it is
  accepted.
* ``drop_response``: forward client to server, discard server to client: the server
  handles each request and the client never sees the answer.

A connection that discarded bytes is corrupt at the protocol level (HTTP/2 frames were
lost), so switching back to ``pass`` or ``delay`` resets it; the client reconnects.

Runs an asyncio loop on a thread of its own; ``set_mode`` and ``close`` are thread-safe
and block until the switch is done.

Example:
    >>> import socket
    >>> server = socket.create_server(("127.0.0.1", 0))
    >>> with FaultProxy(f"127.0.0.1:{server.getsockname()[1]}") as proxy:
    ...     client = socket.create_connection(("127.0.0.1", proxy.port))
    ...     accepted, _ = server.accept()
    ...     client.sendall(b"ping")
    ...     accepted.recv(4)
    b'ping'
    >>> client.close(); accepted.close(); server.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Literal

__all__ = ["FaultProxy", "Mode"]

Mode = Literal["pass", "delay", "blackhole", "reset", "drop_response"]
_MODES = ("pass", "delay", "blackhole", "reset", "drop_response")
_CHUNK = 1 << 16


def _rst(writer: asyncio.StreamWriter | None) -> None:
    """Close ``writer``'s connection with a TCP RST (SO_LINGER 0), not a FIN."""
    if writer is None or writer.transport.is_closing():
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tainted: bool = False  # discarded bytes: its byte stream is no longer whole

    def reset(self) -> None:
        """Abort both sides: the pumps see their reads end, drop what is queued and finish."""
        _rst(self.client)
        _rst(self.upstream)


@dataclass
class ProxyCounters:
    """What the proxy did so far (read them any time; exact once the proxy is idle)."""

    connections: int = 0
    resets: int = 0
    bytes_forwarded: int = 0
    bytes_dropped: int = 0
    bytes_queued: int = 0  # read, to be forwarded (delayed ones wait here)


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:<port>`` to ``target`` (``HOST:PORT``); see the module docstring.

    The constructor does no I/O; ``start()`` (or ``with``) binds and starts the loop thread.
    """

    def __init__(self, target: str, *, listen_host: str = "127.0.0.1") -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listen_host = listen_host
        self._mode: Mode = "pass"
        self._delay_s = 0.0
        self._connections: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self.port = 0
        self.counters = ProxyCounters()

    @property
    def address(self) -> str:
        return f"{self._listen_host}:{self.port}"

    @property
    def mode(self) -> Mode:
        return self._mode

    def start(self) -> FaultProxy:
        if self._thread is not None:
            return self
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._accept, self._listen_host, 0))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self

    def set_mode(self, mode: Mode, delay_ms: float = 0.0) -> None:
        """Switch to ``mode`` (``delay_ms`` is used by ``delay``); returns once in effect."""
        if mode not in _MODES:
            raise ValueError(f"mode {mode!r}: expected one of {_MODES}")
        assert self._loop is not None, "set_mode before start()"

        async def switch() -> None:
            self._mode, self._delay_s = mode, delay_ms / 1000.0
            for conn in list(self._connections):
                if mode == "reset" or (mode in ("pass", "delay") and conn.tainted):
                    self._reset(conn)

        asyncio.run_coroutine_threadsafe(switch(), self._loop).result(10)

    def wait_drained(self, timeout_s: float) -> None:
        """Block until every byte read has been forwarded (delays included) or dropped.

        Bytes on a TCP connection arrive in order: after a long ``delay``, new bytes wait behind
        the delayed ones even once the mode is ``pass``. Raises ``TimeoutError``."""
        deadline = time.monotonic() + timeout_s
        while self.counters.bytes_queued:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.counters.bytes_queued} bytes still queued after {timeout_s} s")
            time.sleep(0.01)

    def close(self) -> None:
        """Stop listening, reset every connection and stop the loop thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for conn in list(self._connections):
                self._reset(conn)
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if others:  # the pumps see their connections end; a delayed write may still sleep
                _, late = await asyncio.wait(others, timeout=5)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop thread ---------------------------------------------------------------
    def _reset(self, conn: _Connection) -> None:
        self.counters.resets += 1
        self._connections.discard(conn)
        conn.reset()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counters.connections += 1
        conn = _Connection(writer)
        if self._mode == "reset":
            self.counters.resets += 1
            _rst(writer)
            return
        self._connections.add(conn)
        upstream_reader: asyncio.StreamReader | None = None
        if self._mode == "blackhole":
            conn.tainted = True
        else:
            try:
                upstream_reader, conn.upstream = await asyncio.open_connection(*self._target)
            except OSError:
                self._reset(conn)
                return
        down = None
        if upstream_reader is not None:
            down = asyncio.ensure_future(self._pump(conn, upstream_reader, writer, upward=False))
        try:
            await self._pump(conn, reader, conn.upstream, upward=True)
        finally:
            if down is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(down, 5)  # the server's last bytes, then close
            if conn in self._connections:
                self._connections.discard(conn)
                for w in (writer, conn.upstream):
                    if w is not None and not w.transport.is_closing():
                        w.close()

    async def _pump(
        self, conn: _Connection, src: asyncio.StreamReader, dst: asyncio.StreamWriter | None, *, upward: bool
    ) -> None:
        """Copy ``src`` to ``dst`` as the mode says until EOF or a reset; delays keep the order."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def write() -> None:
            broken = False  # reset or gone: what is left is dropped
            while (item := await queue.get()) is not None:
                due, data = item
                broken = broken or dst is None or dst.transport.is_closing()
                if not broken and due > loop.time():
                    await asyncio.sleep(due - loop.time())
                self.counters.bytes_queued -= len(data)
                if broken or dst is None or dst.transport.is_closing():
                    broken = True
                    continue
                try:
                    dst.write(data)
                    await dst.drain()
                    self.counters.bytes_forwarded += len(data)
                except (ConnectionError, OSError):
                    broken = True
            if not broken and dst is not None and not dst.transport.is_closing() and dst.can_write_eof():
                with contextlib.suppress(ConnectionError, OSError):
                    dst.write_eof()

        writer = asyncio.ensure_future(write())
        try:
            while data := await src.read(_CHUNK):
                mode = self._mode
                if dst is None or mode == "blackhole" or (mode == "drop_response" and not upward):
                    conn.tainted = True
                    self.counters.bytes_dropped += len(data)
                    continue
                self.counters.bytes_queued += len(data)
                queue.put_nowait((loop.time() + (self._delay_s if mode == "delay" else 0.0), data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            with contextlib.suppress(BaseException):
                await writer
