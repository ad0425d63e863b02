"""A shard's data directory as files: who holds it (``ps.lock``), whether it has room,
why RocksDB cannot open in it, and the checkpoint manifests written beside it.
RocksDB itself, inside ``DIR/db``, is ``ps.store.storage``'s.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> write_manifest(d, {"format": FORMAT_VERSION}); read_manifest(d)["format"]
    1
    >>> has_room(d)
    True
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import shutil
from pathlib import Path
from typing import IO

__all__ = [
    "FORMAT_VERSION",
    "DataDirError",
    "has_room",
    "lock_data_dir",
    "open_failure",
    "read_manifest",
    "write_manifest",
]

FORMAT_VERSION = 1
_OPEN_HEADROOM_BYTES = 1 << 20  # new MANIFEST, OPTIONS and WAL files, table file overhead
_ROOM_PROBE_BYTES = 4096  # has_room: a file this big must be writable before RocksDB is reopened


class DataDirError(RuntimeError):
    """The data directory cannot be used (in use by another process, another shard's, bad)."""


class DataDirBusy(DataDirError):
    """Another process has the data directory open (it holds ``ps.lock``)."""


def open_failure(path: Path, exc: Exception, reopening: bool = False) -> str:
    """Why RocksDB in ``path`` cannot be opened; for a write error, how much space it needs."""
    what = "reopen RocksDB for writing" if reopening else "open RocksDB"
    text = f"{path}: cannot {what}: {exc}"
    lowered = str(exc).lower()
    if not any(s in lowered for s in ("no space", "file too large", "quota")):  # ENOSPC, EFBIG, EDQUOT
        return text
    wal = 0
    with contextlib.suppress(OSError):
        wal = sum(f.stat().st_size for f in (path / "db").glob("*.log"))
    need = wal + _OPEN_HEADROOM_BYTES
    free = -1
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(path).free
    text += (
        f". Opening it replays its write-ahead log ({_mib(wal)} in db/*.log) into new table files, which "
        f"needs up to about {_mib(need)} free on its filesystem; {_mib(free) if free >= 0 else 'an unknown amount'} "
        "is free"
    )
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit != resource.RLIM_INFINITY:
        text += f", and this process may not write a file over {_mib(limit)} (RLIMIT_FSIZE, see `ulimit -f`)"
    return text + ". Free space (or raise the limit) and it opens: nothing on disk was lost"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def lock_data_dir(path: Path) -> IO[str]:
    f = (path / "ps.lock").open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise DataDirBusy(
            f"data dir {path} is in use by another process (pid {holder}): stop it first, or give this "
            "shard its own --data-dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def write_manifest(path: Path, manifest: dict[str, object]) -> None:
    """Write ``path/manifest.json`` atomically (temp file + rename)."""
    tmp = path / f".manifest.json.{os.getpid()}.tmp"
    with tmp.open("w") as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())  # its bytes on disk before the rename makes it the manifest
    tmp.replace(path / "manifest.json")


def read_manifest(path: Path) -> dict[str, object]:
    """The manifest of checkpoint directory ``path``; ``DataDirError`` if absent or bad."""
    try:
        data = json.loads((Path(path) / "manifest.json").read_text())
    except FileNotFoundError:
        raise DataDirError(f"{path}: no manifest.json: not a checkpoint directory") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise DataDirError(f"{path}/manifest.json: unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise DataDirError(f"{path}/manifest.json: expected a JSON object")
    return data


def has_room(path: Path) -> bool:
    """Whether a new file of a few KiB can be written and synced in ``path`` now.

    What reopening RocksDB needs (it writes files as it opens, even read-only): while the
    volume is full, a reopen would close the handle that still serves reads and fail to
    open another."""
    probe = path / f".room-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(_ROOM_PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
