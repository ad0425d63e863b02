"""``ClientConfig`` (how the client talks to a cluster) and ``TableConfig`` (a table as created).

Example:
    >>> ClientConfig(deadline_s=5).attempt_timeout_s
    5.0
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from protos.rpc.security import CallerSecurity, caller_security

__all__ = ["ClientConfig", "TableConfig"]

TransportDType = Literal["float32", "float16", "bfloat16"]


@dataclass(frozen=True)
class ClientConfig:
    """Settings of a ``PSClient``; immutable. Raises ``ValueError`` naming a bad field.

    * ``deadline_s``: total time one client call may take, retries included. Retryable
      failures (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED) are retried until it passes, so the
      default rides through a shard restart of tens of seconds.
    * ``attempt_timeout_s``: limit of one RPC attempt (None: the whole deadline).
    * ``backoff_initial_s``, ``backoff_max_s``: the pause between attempts doubles from
      the first up to the second, with full jitter. The channels reconnect to a shard
      that went away at least every ``backoff_max_s`` too.
    * ``max_attempts``: None (retry until the deadline), or a cap on attempts per call
      (an attempt a shard refused for load, before doing anything, does not count).
    * ``max_message_bytes``: requests and responses are split to stay under this; it
      must not exceed the shards' own ``max_message_bytes``.
    * ``transport_dtype``: wire type of looked-up rows and pushed gradients; 16-bit
      types halve the bytes and round each value.
    * ``push_threads``: threads that run ``push_async`` calls.
    * ``tune_malloc``: on ``start()``, raise glibc's mmap threshold for this process
      (``protos.wire.tune_malloc``) so multi-MiB messages reuse heap memory instead
      of page-faulting fresh mappings; False leaves the allocator alone.

    Shards with several replicas (read-only serving copies; see ``PSClient``):

    * ``hedge_after_s``: None (off), or the delay after which a read (Lookup, ListTables)
      that has not been answered is sent to a second in-service replica too; the first
      answer wins and the other attempt is cancelled. A replica that loses the race
      counts as failing it. Pick about the 95th percentile of a healthy read.
    * ``eject_after_failures``: consecutive failed attempts (retryable status, a missed
      deadline, a lost hedge race) after which a replica is ejected: reads go to the
      others. One request probes it once the ejection runs out; its success puts the
      replica back, its failure ejects it again. A shard with one replica is never ejected.
    * ``eject_s``, ``eject_max_s``: the first ejection lasts ``eject_s``; each one after
      a failed probe lasts twice the one before, up to ``eject_max_s``.
    * ``membership_refresh_s``: how often a client whose replicas can change (a ``dns:``
      entry, an addresses file) looks for new ones, and a client of replicas asks each
      for its health: a new replica takes calls after its first SERVING answer, one that
      answers NOT_SERVING (draining before it stops) is called only when no other is left
      (``client.membership``).

    Security (shards started with ``--tls-cert``/``--auth-token-file``); each defaults to
    the environment variable named, so every program that calls shards (trainer,
    ``ps-admin``, ``ps-infer``, a following serving shard) is configured alike:

    * ``tls_ca`` (``PS_CLIENT_TLS_CA``): PEM CA the shards' certificates are signed by;
      setting it (or ``tls=True``, the system's roots) makes the channels TLS.
    * ``tls_cert``, ``tls_key`` (``PS_CLIENT_TLS_CERT``, ``PS_CLIENT_TLS_KEY``): this
      client's certificate and key, for shards that require mutual TLS.
    * ``tls``: True makes the channels TLS with the system's root certificates; set by
      itself when ``tls_ca`` or ``tls_cert`` is given.
    * ``token_file`` (``PS_CLIENT_TOKEN_FILE``) or ``token``: the bearer token sent with
      every call. ``token`` is never shown in ``repr``.

    Refusals for load (RESOURCE_EXHAUSTED marked ``ps-overloaded``: a shard at its
    ``--threads`` limit or this client over its share) are retried like UNAVAILABLE.
    """

    deadline_s: float = 60.0
    attempt_timeout_s: float | None = None
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 1.0
    max_attempts: int | None = None
    max_message_bytes: int = 64 << 20
    transport_dtype: TransportDType = "float32"
    push_threads: int = 2
    tune_malloc: bool = True
    hedge_after_s: float | None = None
    eject_after_failures: int = 3
    eject_s: float = 1.0
    eject_max_s: float = 30.0
    membership_refresh_s: float = 1.0
    tls_ca: str | None = field(default_factory=lambda: _env("PS_CLIENT_TLS_CA"))
    tls_cert: str | None = field(default_factory=lambda: _env("PS_CLIENT_TLS_CERT"))
    tls_key: str | None = field(default_factory=lambda: _env("PS_CLIENT_TLS_KEY"))
    tls: bool = False
    token_file: str | None = field(default_factory=lambda: _env("PS_CLIENT_TOKEN_FILE"))
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tls_ca or self.tls_cert:
            object.__setattr__(self, "tls", True)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together (mutual TLS): give both or neither")
        if self.token is not None and self.token_file is not None:
            raise ValueError("token and token_file: give one")
        for name in ("deadline_s", "backoff_initial_s", "backoff_max_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value}: must be a positive number of seconds")
        if self.attempt_timeout_s is None:
            object.__setattr__(self, "attempt_timeout_s", float(self.deadline_s))
        elif not self.attempt_timeout_s > 0:
            raise ValueError(f"attempt_timeout_s={self.attempt_timeout_s}: must be > 0")
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError(
                f"backoff_initial_s={self.backoff_initial_s}: must be <= backoff_max_s={self.backoff_max_s}"
            )
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts}: must be >= 1")
        if not 1 << 16 <= self.max_message_bytes < 2 << 30:
            raise ValueError(f"max_message_bytes={self.max_message_bytes}: must be in [65536, 2 GiB)")
        if self.transport_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"transport_dtype={self.transport_dtype!r}: expected float32, float16 or bfloat16")
        if self.push_threads < 1:
            raise ValueError(f"push_threads={self.push_threads}: must be >= 1")
        if self.hedge_after_s is not None and not (math.isfinite(self.hedge_after_s) and self.hedge_after_s > 0):
            raise ValueError(f"hedge_after_s={self.hedge_after_s}: must be None (no hedging) or a positive number")
        if self.eject_after_failures < 1:
            raise ValueError(f"eject_after_failures={self.eject_after_failures}: must be >= 1")
        for name in ("eject_s", "eject_max_s", "membership_refresh_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value}: must be a positive number of seconds")
        if self.eject_s > self.eject_max_s:
            raise ValueError(f"eject_s={self.eject_s}: must be <= eject_max_s={self.eject_max_s}")

    def caller_security(self) -> CallerSecurity:
        """The TLS credentials and token these settings present (read from their files now);
        ``ValueError`` naming a file that cannot be used."""
        return caller_security(
            tls=self.tls,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            token=self.token,
            token_file=self.token_file,
        )


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


@dataclass(frozen=True)
class TableConfig:
    """A table as the cluster created it, every default filled in by the shards."""

    name: str
    dim: int
    seed: int
    initializer: str
    optimizer: str
    initializer_params: Mapping[str, float] = field(default_factory=dict)
    optimizer_params: Mapping[str, float] = field(default_factory=dict)
    serving_default: str = "zeros"
    storage_dtype: str = "float32"  # values as stored: float32, bfloat16 or float16
    state_dtype: str = "float32"  # optimizer state as stored: float32 or bfloat16
