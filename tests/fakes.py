"""``InProcessTransport``: a client ``Transport`` that runs real ``Servicer`` handlers in-process;
``push_request``/``lookup_rows``: the requests of ``Shard.push``/``Shard.lookup`` from arrays.

Each request goes, as bytes, straight into ``ps.service.servicer.Servicer(shard, ...).<Method>``
with a fake ``ServicerContext``; the response is serialized as the real server's
serializer would (``SerializeToString`` for protobuf messages, Lookup's bytes as they
are). No sockets, no threads of its own: ``call()`` runs the handler synchronously and
returns an already-finished call. Status errors surface as ``FakeRpcError`` (a
``grpc.RpcError`` with ``code()`` and ``details()``), from ``result()``, exactly where a
gRPC future raises them.

Faults are injected with ``fail_next``: fail the next calls of a method with a status,
either before the shard sees them or after it applied them (a timeout that lost the
reply).

Example:
    >>> from ps.shard import Shard
    >>> from client import PSClient
    >>> t = InProcessTransport([Shard(0, 1)])
    >>> with PSClient(["inproc:0"], transport=t) as ps:
    ...     _ = ps.create_table("t", dim=2)
    ...     t.fail_next("Lookup", grpc.StatusCode.UNAVAILABLE)
    ...     ps.lookup("t", [1]).shape
    (1, 2)
    >>> [m for _, m, _ in t.calls]
    ['CreateTable', 'Lookup', 'Lookup']
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf.message import Message

from client.transport import Transport
from protos import ps_pb2 as pb
from protos import wire
from ps.elastic import Route
from ps.service import Servicer
from ps.service.servicer import lookup_response
from ps.shard import PushBatch, Shard

__all__ = ["FakeRpcError", "InProcessTransport", "lookup_rows", "push_request"]


def push_request(
    entries: Sequence[tuple[str, npt.ArrayLike, npt.ArrayLike]], client_id: str = "", seq: int = 0, num_shards: int = 0
) -> PushBatch:
    """What ``Shard.push`` takes, for ``(table, keys, grads)`` entries: the arrays as the
    servicer decodes them (int64 keys, float32 gradients)."""
    decoded = [(t, np.asarray(k, np.int64).reshape(-1), np.asarray(g, np.float32)) for t, k, g in entries]
    return PushBatch(decoded, client_id, seq, Route(num_shards))


def lookup_rows(shard: Shard, table: str, keys: npt.ArrayLike, dtype: int = wire.FLOAT32) -> npt.NDArray[np.float32]:
    """Rows of ``keys`` in ``table`` through ``Shard.lookup`` (one entry), as float32."""
    request = pb.LookupRequest(entries=[pb.LookupEntry(table=table, keys=wire.encode_keys(keys), dtype=dtype)])  # type: ignore[arg-type]
    (result,) = wire.decode_lookup_response(lookup_response(shard, request, 64 << 20))
    return wire.decode_rows(
        result.rows, len(result.rows) // (result.dim * wire.dtype_itemsize(dtype)), result.dim, dtype, "rows"
    )


class FakeRpcError(grpc.RpcError):
    """A failed RPC as a gRPC future reports it: ``code()``, ``details()``, ``trailing_metadata()``."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self._trailing = trailing

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Context:
    """The parts of ``grpc.ServicerContext`` the servicer uses: ``abort`` raises, with
    the trailing metadata set before it."""

    def __init__(self) -> None:
        self._trailing: tuple[tuple[str, str], ...] = ()

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._trailing = tuple(metadata)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise FakeRpcError(code, details, self._trailing)


class _DoneCall:
    """A finished call: ``result()`` returns the response bytes or raises the RPC's error."""

    def __init__(self, response: bytes | None, error: FakeRpcError | None) -> None:
        self._response = response
        self._error = error

    def result(self, timeout_s: float | None = None) -> bytes:
        if self._error is not None:
            raise self._error
        assert self._response is not None
        return self._response

    def cancel(self) -> bool:
        return False  # already finished, like a completed grpc future


@dataclass
class _Fault:
    method: str
    code: grpc.StatusCode
    times: int
    after_apply: bool
    shard: int | None
    trailing: tuple[tuple[str, str], ...] = ()


class InProcessTransport(Transport):
    """Client ``Transport`` over real ``Shard`` objects; ``shards[i]`` is shard ``i``.

    ``max_message_bytes`` is the shards' limit, as on a real server: a request or
    response larger than it fails with RESOURCE_EXHAUSTED. Every call is recorded in
    ``calls`` as ``(shard, method, request_bytes)`` (injected failures included).
    Thread-safe; ``call`` before ``start`` raises ``RuntimeError`` like ``GrpcTransport``.
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        max_message_bytes: int = 64 << 20,
        *,
        by_address: dict[str, Shard] | None = None,
        addresses: Sequence[str] | None = None,
    ) -> None:
        self.shards = list(shards)
        self.max_message_bytes = max_message_bytes
        # ``by_address``: the shards a new cluster map may name (``for_addresses``).
        self.by_address = by_address
        self._addresses = list(addresses) if addresses is not None else [f"inproc:{i}" for i in range(len(shards))]
        self.servicers = [Servicer(s, max_message_bytes) for s in self.shards]
        self.calls: list[tuple[int, str, bytes]] = []
        self.starts = 0
        self.closes = 0
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self._open = False

    def start(self) -> None:
        with self._lock:
            self.starts += 1
            self._open = True

    def close(self) -> None:
        with self._lock:
            self.closes += 1
            self._open = False

    def address(self, shard: int) -> str:
        return self._addresses[shard]

    def for_addresses(self, addresses: Sequence[str]) -> InProcessTransport:
        """A transport to the shards at ``addresses`` (a client that learned a new cluster
        map makes one); needs ``by_address``."""
        if self.by_address is None:
            raise RuntimeError("this InProcessTransport was made without by_address: it reaches no other shards")
        shards = [self.by_address[a] for a in addresses]
        return InProcessTransport(shards, self.max_message_bytes, by_address=self.by_address, addresses=addresses)

    def fail_next(
        self,
        method: str,
        code: grpc.StatusCode,
        times: int = 1,
        after_apply: bool = False,
        shard: int | None = None,
        trailing: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """Fail the next ``times`` calls of ``method`` (to ``shard``, or any) with ``code``
        (and ``trailing`` metadata, e.g. ``client.errors.OVERLOADED``).

        ``after_apply=False``: the shard never sees the call (e.g. UNAVAILABLE).
        ``after_apply=True``: the shard handles it, then the reply is lost (e.g.
        DEADLINE_EXCEEDED after a push was applied).
        """
        with self._lock:
            self._faults.append(_Fault(method, code, times, after_apply, shard, trailing))

    def count(self, method: str, shard: int | None = None) -> int:
        """How many calls of ``method`` (to ``shard``, or to any) were made."""
        with self._lock:
            return sum(m == method and (shard is None or s == shard) for s, m, _ in self.calls)

    def call(self, shard: int, method: str, request: bytes, timeout_s: float) -> _DoneCall:
        with self._lock:
            if not self._open:
                raise RuntimeError("InProcessTransport.call before start()")
            self.calls.append((shard, method, request))
            fault = self._take_fault(shard, method)
        if fault is not None and not fault.after_apply:
            return _DoneCall(None, FakeRpcError(fault.code, f"injected {fault.code.name} before apply", fault.trailing))
        try:
            response = self._handle(shard, method, request)
        except FakeRpcError as exc:
            return _DoneCall(None, exc)
        if fault is not None:
            return _DoneCall(None, FakeRpcError(fault.code, f"injected {fault.code.name} after apply"))
        return _DoneCall(response, None)

    def _take_fault(self, shard: int, method: str) -> _Fault | None:
        for fault in self._faults:
            if fault.method == method and fault.shard in (None, shard):
                fault.times -= 1
                if fault.times <= 0:
                    self._faults.remove(fault)
                return fault
        return None

    def _handle(self, shard: int, method: str, request: bytes) -> bytes:
        limit = self.max_message_bytes
        if len(request) > limit:
            raise FakeRpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"Received message larger than max ({len(request)} vs. {limit})"
            )
        reply = getattr(self.servicers[shard], method)(request, _Context())
        data = reply.SerializeToString() if isinstance(reply, Message) else bytes(reply)
        if len(data) > limit:
            raise FakeRpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"Sent message larger than max ({len(data)} vs. {limit})"
            )
        return data
