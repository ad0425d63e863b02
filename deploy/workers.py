"""``python -m deploy.workers TORCHRUN_ARGS``: torchrun that exits with the failing worker's status.

``ps-launch`` runs its workers through this instead of ``torch.distributed.run`` itself,
which turns any worker failure into exit status 1 and a page-long traceback of its
own. Here the first failing worker's exit status becomes the exit status (128 + N for
signal N), and the failure is summarised in one line: the worker's own traceback is
already above it, and an entry point decorated with torchelastic's ``record`` (as the
trainer's are) puts its error message in that line too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

__all__ = ["main"]


def _first_line(message: object, limit: int = 400) -> str:
    if isinstance(message, dict):  # torchelastic's error-file payload
        message = message.get("message", "")
    line = next((x.strip() for x in str(message).splitlines() if x.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv``; returns the first failing worker's exit status (0 if none failed)."""
    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))  # type: ignore[no-untyped-call]
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        message = _first_line(failure.message) if os.path.isfile(failure.error_file) else ""
        how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with status {code}"
        others = len(exc.failures) - 1
        print(
            f"ps-launch: worker rank {rank} (pid {failure.pid}) {how}"
            + (f": {message}" if message else "")
            + (f" ({others} other workers failed too)" if others > 0 else ""),
            file=sys.stderr,
            flush=True,
        )
        return code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
