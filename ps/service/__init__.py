"""The gRPC face of a shard: ``ServerConfig`` and its loader, the servicer (decode, one
``Shard`` call, encode), the server's start-up and stop, ``Stats`` and Prometheus metrics.
"""

from __future__ import annotations

from ps.service.config import ServerConfig, load_config
from ps.service.server import PSServer, build_server
from ps.service.servicer import Servicer

__all__ = ["PSServer", "ServerConfig", "Servicer", "build_server", "load_config"]
