"""The wire contract: ``ps.proto``, its generated modules, key hashing and byte codecs.

Both ends import this package; it depends on numpy, protobuf and grpc (and numba, for
``protos.hashing`` only, which ``import protos`` does not load). What the processes share
besides the contract (server start-up, TLS and tokens, settings, logging) is the runtime
subpackage ``protos.rpc``, which nothing here imports.
"""

from __future__ import annotations

from protos import ps_pb2, ps_pb2_grpc
from protos.keys import hash_feature, hash_features, jump_hash, mix64, shard_of
from protos.wire import WireFormatError, decode_keys, decode_rows, encode_keys, encode_rows

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
