"""TLS and bearer tokens, set up one way for every server and every caller.

A server is started with a token file (``--auth-token-file``) and TLS files (``--tls-cert``,
``--tls-key``, ``--tls-client-ca``): ``server_security``. A caller (a client, ``ps-admin``, a
shard calling another) presents TLS credentials and a token: ``caller_security``. Both read
their files once, and name the file and what is wrong with it when one cannot be used.

Example:
    >>> caller_security().metadata, caller_security(token="abc").metadata
    ((), (('authorization', 'Bearer abc'),))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from protos.rpc.auth import AuthError, Tokens, bearer_metadata, read_client_token
from protos.rpc.tls import PathLike, TLSError, channel_credentials, server_credentials

__all__ = ["CallerSecurity", "caller_security", "server_security"]


@dataclass(frozen=True)
class CallerSecurity:
    """What a caller presents: ``credentials`` for its channels (None: plaintext) and the
    bearer token's call ``metadata`` (empty without a token)."""

    credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    client_certificate: bool = False  # whether the credentials present one (mutual TLS)


def caller_security(
    *,
    tls: bool = False,
    tls_ca: PathLike | None = None,
    tls_cert: PathLike | None = None,
    tls_key: PathLike | None = None,
    token: str | None = None,
    token_file: PathLike | None = None,
) -> CallerSecurity:
    """TLS credentials when ``tls`` (the system's root certificates) or a CA or a client
    certificate is given (mutual TLS with ``tls_cert`` and ``tls_key``), and the token given
    or read from ``token_file``. Raises ``ValueError`` naming a file that cannot be used."""
    try:
        credentials = channel_credentials(tls_ca, tls_cert, tls_key) if tls or tls_ca or tls_cert else None
        given = token if token is not None else read_client_token(token_file)
    except (AuthError, TLSError) as exc:
        raise ValueError(str(exc)) from None
    return CallerSecurity(credentials, bearer_metadata(given), credentials is not None and tls_cert is not None)


def server_security(
    cert: Path | None, key: Path | None, client_ca: Path | None, token_file: Path | None
) -> tuple[Tokens | None, grpc.ServerCredentials | None]:
    """The tokens (``--auth-token-file``) and TLS credentials (``--tls-*``) a server is
    started with, None where not given; ``RuntimeError`` naming a file that cannot be used."""
    try:
        tokens = Tokens.load(token_file) if token_file is not None else None
        credentials = server_credentials(cert, key, client_ca) if cert is not None and key is not None else None
    except (AuthError, TLSError) as exc:
        raise RuntimeError(str(exc)) from None
    return tokens, credentials
