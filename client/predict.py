"""A client of one ``ps-infer``: ``PredictClient`` and its ``PredictError``.

It sends raw feature values as a ``Predict`` request (``protos.columns``) and returns
the scores; it needs no torch and no model, only the address of a running ``ps-infer``.

Example (needs a running ``ps-infer``; see the serving guide):
    >>> client = PredictClient("127.0.0.1:50100", timeout_s=2.0)  # no I/O yet
    >>> client.address
    '127.0.0.1:50100'
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from client.errors import PSError
from protos import infer_pb2 as pb
from protos import infer_pb2_grpc
from protos.columns import encode_request
from protos.rpc.security import caller_security
from protos.rpc.tls import open_channel

__all__ = ["PredictClient", "PredictError"]

F32 = npt.NDArray[np.float32]


class PredictError(PSError):
    """A ``Predict`` call failed: ``code`` is the gRPC status (see protos/infer.proto), the message the server's."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message, code=code)


class PredictClient:
    """A client of one ``ps-infer``: ``predict(context, candidates)`` returns float32 scores.

    Values are as in the training data (see ``protos.columns.columns_of`` for the forms
    ``candidates`` may take). The constructor does no I/O; the channel opens on first
    use. Thread-safe; ``predict`` blocks and raises ``PredictError`` (``.code``) when the
    call fails, ``TypeError``/``ValueError`` for values no request can carry.
    ``token``, ``tls_ca`` (TLS), ``tls_cert``/``tls_key`` (mutual TLS) reach a secured
    ``ps-infer``; the token is sent as ``authorization: Bearer`` metadata.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        self.address, self.timeout_s = address, timeout_s
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together (mutual TLS): give both or neither")
        security = caller_security(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token)
        self._metadata, self._credentials = security.metadata, security.credentials
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._lock = threading.Lock()

    def predict(
        self,
        context: Mapping[str, Any] | None,
        candidates: Sequence[Mapping[str, Any]] | Mapping[str, Any],
        *,
        timeout_s: float | None = None,
    ) -> F32:
        """Scores of ``candidates`` (rows, or columns), in order, each with the ``context`` values."""
        return self.call(encode_request(context, candidates), timeout_s=timeout_s)

    def call(self, request: pb.PredictRequest, *, timeout_s: float | None = None) -> F32:
        """Send a ready ``PredictRequest``; its scores as float32."""
        stub = self._open()
        try:
            reply = stub.Predict(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise PredictError(f"{self.address}: {exc.details()}", exc.code()) from None
        return np.frombuffer(reply.scores, dtype="<f4").astype(np.float32)

    def _open(self) -> Any:
        with self._lock:
            if self._stub is None:
                self._channel = open_channel(self.address, self._credentials, [])
                self._stub = infer_pb2_grpc.PredictorStub(self._channel)  # type: ignore[no-untyped-call]
            return self._stub

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel, self._stub = None, None

    def __enter__(self) -> PredictClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
