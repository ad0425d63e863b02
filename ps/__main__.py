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

import logging
import os
import signal
import sys
from collections.abc import Sequence

from protos.rpc.process import run_server
from protos.rpc.settings import describe_settings
from protos.wire import tune_malloc
from ps.service import PSServer, ServerConfig, build_server, load_config

log = logging.getLogger("ps")


def _start(config: ServerConfig) -> PSServer:
    tune_malloc()
    # Past a file-size limit (RLIMIT_FSIZE) a write should fail with EFBIG, which the
    # storage layer reports, rather than kill the process with SIGXFSZ.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return build_server(config)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ps-server`` console script (``protos.rpc.process.run_server``)."""
    return run_server(
        "ps-server", lambda: load_config(sys.argv[1:] if argv is None else argv, os.environ), _start, describe_settings
    )


if __name__ == "__main__":
    sys.exit(main())
