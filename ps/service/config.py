"""``ServerConfig``: what one ``ps-server`` process is started with, and its loader.

Each ``ServerConfig`` field has three spellings derived from its name:
``max_message_bytes`` <-> ``--max-message-bytes`` <-> ``PS_MAX_MESSAGE_BYTES``, and the
same name as a key in a ``--config`` file (TOML or JSON). Precedence: defaults <
config file < environment < flags. Unknown file keys and unknown ``PS_*`` variables
are errors that list the valid names.

Example:
    >>> cfg = load_config(["--shard=1", "--num-shards=2"], {"PS_THREADS": "4"})
    >>> (cfg.shard, cfg.num_shards, cfg.threads)
    (1, 2, 4)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from protos.rpc import settings
from protos.rpc.settings import ConfigError
from ps.durability import Durability
from ps.shard import check_budget
from ps.store import precision
from ps.table import (
    EVICTIONS,
    LFU_HALF_LIFE_S,
)

__all__ = ["ServerConfig", "build_parser", "load_config"]

ENV_PREFIX = "PS_"
SERVE_DRAIN_S = 5.0
"""A serving shard's default ``--drain-s``: clients re-check replicas' health every second
(``ClientConfig.membership_refresh_s``), and DNS-based ones re-resolve names as often."""
# What ``ps-admin`` reads (``--addresses``): a shell that exports it for ps-admin starts
# ps-server with it too.
ADMIN_VARIABLES = ("PS_ADDRESSES",)


@dataclass(frozen=True)
class ServerConfig:
    """Everything one ``ps-server`` process is started with (immutable)."""

    shard: int = field(
        default=0,
        metadata={
            "help": "index of this shard, in [0, num_shards); an index past the end starts a spare shard that "
            "owns no keys until `ps-admin scale` takes it in"
        },
    )
    num_shards: int = field(default=1, metadata={"help": "number of shards in the cluster"})
    listen: str = field(default="127.0.0.1:0", metadata={"help": "HOST:PORT to listen on; port 0 picks a free port"})
    port_file: Path | None = field(
        default=None,
        metadata={"help": "once serving, write the real port to this file (atomically: temp file + rename)"},
    )
    threads: int = field(
        default=16,
        metadata={
            "help": "calls handled at once; one more gets RESOURCE_EXHAUSTED at once (clients retry it with "
            "backoff). Health checks never wait: spare threads answer them and refusals"
        },
    )
    max_calls_per_client: int = field(
        default=0,
        metadata={"help": "calls one client connection may have in flight; 0: three quarters of --threads"},
    )
    max_follow_streams: int = field(
        default=8,
        metadata={"help": "Follow streams (serving shards following this one) open at once, beside --threads"},
    )
    max_keys_per_request: int = field(
        default=4_000_000,
        metadata={"help": "keys one Lookup or Push may carry (all tables); more get RESOURCE_EXHAUSTED"},
    )
    max_tables: int = field(
        default=256, metadata={"help": "tables this shard may hold; CreateTable beyond it gets RESOURCE_EXHAUSTED"}
    )
    metrics_port: int | None = field(
        default=None,
        metadata={
            "help": "serve Prometheus metrics at http://HOST:PORT/metrics (HOST of --listen); "
            "0 picks a free port (logged)"
        },
    )
    tls_cert: Path | None = field(default=None, metadata={"help": "PEM certificate chain: serve TLS (with --tls-key)"})
    tls_key: Path | None = field(default=None, metadata={"help": "PEM private key of --tls-cert"})
    tls_client_ca: Path | None = field(
        default=None, metadata={"help": "PEM CA: clients must present a certificate it signed (mutual TLS)"}
    )
    auth_token_file: Path | None = field(
        default=None,
        metadata={
            "help": "file of 'ROLE TOKEN' lines, each token at least 16 characters and listed once; calls need "
            "'authorization: Bearer TOKEN' metadata; health checks need none. ROLE: read (look up without "
            "creating rows, list tables, stats, follow), write (what a trainer needs: also create rows and "
            "tables, push) or admin (also checkpoint, serve-from)"
        },
    )
    client_tls_ca: Path | None = field(
        default=None,
        metadata={"help": "--follow and reshards over TLS: PEM CA that signed the other shards' certificates"},
    )
    client_tls_cert: Path | None = field(
        default=None, metadata={"help": "--follow and reshards with mutual TLS: this shard's client certificate (PEM)"}
    )
    client_tls_key: Path | None = field(default=None, metadata={"help": "PEM private key of --client-tls-cert"})
    client_token_file: Path | None = field(
        default=None,
        metadata={
            "help": "--follow and reshards: file holding the bearer token this shard sends the shard it follows, or pulls moving rows from (a write token)"
        },
    )
    reshard_settle_s: float = field(
        default=120.0,
        metadata={
            "help": "after a live reshard commits, seconds during which pushes planned before it may still arrive "
            "(clients retry for their deadline, 60 s by default); a new owner keeps the push ledgers of the keys "
            "that came apart that long, and a next reshard waits for it"
        },
    )
    health_window_s: float = field(
        default=60.0,
        metadata={
            "help": "embedding health: how often each table's resident rows are scanned (rows touched in the "
            "window, idle times), and the window its push samples are reported over; 0 turns health off"
        },
    )
    max_message_bytes: int = field(
        default=64 << 20,
        metadata={"help": "largest request or response in bytes; larger ones get RESOURCE_EXHAUSTED"},
    )
    grace_s: float = field(
        default=10.0,
        metadata={
            "help": "on SIGTERM, seconds to let in-flight calls finish, then (if the data dir refuses the "
            "final write) seconds to keep retrying it before saving a rescue dump"
        },
    )
    drain_s: float | None = field(
        default=None,
        metadata={
            "help": "on SIGTERM, seconds to report NOT_SERVING (health) while still answering every call, so that "
            "clients and load balancers move to other replicas first; then --grace-s. SIGINT skips it. "
            "Unset: 5 in serve mode, 0 in train mode (a training shard has no replica to move to)"
        },
    )
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    data_dir: Path | None = field(
        default=None,
        metadata={
            "help": "directory for RocksDB (cold rows, table specs, push ledgers) and checkpoints; "
            "without it everything lives in RAM and is lost at exit"
        },
    )
    disk_compression: str = field(
        default="none",
        metadata={
            "help": "block compression of the rows in RocksDB: none, lz4 or zstd (Stats disk_bytes shows the effect; "
            "files written before a change keep theirs)"
        },
    )
    memory_budget_bytes: int = field(
        default=0,
        metadata={
            "help": "RAM for rows (values, optimizer state, index, admission counters); above it rows "
            "move to RocksDB, in --eviction order. 0: no limit. Needs --data-dir"
        },
    )
    eviction: str = field(
        default="lfu",
        metadata={
            "help": "which rows leave RAM first over --memory-budget-bytes: lfu (the least often looked up, "
            f"counts halving every {LFU_HALF_LIFE_S // 60} idle minutes) or lru (the least recently used)"
        },
    )
    durability: str = field(
        default="interval:5",
        metadata={"help": "every-push, interval:SECONDS or checkpoint-only (see README: Durability)"},
    )
    restore_from: Path | None = field(
        default=None,
        metadata={
            "help": "start from this checkpoint directory (copied into an empty DATA_DIR first), or "
            "apply this rescue dump (left by a shard that stopped while its disk refused writes) to "
            "DATA_DIR, once; a dump is refused if a shard has written DATA_DIR since it was saved "
            "(its rows could be older). A start applies such a dump by itself when it finds it in the "
            "rescue places (see --rescue-dir)"
        },
    )
    rescue_dir: Path | None = field(
        default=None,
        metadata={
            "help": "where a shard that must stop while DATA_DIR refuses writes (disk full) saves the "
            "acknowledged updates it could not write (a rescue dump); put it on another volume than "
            "DATA_DIR. Tried first, then CHECKPOINT_ROOT, then beside DATA_DIR. A start looks for dumps "
            "of DATA_DIR in the same places: one not applied yet is applied before the shard serves, "
            "or the start is refused with a message saying what to do"
        },
    )
    discard_rescue: Path | None = field(
        default=None,
        metadata={
            "help": "give up the rescue dump at this path: its acknowledged updates are never applied to "
            "DATA_DIR, and starts no longer refuse because of it (the dump stays on disk)"
        },
    )
    checkpoint_root: Path | None = field(
        default=None,
        metadata={
            "help": "the Checkpoint RPC writes only under this directory: a checkpoint NAME (relative: resolved "
            "under it; absolute: must lie below it) gets this shard's part in NAME/shard-IIIII-of-NNNNN. Unset: "
            "DATA_DIR/checkpoints, and with no data dir checkpoints are refused. A serving shard reads the "
            "checkpoints serve-from names here: give it its training shard's root. A shard that stops with "
            "updates its disk refused leaves a rescue dump here if --rescue-dir cannot take it"
        },
    )
    mode: str = field(
        default="train",
        metadata={
            "help": "train: lookups create rows, pushes update them. serve: read-only (every write gets "
            "FAILED_PRECONDITION); unknown keys read as zeros and nothing is stored; rows come from "
            "--data-dir (a data dir or a checkpoint, opened read-only) or from --follow"
        },
    )
    serve_dtype: str = field(
        default="stored",
        metadata={
            "help": "serve mode: hold the rows as int8 (row-wise, a scale and a bias per row, no optimizer "
            "state), float32, bfloat16 or float16; stored: as the training table stores them. Tables taken from "
            "--follow are created so (an existing --data-dir of a follower keeps its tables' type); a --data-dir "
            "served as it is and a pinned checkpoint (ps-admin serve-from) are converted as they open, into RAM"
        },
    )
    follow: str | None = field(
        default=None,
        metadata={
            "help": "serve mode: HOST:PORT of the training shard (same --shard) whose changes this shard "
            "streams and applies, seconds fresh; with --data-dir the copy is kept there (its own directory)"
        },
    )
    published_only: bool = field(
        default=False,
        metadata={
            "help": "serve mode with --follow: apply the training shard's changes only at its publications (what "
            "the online trainer publishes when a window passes its guards), all at once; until then serve the "
            "publication before. ps-admin rollback goes back one (docs/guides/online.md)"
        },
    )
    serving_peers: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "serve mode with --follow: the other replicas of this serving shard, HOST:PORT or dns:HOST:PORT "
            "(every address the name resolves to, e.g. the shard's headless Service), comma-separated. Asked for "
            "their serving map at start and every 5 s: a replica started after a live reshard routes by it too"
        },
    )
    follow_history_keys: int = field(
        default=4_000_000,
        metadata={
            "help": "train mode: changed keys remembered for followers (8 bytes each); a follower further "
            "behind than this is sent a full snapshot instead"
        },
    )

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ConfigError(f"num_shards={self.num_shards}: must be >= 1")
        if self.mode not in ("train", "serve"):
            raise ConfigError(f"mode={self.mode!r}: expected train or serve")
        if self.follow is not None and self.mode != "serve":
            raise ConfigError("follow needs mode=serve: only a serving shard follows a training shard")
        if self.mode == "serve" and self.follow is None and self.data_dir is None:
            raise ConfigError(
                "mode=serve needs data_dir (a data dir or checkpoint to serve) or follow (a training shard)"
            )
        if self.serving_peers and self.follow is None:
            raise ConfigError("serving_peers needs mode=serve and follow: the peers are replicas of a following shard")
        for peer in self.serving_peers:
            host, sep, port = peer.removeprefix("dns:").rpartition(":")
            if not (host and sep and port.isdigit() and 0 < int(port) <= 65535):
                raise ConfigError(f"serving_peers: {peer!r} is not HOST:PORT or dns:HOST:PORT")
        if self.mode == "serve" and self.restore_from is not None:
            raise ConfigError(
                "restore_from is for training shards; serve a checkpoint with --mode serve --data-dir CHECKPOINT"
            )
        if self.follow_history_keys < 1:
            raise ConfigError(f"follow_history_keys={self.follow_history_keys}: must be >= 1")
        if self.shard < 0:
            raise ConfigError(f"shard={self.shard}: must be >= 0")
        if self.threads < 1:
            raise ConfigError(f"threads={self.threads}: must be >= 1")
        if self.max_calls_per_client < 0 or self.max_keys_per_request < 1 or self.max_tables < 1:
            raise ConfigError("max_calls_per_client must be >= 0, max_keys_per_request and max_tables >= 1")
        if self.max_follow_streams < 1:
            raise ConfigError(f"max_follow_streams={self.max_follow_streams}: must be >= 1")
        if (self.client_tls_cert is None) != (self.client_tls_key is None):
            raise ConfigError("client_tls_cert and client_tls_key go together: give both or neither")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port={self.metrics_port}: must be in [0, 65535]")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together: give both (TLS) or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca needs tls_cert and tls_key: mutual TLS is TLS first")
        if not 1 << 16 <= self.max_message_bytes <= (2 << 30) - 1:
            raise ConfigError(f"max_message_bytes={self.max_message_bytes}: must be in [65536, 2 GiB)")
        if not (math.isfinite(self.grace_s) and self.grace_s >= 0):
            raise ConfigError(f"grace_s={self.grace_s}: must be a finite number >= 0")
        if self.drain_s is None:
            object.__setattr__(self, "drain_s", SERVE_DRAIN_S if self.mode == "serve" else 0.0)
        elif not (math.isfinite(self.drain_s) and self.drain_s >= 0):
            raise ConfigError(f"drain_s={self.drain_s}: must be a finite number >= 0")
        if not (math.isfinite(self.reshard_settle_s) and self.reshard_settle_s >= 0):
            raise ConfigError(f"reshard_settle_s={self.reshard_settle_s}: must be a finite number >= 0")
        if not (math.isfinite(self.health_window_s) and self.health_window_s >= 0):
            raise ConfigError(f"health_window_s={self.health_window_s}: must be a finite number of seconds >= 0")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level={self.log_level!r}: expected DEBUG, INFO, WARNING or ERROR")
        Durability.parse(self.durability)
        try:
            check_budget(self.memory_budget_bytes, self.data_dir is not None)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"eviction={self.eviction!r}: expected one of {', '.join(EVICTIONS)}")
        if self.serve_dtype not in ("stored", *precision.SERVE_TYPES):
            raise ConfigError(f"serve_dtype={self.serve_dtype!r}: expected stored, {', '.join(precision.SERVE_TYPES)}")
        if self.published_only and (self.mode != "serve" or self.follow is None):
            raise ConfigError("published_only needs mode=serve and follow: it gates the changes a follower applies")
        if self.serve_dtype != "stored" and self.mode != "serve":
            raise ConfigError(
                f"serve_dtype={self.serve_dtype!r} needs mode=serve: a training shard stores its spec's type"
            )
        if self.disk_compression not in ("none", "lz4", "zstd"):
            raise ConfigError(f"disk_compression={self.disk_compression!r}: expected none, lz4 or zstd")
        if self.restore_from is not None and self.data_dir is None:
            raise ConfigError("restore_from needs data_dir: the checkpoint is copied into it")
        if self.discard_rescue is not None and self.data_dir is None:
            raise ConfigError("discard_rescue needs data_dir: the data dir records that the dump is given up")
        if self.discard_rescue is not None and self.discard_rescue == self.restore_from:
            raise ConfigError("restore_from and discard_rescue name the same dump: apply it or discard it, not both")
        for name in (
            "data_dir",
            "checkpoint_root",
            "restore_from",
            "rescue_dir",
            "discard_rescue",
            "port_file",
            "tls_cert",
            "tls_key",
            "tls_client_ca",
            "auth_token_file",
            "client_tls_ca",
            "client_tls_cert",
            "client_tls_key",
            "client_token_file",
        ):
            value = getattr(self, name)
            if value is not None and "\0" in str(value):
                raise ConfigError(f"{name}={str(value)!r}: contains a NUL byte")
        for name in ("listen", "follow"):
            value = getattr(self, name)
            host, sep, port = (value or "").rpartition(":")
            if value is not None and (not sep or not host or not port.isdigit() or int(port) > 65535):
                raise ConfigError(f"{name}={value!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")


_DESCRIPTION = "One shard of the embedding parameter server."


def build_parser() -> argparse.ArgumentParser:
    """The ``ps-server`` argument parser; one flag per ``ServerConfig`` field plus ``--config``."""
    return settings.build_parser(ServerConfig, ENV_PREFIX, "ps-server", _DESCRIPTION)


def load_config(argv: Sequence[str], environ: Mapping[str, str]) -> ServerConfig:
    """Build a ``ServerConfig`` from flags, ``PS_*`` variables and an optional config file
    (``protos.rpc.settings``).

    Raises ``ConfigError`` naming the setting for unknown names and bad values;
    ``SystemExit`` for ``--help`` and unparsable flags (argparse's behaviour).
    """
    return settings.load_settings(
        ServerConfig, argv, environ, ENV_PREFIX, "ps-server", _DESCRIPTION, others=ADMIN_VARIABLES
    )
