"""One exception tree for everything that can go wrong talking to a cluster.

Every error is a ``PSError`` carrying ``.code`` (the ``grpc.StatusCode``) and
``.shard`` (the shard index, or None when no single shard is to blame). A
``grpc.RpcError`` never leaves ``client/``.

| status              | exception                 | retried by the client |
|---------------------|---------------------------|-----------------------|
| INVALID_ARGUMENT    | InvalidRequestError       | no                    |
| NOT_FOUND           | TableNotFoundError        | no                    |
| ALREADY_EXISTS      | TableExistsError          | no                    |
| FAILED_PRECONDITION | PreconditionError         | no                    |
| FAILED_PRECONDITION marked ps-wrong-shard (a key the shard does not own) | WrongShardError (a PreconditionError; ``.owner``) | no |
| RESOURCE_EXHAUSTED  | ResourceExhaustedError    | only marked ps-overloaded (a shard's call limit) |
| UNAUTHENTICATED     | UnauthenticatedError      | no                    |
| PERMISSION_DENIED   | PermissionDeniedError     | no                    |
| UNAVAILABLE         | ShardUnavailableError     | yes                   |
| CANCELLED           | ShardUnavailableError     | yes (a stopping shard)|
| DEADLINE_EXCEEDED   | DeadlineExceededError     | yes, within deadline_s|
| anything else       | InternalServerError       | no                    |
"""

from __future__ import annotations

import contextlib
import copy
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import grpc

from protos.wire import MAP_EPOCH_METADATA, MOVING, WRONG_SHARD_METADATA

__all__ = [
    "DeadlineExceededError",
    "InternalServerError",
    "InvalidRequestError",
    "PSError",
    "PreconditionError",
    "ResourceExhaustedError",
    "ShardUnavailableError",
    "TableExistsError",
    "TableNotFoundError",
    "PermissionDeniedError",
    "WrongShardError",
    "UnauthenticatedError",
    "error_for",
    "rpc_errors",
    "tls_hint",
]


class PSError(Exception):
    """Base of all client errors: ``code`` is the gRPC status, ``shard`` the shard index or None.

    ``code`` defaults to the class's own status, so errors found by the client itself
    (before any RPC) carry the same code a shard would have sent. ``hint`` is what to do,
    when the client could tell (it is also the end of the message): e.g. the address
    answers TLS and the client spoke plain text.
    """

    default_code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, shard: int | None = None, hint: str = ""):
        super().__init__(message)
        self.code = code or self.default_code
        self.shard = shard
        self.hint = hint

    def reworded(self, message: str) -> PSError:
        """A copy of this error (same class and attributes) with ``message``."""
        clone = copy.copy(self)
        clone.args = (message,)
        return clone


class InvalidRequestError(PSError, ValueError):
    """The request was malformed (shape, dtype, NaN gradient, bad table spec).

    Also a ``ValueError``, so code that checks arguments the usual way catches it.
    """

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class TableNotFoundError(PSError):
    """A shard does not hold the named table."""

    default_code = grpc.StatusCode.NOT_FOUND


class TableExistsError(PSError):
    """``create_table`` named an existing table with a different spec."""

    default_code = grpc.StatusCode.ALREADY_EXISTS


class PreconditionError(PSError):
    """The cluster refused the call in its state (address list mismatch, read-only shard)."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class WrongShardError(PreconditionError):
    """A shard was sent keys it does not own (an address list in the wrong order, or a
    cluster that changed size); it applied nothing. ``owner`` is the shard that owns the
    key the message names, or None if the shard did not say."""

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        shard: int | None = None,
        owner: int | None = None,
    ):
        super().__init__(message, code=code, shard=shard)
        self.owner = owner


class ResourceExhaustedError(PSError):
    """A request or response was over a size limit, or the shard is out of capacity."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ShardUnavailableError(PSError):
    """A shard could not be reached or is shutting down (retried until the deadline)."""

    default_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(PSError):
    """The call's deadline passed before every shard answered."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnauthenticatedError(PSError):
    """No token, or one the shard does not know (``ClientConfig.token_file``/``PS_CLIENT_TOKEN_FILE``)."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(PSError):
    """The token's role may not do this (read < write < admin)."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


class InternalServerError(PSError):
    """A shard failed in a way that is a bug; its log has the traceback."""

    default_code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[PSError]] = {
    cls.default_code: cls
    for cls in (
        InvalidRequestError,
        TableNotFoundError,
        TableExistsError,
        PreconditionError,
        ResourceExhaustedError,
        ShardUnavailableError,
        DeadlineExceededError,
        UnauthenticatedError,
        PermissionDeniedError,
    )
}
# A shard that stops (SIGTERM) while a call is in flight may cancel it from its side: the
# call never ran or its answer was lost, exactly as with UNAVAILABLE. (The client itself
# cancels no call.)
_BY_CODE[grpc.StatusCode.CANCELLED] = ShardUnavailableError

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})

OVERLOADED = ("ps-overloaded", "1")
"""Trailing metadata of a RESOURCE_EXHAUSTED that refuses for load (retry later), unlike
one that refuses a request too large (never retried)."""


def _trailing(exc: grpc.RpcError) -> tuple[tuple[str, Any], ...]:
    metadata: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else ()
    return tuple((m[0], m[1]) for m in metadata or ())


def map_epoch(exc: grpc.RpcError) -> int | None:
    """The cluster map epoch a shard that refused keys it does not own routes by (its
    ``ps-map-epoch`` trailing metadata), or None for any other failure."""
    code = exc.code() if hasattr(exc, "code") else None
    if code != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    epoch = next((str(v) for k, v in _trailing(exc) if k == MAP_EPOCH_METADATA), None)
    return int(epoch) if epoch is not None and epoch.isdigit() else None


def is_overloaded(exc: grpc.RpcError) -> bool:
    """Whether a failed attempt was refused for load: RESOURCE_EXHAUSTED marked ``OVERLOADED``."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and OVERLOADED in _trailing(exc)


def is_moving(exc: grpc.RpcError) -> bool:
    """Whether a failed attempt was refused because its keys are being handed over in a live
    reshard: UNAVAILABLE marked ``MOVING`` (nothing of it applied)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    return code == grpc.StatusCode.UNAVAILABLE and MOVING in _trailing(exc)


def is_retryable(exc: grpc.RpcError) -> bool:
    """Whether a failed attempt may be retried: a RETRYABLE status or an overload refusal."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    return code in RETRYABLE or is_overloaded(exc)


def error_for(code: grpc.StatusCode) -> type[PSError]:
    """The exception class for a status code."""
    return _BY_CODE.get(code, InternalServerError)


def convert(
    exc: grpc.RpcError, shard: int | None, address: str = "", tls: bool | None = None, client_certificate: bool = False
) -> PSError:
    """A ``PSError`` for a failed RPC, its message prefixed with the shard and address.

    With ``tls`` (whether the channel used TLS) known, a connection that failed because
    one side speaks TLS and the other does not gets a hint saying so (``tls_hint``: it may
    connect to ``address`` once, so pass ``tls`` only for the error a caller will see).
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    where = f"shard {shard}" + (f" ({address})" if address else "") if shard is not None else "cluster"
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        owner = next((str(v) for k, v in _trailing(exc) if k == WRONG_SHARD_METADATA), None)
        if owner is not None:
            return WrongShardError(
                f"{where}: {details}", code=code, shard=shard, owner=int(owner) if owner.isdigit() else None
            )
    hint = tls_hint(code, str(details), address, tls, client_certificate) if tls is not None and address else ""
    return error_for(code)(f"{where}: {details}", code=code, shard=shard, hint=hint)


def tls_hint(code: grpc.StatusCode, details: str, address: str, tls: bool, client_certificate: bool = False) -> str:
    """What to do when a connection to ``address`` failed over TLS on one side only, else "".

    A plain-text channel to a TLS port fails with "Socket closed", as a shard that went
    away would: the address is then asked for a TLS handshake (one connection, at most
    ``PROBE_TIMEOUT_S``) to tell the two apart. A TLS channel to a plain-text port fails
    its handshake with WRONG_VERSION_NUMBER, and one to a certificate the CA did not sign
    with CERTIFICATE_VERIFY_FAILED; both say so in ``details``. A TLS channel without a
    client certificate (``client_certificate`` False) to a server of mutual TLS fails with
    "Socket closed" too: the server closes it right after the handshake, which a probe
    connection tells apart from a server that went away.
    """
    if code != grpc.StatusCode.UNAVAILABLE:
        return ""
    if tls:
        if "WRONG_VERSION_NUMBER" in details:
            return f"the server at {address} does not use TLS: connect without --tls-ca (PS_CLIENT_TLS_CA)"
        if "CERTIFICATE_VERIFY_FAILED" in details:
            return (
                f"the certificate of the server at {address} is not signed by --tls-ca (PS_CLIENT_TLS_CA), or "
                "does not name that address: pass the CA that signed it"
            )
        if "Socket closed" in details and not client_certificate and _wants_client_certificate(address):
            return (
                f"the server at {address} asks for a client certificate (mutual TLS): pass --tls-cert and "
                "--tls-key (PS_CLIENT_TLS_CERT, PS_CLIENT_TLS_KEY) with one its --tls-client-ca signed"
            )
        return ""
    if "Socket closed" in details and _answers_tls(address):
        return f"the server at {address} expects TLS: pass --tls-ca CA.pem (or set PS_CLIENT_TLS_CA)"
    return ""


PROBE_TIMEOUT_S = 1.0


def _answers_tls(address: str) -> bool:
    """Whether ``HOST:PORT`` completes a TLS handshake (the certificate is not checked)."""
    try:
        with _tls_probe(address) as tls:
            return tls is not None
    except (OSError, ValueError):  # ssl.SSLError is an OSError: a plain-text server, or none
        return False


def _wants_client_certificate(address: str) -> bool:
    """Whether the TLS server at ``HOST:PORT`` closes a connection that brought no client
    certificate right after the handshake, where a gRPC server sends its HTTP/2 settings
    first (the certificate is not checked)."""
    try:
        with _tls_probe(address) as tls:
            return tls is not None and tls.recv(1) == b""
    except ssl.SSLError as exc:  # under TLS 1.3 a server may say so with an alert
        return "CERTIFICATE_REQUIRED" in str(exc)
    except (OSError, ValueError):  # a plain-text server, none, or one that said nothing in time
        return False


@contextlib.contextmanager
def _tls_probe(address: str) -> Iterator[ssl.SSLSocket | None]:
    """A TLS connection to ``HOST:PORT`` offering HTTP/2 and no client certificate, the
    server's certificate unchecked; None for an address that names no port (a resolver
    name such as ``dns:///...``, a unix socket): nothing to probe. Raises ``OSError``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        yield None
        return
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S) as sock,
        context.wrap_socket(sock, server_hostname=None) as tls,
    ):
        yield tls


@contextlib.contextmanager
def rpc_errors(shard: int | None, address: str = "") -> Iterator[None]:
    """Convert a ``grpc.RpcError`` raised in the block into the matching ``PSError``."""
    try:
        yield
    except grpc.RpcError as exc:
        raise convert(exc, shard, address) from exc
