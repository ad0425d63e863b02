"""The gRPC runtime that ``ps-server`` and ``ps-infer`` share, apart from the wire contract:
starting processes that must not outlive their launcher (``protos.rpc.child``).

Not imported by ``import protos``.
"""

from __future__ import annotations

from protos.rpc.child import child_command

__all__ = ["child_command"]
