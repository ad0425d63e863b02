"""The floor of a serving lookup: the ceiling's transport plus only the work no design can skip.

``bench_serving.py`` measures our lookup against a raw-bytes gRPC echo (the ceiling). A
lookup cannot be cheaper than that echo plus the work every embedding store must do for
it, so this module builds that and nothing else, for the benchmark to run beside the rest:

* the floor server (a child process: ``python benchmarks/serving_floor.py --rows FILE
  --port-file FILE``): one shard's rows in a ``ps.table.ram.RamTier`` (our key index and row
  arena); a call's body is the raw int64 keys, as the ceiling's; the handler probes the
  index and gathers the rows into the ``bytes`` it returns (raw float32 rows). No request
  message, checks, locks, counters or response framing.
* the floor client (``FloorClient``): per request, deduplicate and route the keys
  (``client.batching.plan_keys``), encode each shard's keys, send both calls at once the way
  the ceiling does (``RawStubs``) and copy each answer's rows into the caller's array
  (``client.batching.fill_rows``).

What our lookup costs beyond the floor is what its design adds (protobuf messages, checks,
locks, retries, replicas, degrade); what the floor costs beyond the ceiling is the work.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a plain script from a checkout

from client.batching import fill_rows, plan_keys  # noqa: E402
from protos.wire import alloc_bytes, tune_malloc  # noqa: E402
from ps.store import Rows  # noqa: E402
from ps.table import (  # noqa: E402
    OptimizerKind,
    OptimizerParams,
    RamTier,  # noqa: E402
    TableSpec,  # noqa: E402
)

FLOOR_METHOD = "/bench.Floor/Lookup"
_F32, _I64 = np.dtype(np.float32), np.dtype(np.int64)


class RawStubs:
    """Raw-bytes unary calls to several servers, all in flight at once: each a blocking
    call on a pooled thread that stays (as ``PSClient``'s transport sends them)."""

    def __init__(
        self, name: str, addresses: Sequence[str], method: str, options: list[tuple[str, int]], threads: int
    ) -> None:
        self._channels = [grpc.insecure_channel(a, options=options) for a in addresses]
        self._stubs = [c.unary_unary(method, None, None) for c in self._channels]
        self._pool = futures.ThreadPoolExecutor(threads, thread_name_prefix=f"{name}-call")

    def send(self, bodies: Sequence[bytes]) -> list[bytes]:
        calls = [self._pool.submit(stub, body, timeout=30) for stub, body in zip(self._stubs, bodies)]
        return [c.result() for c in calls]

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for c in self._channels:
            c.close()


class FloorClient:
    """Rows of a request's keys from the floor servers (one per shard, in shard order)."""

    def __init__(self, addresses: Sequence[str], dim: int, options: list[tuple[str, int]], threads: int) -> None:
        self._stubs = RawStubs("floor", addresses, FLOOR_METHOD, options, threads)
        self._shards, self._dim = len(addresses), dim

    def lookup(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        unique, _, order, bounds, slots = plan_keys(keys, self._shards)
        routed = unique[order]
        bodies = [routed[bounds[s] : bounds[s + 1]].tobytes() for s in range(self._shards)]
        out = np.empty((keys.shape[0], self._dim), dtype=np.float32)
        for s, answer in enumerate(self._stubs.send(bodies)):
            fill_rows(out, np.frombuffer(answer, _F32).reshape(-1, self._dim), slots, int(bounds[s]))
        return out

    def checked(
        self, keys: npt.NDArray[np.int64], rows: npt.NDArray[np.float32], request: npt.NDArray[np.int64]
    ) -> FloorClient:
        """This client, once ``request``'s rows came back as ``rows[i]`` is ``keys[i]``'s;
        raises ``RuntimeError`` otherwise (a floor that skipped the work would measure nothing)."""
        order = np.argsort(keys)
        expected = rows[order[np.searchsorted(keys, request, sorter=order)]]
        if not np.array_equal(self.lookup(request), expected):
            raise RuntimeError("the floor servers return other rows than the table holds")
        return self

    def close(self) -> None:
        self._stubs.close()


def write_rows(path: Path, keys: npt.NDArray[np.int64], rows: npt.NDArray[np.float32]) -> None:
    """The rows one floor server holds (``np.savez``)."""
    np.savez(path, keys=keys, rows=rows)


def serve(rows_file: Path, port_file: Path, options: list[tuple[str, int]]) -> None:
    """Hold ``rows_file``'s rows and answer ``FLOOR_METHOD`` (``serve_raw``)."""
    tune_malloc()  # as ps-server does
    with np.load(rows_file) as data:
        keys, rows = data["keys"], data["rows"]
    dim = rows.shape[1]
    ram = RamTier(
        TableSpec("floor", dim, optimizer=OptimizerParams(kind=OptimizerKind.SGD)),
        initial_capacity=max(1, keys.shape[0]),
    )
    zeros = np.zeros(keys.shape[0], np.uint32)
    no_state = np.zeros((keys.shape[0], ram.arena.state.shape[1]), np.float32)
    ram.install(Rows(keys, rows, no_state, zeros, zeros), dirty=0)
    now = np.uint32(0)

    def lookup(request: bytes, context: grpc.ServicerContext) -> bytes:
        asked = np.frombuffer(request, _I64)
        data, buf = alloc_bytes(asked.shape[0] * dim * 4)
        ram.gather(ram.slots(asked), buf.view(_F32).reshape(-1, dim), now, touch=False)
        return data

    service, name = FLOOR_METHOD.strip("/").split("/")
    serve_raw(service, {name: lookup}, port_file, options)


def serve_raw(
    service: str,
    methods: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]],
    port_file: Path,
    options: list[tuple[str, int]],
) -> None:
    """Answer ``service``'s raw-bytes unary ``methods`` (name -> handler) on 127.0.0.1 (a free
    port, written to ``port_file``) from 8 threads, until SIGTERM. The benchmarks' ceilings
    and the floor are all served this way."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[*options, ("grpc.so_reuseport", 0)])
    handlers = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_file.with_suffix(".tmp").write_text(f"{port}\n")
    port_file.with_suffix(".tmp").replace(port_file)  # atomically, as ps-server does
    while True:
        signal.pause()  # until SIGTERM ends the process (default action)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=Path, required=True, help="the .npz write_rows wrote")
    p.add_argument("--port-file", type=Path, required=True)
    p.add_argument("--max-message-bytes", type=int, default=64 << 20)
    a = p.parse_args()
    size = a.max_message_bytes
    serve(a.rows, a.port_file, [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)])
