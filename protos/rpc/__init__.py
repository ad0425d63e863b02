"""The gRPC runtime that ``ps-server``, ``ps-infer``, clients and tools share, apart from
the wire contract (``protos`` itself): how a server starts and lives, TLS and tokens, the
guard in front of every call, settings, logging, backoff. Not imported by ``import protos``.

* ``server``: the one start-up of every gRPC server (``start_server``), health and readiness,
  the status boundary of a handler;
* ``process``: a server process's life (``run_server``: settings, signals, drain, port file);
* ``security``: TLS and bearer tokens, one set-up for servers and one for callers;
* ``auth`` (tokens and roles), ``tls`` (PEM credentials), ``guard`` (the interceptor:
  tokens, admission, RPC metrics);
* ``settings`` (a frozen dataclass read from flags, environment and a file), ``logs``
  (the one log format), ``backoff`` (pauses between tries), ``names`` (``dns:`` replica
  entries), ``child`` (children that die with their launcher).

Modules are imported by name (``from protos.rpc.server import start_server``): a client does
not load what only a server needs.
"""

from __future__ import annotations

from protos.rpc.child import child_command

__all__ = ["child_command"]
