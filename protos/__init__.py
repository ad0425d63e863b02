"""The wire contract: ``ps.proto``, its generated modules, key hashing and byte codecs.

Both ends import this package; it depends on numpy, protobuf and grpc (and numba, for
``protos.hashing`` only, which ``import protos`` does not load). What the processes share
besides the contract (server start-up, TLS and tokens, settings, logging) is the runtime
subpackage ``protos.rpc``, which nothing here imports.
"""

from __future__ import annotations

import os

# Before gRPC loads: its C core logs each failed TLS handshake (a port scan, a client without
# TLS) at INFO on stderr, a flood in a server's log; the processes say what matters in their
# own lines. GRPC_VERBOSITY=INFO shows them again.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from protos import ps_pb2, ps_pb2_grpc  # noqa: E402
from protos.keys import hash_feature, hash_features, jump_hash, mix64, shard_of  # noqa: E402
from protos.wire import WireFormatError, decode_keys, decode_rows, encode_keys, encode_rows  # noqa: E402

__all__ = [
    "WireFormatError",
    "decode_keys",
    "decode_rows",
    "encode_keys",
    "encode_rows",
    "hash_feature",
    "hash_features",
    "jump_hash",
    "mix64",
    "ps_pb2",
    "ps_pb2_grpc",
    "shard_of",
]
