"""``ps-rendezvous --listen HOST:PORT``: a rendezvous for elastic torchrun that outlives its workers.

torchrun's c10d rendezvous keeps its state in a ``TCPStore`` that one of the agents hosts
by default, so the whole job depends on that agent's machine. This process hosts the
store on its own: start every agent with ``--rdzv-backend=c10d
--rdzv-endpoint=<this address> --rdzv-conf=is_host=false`` and any of them may die,
come back or join (``deploy/k8s/train.yaml`` runs it as a Deployment behind a Service;
``ps-launch`` hosts the same store inside its torchrun process, ``deploy.workers``).
It binds exactly ``HOST`` (``127.0.0.1``: this machine only), logs one line with its
address, and exits 0 on SIGTERM or Ctrl-C.

Example:
    >>> store = host_store("127.0.0.1:0")
    >>> store.port > 0
    True
"""

from __future__ import annotations

import argparse
import datetime
import logging
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported without __all__

from protos.rpc.logs import configure_logging

__all__ = ["host_store", "main", "parse_args"]

log = logging.getLogger("ps-rendezvous")

_TIMEOUT = datetime.timedelta(seconds=300)  # of a client's wait for a key; agents set their own


def host_store(listen: str) -> TCPStore:
    """A ``TCPStore`` server on ``listen`` (``HOST:PORT``; port 0: one the kernel picks, in
    ``.port``), for many rendezvous (multi-tenant). Raises ``OSError`` if it cannot bind."""
    address, _, port = listen.rpartition(":")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address.strip("[]"), int(port)))
    sock.listen(1024)
    # torch binds every interface unless it is handed a socket: this one is bound to HOST.
    store = TCPStore(
        address.strip("[]"),
        sock.getsockname()[1],
        is_master=True,
        multi_tenant=True,
        wait_for_workers=False,
        timeout=_TIMEOUT,
        master_listen_fd=sock.detach(),
    )
    return store


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ps-rendezvous",
        description="Host the c10d rendezvous store of elastic torchrun agents (started with "
        "--rdzv-backend=c10d --rdzv-endpoint=ADDRESS --rdzv-conf=is_host=false) until SIGTERM.",
    )
    parser.add_argument("--listen", default="127.0.0.1:29400", help="HOST:PORT to listen on (default 127.0.0.1:29400)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    args = parser.parse_args(list(argv))
    _, colon, port = args.listen.rpartition(":")
    if not colon or not port.isdigit() or not 0 <= int(port) < 1 << 16:
        parser.error(f"--listen {args.listen}: expected HOST:PORT, e.g. 0.0.0.0:29400")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: host the store until SIGTERM or Ctrl-C; returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(args.log_level)
    try:
        store = host_store(args.listen)
    except OSError as exc:
        log.error("cannot listen on %s: %s", args.listen, exc)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    log.info("rendezvous store listening on %s (port %d)", args.listen, store.port)
    stop.wait()
    log.info("stopping")
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
