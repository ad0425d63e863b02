"""A user's mistakes in how a training run was asked for, told in one line.

``run_or_explain(fn, config, prog)`` runs ``fn`` and turns a mistake into one line on
stderr and an exit status instead of a traceback: a token the shards refuse (status 2,
naming the role a trainer needs); a schema file with a mistake (naming the key or column),
a data file that does not read as ``--schema`` (naming the schema it reads as, or what the
schema file says of the column), a malformed line (offering ``--bad-lines skip``), ``--device
cuda`` without CUDA, a checkpoint directory of another run, a path that may not be read or written (status 1). Anything else is
a bug or a failure of the cluster and keeps its traceback.

Example:
    >>> from worker.config import TrainerConfig
    >>> user_error(PermissionError(13, "Permission denied", "/data/x.csv"), TrainerConfig())
    'permission denied: /data/x.csv: change its permissions, or pass another --data, --output-dir or --checkpoint-dir'
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from client import PermissionDeniedError, ShardUnavailableError, UnauthenticatedError
from worker.config import SCHEMA_NAMES, TrainerConfig
from worker.data import DataError
from worker.dataset import OneLabelError, schemas_that_fit
from worker.distributed import DeviceError
from worker.resume import CheckpointError
from worker.schemafile import SchemaFileError, load_schema_file

__all__ = ["run_or_explain", "user_error"]

_T = TypeVar("_T")


def user_error(exc: BaseException, config: TrainerConfig) -> str | None:
    """One line saying what to do, for an error that is a mistake in how the run was asked
    for (a data file that does not read as ``--schema``, a malformed line, ``--device cuda``
    without CUDA, a path that may not be read or written); None for any other error, which
    is a bug or a failure of the cluster and keeps its traceback."""
    if isinstance(exc, OneLabelError | SchemaFileError):  # the file reads fine, or the schema file does not
        return str(exc)
    if isinstance(exc, DataError) and config.schema not in SCHEMA_NAMES:
        return _against_schema_file(exc, config.schema)
    if isinstance(exc, DataError):
        if exc.line <= 2:  # the file as a whole, or its first data line, fails: its layout may be another
            others = [n for n in schemas_that_fit(exc.path) if n != config.schema]
            if others:
                detail = str(exc).removeprefix(exc.path).lstrip(":").strip()
                detail = detail if len(detail) <= 120 else detail[:117] + "..."
                where = f"line {detail}" if exc.line else detail
                return (
                    f"{exc.path} does not read as --schema {config.schema} ({where}); it reads as "
                    f"--schema {others[0]}: pass --schema {others[0]}"
                )
            if exc.line == 0:
                return f"{exc}: is --schema {config.schema} the layout of this file?"
        if exc.line:
            return (
                f"{exc}: fix the line, or pass --bad-lines skip to leave malformed lines out (they are counted "
                "and logged)"
            )
        return str(exc)
    if isinstance(exc, DeviceError | CheckpointError):
        return str(exc)
    if isinstance(exc, ShardUnavailableError):
        return (
            f"{exc}: cannot reach the shards; are they running, and can this host dial the addresses given "
            "(--addresses or TRAINER_ADDRESSES; ps-launch --advertise sets the host its workers dial)?"
        )
    if isinstance(exc, PermissionError):
        what = exc.filename if exc.filename is not None else "a file or directory"
        return f"permission denied: {what}: change its permissions, or pass another --data, --output-dir or --checkpoint-dir"
    return None


def _against_schema_file(exc: DataError, path: str) -> str:
    """A data file that does not read as the schema file ``path`` says: the reader's line,
    and what the schema file says of the column (a built-in layout is no likelier to fit)."""
    try:
        about = load_schema_file(path).describe(exc.column) if exc.column else ""
    except SchemaFileError as bad:
        return str(bad)
    said = f" (schema {path}: {about})" if about else f" (schema {path})"
    if exc.line:
        return (
            f"{exc}{said}: fix the line, or pass --bad-lines skip to leave malformed lines out (they are counted "
            "and logged)"
        )
    return f"{exc}{said}"


def run_or_explain(fn: Callable[[], _T], config: TrainerConfig, prog: str) -> _T:
    """``fn()``; a user's mistake ends the process with one line on stderr instead of a
    traceback: status 2 for a token the shards refuse (naming the role a trainer needs),
    1 for the mistakes ``user_error`` knows."""
    try:
        return fn()
    except (UnauthenticatedError, PermissionDeniedError) as exc:
        # Exit 2, as for any other bad setting: the token is one.
        print(
            f"{prog}: {exc} (a trainer needs a write token: point PS_CLIENT_TOKEN_FILE at a file holding one)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(2) from None
    except Exception as exc:
        line = user_error(exc, config)
        if line is None:
            raise
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
