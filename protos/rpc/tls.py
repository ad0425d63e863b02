"""TLS credentials of servers and channels, from PEM files.

A server with a certificate and key speaks TLS; given a client CA too, it asks every
client for a certificate signed by it (mutual TLS). A client trusts the servers' CA and,
for mutual TLS, presents its own certificate and key. Every error names the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc

__all__ = ["TLSError", "channel_credentials", "open_channel", "server_credentials"]

PathLike = str | os.PathLike[str]


class TLSError(ValueError):
    """A certificate or key file that cannot be used."""


def _read(path: PathLike, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSError(f"{what} {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise TLSError(f"{what} {path}: not a PEM file")
    return data


def server_credentials(cert: PathLike, key: PathLike, client_ca: PathLike | None = None) -> grpc.ServerCredentials:
    """TLS with ``cert`` and ``key``; with ``client_ca``, clients must present a
    certificate it signed (mutual TLS)."""
    chain = _read(cert, "--tls-cert")
    private = _read(key, "--tls-key")
    roots = _read(client_ca, "--tls-client-ca") if client_ca else None
    return grpc.ssl_server_credentials(
        [(private, chain)], root_certificates=roots, require_client_auth=roots is not None
    )


def channel_credentials(
    ca: PathLike | None, cert: PathLike | None = None, key: PathLike | None = None
) -> grpc.ChannelCredentials:
    """Credentials of a TLS channel trusting ``ca`` (None: the system's roots), presenting
    ``cert``/``key`` when both are given (mutual TLS)."""
    if (cert is None) != (key is None):
        raise TLSError("a client certificate needs its key and a key its certificate: give both or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "TLS CA") if ca else None,
        private_key=_read(key, "TLS client key") if key else None,
        certificate_chain=_read(cert, "TLS client certificate") if cert else None,
    )


def open_channel(
    address: str, credentials: grpc.ChannelCredentials | None, options: list[tuple[str, Any]]
) -> grpc.Channel:
    """A channel to ``address``: TLS with ``credentials``, plain without."""
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)
