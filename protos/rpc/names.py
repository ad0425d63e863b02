"""Replica entries that name several servers: ``dns:HOST:PORT`` is every address HOST
resolves to, at PORT (a Kubernetes headless Service has one per ready pod). Clients
(``client.membership``) and serving shards asking their peers (``ps.replication.peers``) resolve them
alike. Not imported by ``import protos``.

Example:
    >>> addresses_of("dns:127.0.0.1:50051"), addresses_of("10.0.0.9:1")
    (['127.0.0.1:50051'], ['10.0.0.9:1'])
"""

from __future__ import annotations

import socket

__all__ = ["DNS_PREFIX", "addresses_of", "dns_name", "resolve_name"]

DNS_PREFIX = "dns:"
"""Starts a replica entry that stands for every address its name resolves to."""


def resolve_name(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, as ``IP:PORT`` (``[IPv6]:PORT``), sorted;
    raises ``OSError`` when it does not resolve."""
    found = set()
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip = str(sockaddr[0])
        found.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(found)


def dns_name(entry: str) -> tuple[str, int] | None:
    """``(HOST, PORT)`` of a ``dns:HOST:PORT`` entry, or None for a plain address."""
    if not entry.startswith(DNS_PREFIX):
        return None
    host, _, port = entry[len(DNS_PREFIX) :].rpartition(":")
    return host, int(port)


def addresses_of(entry: str) -> list[str]:
    """The servers ``entry`` names now: itself, or every address a ``dns:HOST:PORT``
    resolves to (``OSError`` when it does not resolve)."""
    name = dns_name(entry)
    return [entry] if name is None else resolve_name(*name)
