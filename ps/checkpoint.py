"""Where the ``Checkpoint`` RPC may write: only under the shard's checkpoint root.

A caller names a directory; the shard writes a RocksDB checkpoint there. Left
unchecked, that is a remote "create a directory anywhere this process may write"
primitive, so every requested path goes through ``resolve_checkpoint_path``:

* the shard must have a root (``--checkpoint-root``; by default ``<data-dir>/checkpoints``,
  where the hard links of a checkpoint need no copy; without either, checkpoints are
  refused with FAILED_PRECONDITION);
* a relative path is resolved under the root, never against the working directory;
  an absolute one must lie under the root once symlinks are resolved;
* ``..`` components, NUL bytes, paths longer than ``PATH_MAX`` or with a component
  longer than ``NAME_MAX``, the root itself, an existing path, and a path under
  something that is not a directory are refused with INVALID_ARGUMENT naming the
  root.

Example:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> resolve_checkpoint_path(root, "run1/shard-0", 0) == root.resolve() / "run1" / "shard-0"
    True
    >>> resolve_checkpoint_path(root, "../etc", 0)
    Traceback (most recent call last):
    ...
    ps.errors.InvalidRequest: Checkpoint: path '../etc' has a '..' component: name a directory under this shard's checkpoint root ...
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from ps.errors import InvalidRequest, NotConfigured

__all__ = ["MAX_PATH_BYTES", "next_version_path", "require_root", "resolve_checkpoint_path"]

MAX_PATH_BYTES = 4095  # PATH_MAX (4096) less the terminating NUL
_MAX_NAME_BYTES = 255  # NAME_MAX


def resolve_checkpoint_path(root: Path | None, requested: str, shard: int) -> Path:
    """The absolute directory to write the checkpoint ``requested`` to (it does not exist yet).

    Raises ``NotConfigured`` when ``root`` is None, ``InvalidRequest`` (naming the root)
    for a path that is bad or not under it. Does not create anything.
    """
    base = require_root(root, shard).resolve()
    where = f"this shard's checkpoint root {base}"
    if os.path.lexists(base) and not base.is_dir():
        raise NotConfigured(f"Checkpoint: {where} is not a directory: fix --checkpoint-root")
    if "\0" in requested:
        raise InvalidRequest(f"Checkpoint: path {requested[:200]!r} contains a NUL byte")
    raw = os.fsencode(requested)
    if len(raw) > MAX_PATH_BYTES:
        raise InvalidRequest(f"Checkpoint: path is {len(raw)} bytes long, over the limit of {MAX_PATH_BYTES}")
    parts = PurePosixPath(requested).parts
    if ".." in parts:
        raise InvalidRequest(f"Checkpoint: path {requested!r} has a '..' component: name a directory under {where}")
    long = [p for p in parts if len(os.fsencode(p)) > _MAX_NAME_BYTES]
    if long:
        raise InvalidRequest(f"Checkpoint: path component {long[0][:40]!r}... is over {_MAX_NAME_BYTES} bytes")
    try:
        target = (base / requested).resolve()  # an absolute `requested` replaces base; symlinks are followed
    except (OSError, RuntimeError) as exc:  # a symlink loop, an unreadable component
        raise InvalidRequest(f"Checkpoint: path {requested!r} cannot be resolved under {where}: {exc}") from None
    if not target.is_relative_to(base) or target == base:
        raise InvalidRequest(
            f"Checkpoint: path {requested!r} is not under {where}: give a relative path (resolved under the "
            "root) or an absolute one below it"
        )
    if len(os.fsencode(str(target))) > MAX_PATH_BYTES:
        raise InvalidRequest(f"Checkpoint: path {str(target)[:80]!r}... is over {MAX_PATH_BYTES} bytes under {where}")
    if os.path.lexists(target):
        raise InvalidRequest(f"Checkpoint: path {target} exists: choose a new directory under {where}")
    for parent in reversed(target.relative_to(base).parents):
        above = base / parent
        if os.path.lexists(above) and not above.is_dir():
            raise InvalidRequest(f"Checkpoint: {above} is not a directory (in path {requested!r} under {where})")
    return target


def require_root(root: Path | None, shard: int) -> Path:
    """``root``; ``NotConfigured`` (FAILED_PRECONDITION) if the shard has none."""
    if root is None:
        raise NotConfigured(
            f"Checkpoint: shard {shard} has no checkpoint root: start it with --checkpoint-root DIR "
            "(or with --data-dir, whose checkpoints/ directory is the default root)"
        )
    return root


def next_version_path(root: Path) -> Path:
    """``root/NNNNNN``, one above the highest numbered checkpoint directory in ``root``."""
    versions = [int(p.name) for p in root.glob("[0-9]*") if p.name.isdigit()] if root.is_dir() else []
    return root / f"{max(versions, default=0) + 1:06d}"
