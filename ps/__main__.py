"""``ps-server``: run one shard until SIGTERM or SIGINT, then drain and exit.

Exit codes:

* 0: stopped cleanly; every acknowledged update is in the data dir.
* 1: the server cannot start (e.g. the address is taken, or the data dir cannot be
  opened; the message says why, and for a full disk how much space it needs).
* 2: a bad setting (the message names it).
* 3: stopped while the data dir refused writes; the acknowledged updates it did not
  take are saved in a rescue dump, which the last log line names. Start the shard
  again on the same ``--data-dir`` (and ``--rescue-dir``) once the disk is fixed: it
  applies the dump before it serves (``--restore-from DUMP`` does the same where the
  dump was moved). Until then a start is refused with exit 1, saying why.
* 4: as 3, but the rescue dump could not be written either (``--rescue-dir`` unset, or
  on the full volume too): those updates are lost.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence

from protos.logs import configure_logging
from protos.servers import settle_heap, stop_on_signals, write_port_file
from protos.wire import tune_malloc
from ps.config import ConfigError, ServerConfig, load_config
from ps.server import build_server

log = logging.getLogger("ps")


def _describe(config: ServerConfig) -> str:
    return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(config).items())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ps-server`` console script."""
    try:
        config = load_config(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as exc:
        print(f"ps-server: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    tune_malloc()
    # Past a file-size limit (RLIMIT_FSIZE) a write should fail with EFBIG, which the
    # storage layer reports, rather than kill the process with SIGXFSZ.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    log.info("starting %s", _describe(config))
    try:
        server = build_server(config)
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1

    stop = stop_on_signals()
    settle_heap()
    if config.port_file is not None:
        write_port_file(config.port_file, server.port)
    log.info("listening shard=%d num_shards=%d port=%d", config.shard, config.num_shards, server.port)
    while not stop.wait(1.0):
        pass
    log.info("shutting down grace_s=%s", config.grace_s)
    report = server.stop(config.grace_s)
    if report.rescue_path is not None:
        log.error("stopped: %d rows saved to rescue dump %s (exit 3)", report.unpersisted_rows, report.rescue_path)
        return 3
    if report.lost:
        log.error("stopped: %d rows not in the data dir are lost (exit 4)", report.unpersisted_rows)
        return 4
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
