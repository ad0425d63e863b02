"""Checkpoints of a shard: where the ``Checkpoint`` RPC may write, and writing one.

``write_checkpoint`` writes a consistent cut of a shard's tables: with a data
directory, every table is held (``Table.held``) while its dirty rows and ledger are
flushed and RocksDB takes a checkpoint (hard links) plus ``manifest.json``; without
one, the tables' rows are written into a new data directory at the path.

**Naming.** A checkpoint has a NAME, a directory under the checkpoint root (a relative
path, resolved under the root, or an absolute one below it; a version number ``3`` is
``000003``). Shard ``i`` of ``n`` writes its part to ``NAME/shard-{i:05d}-of-{n:05d}``
(``part_name``), whether the shards share one root (then ``NAME`` holds every part, and
``ps-admin checkpoint`` adds the cluster's ``NAME/manifest.json``) or each has its own
(``<data-dir>/checkpoints`` by default). Without a NAME a shard takes the root's next
version number (``next_version_path``). Every tool speaks NAME: ``AdminClient.checkpoint``,
``ps-admin checkpoint --out``, ``ps-admin serve-from --checkpoint`` and a serving
shard's ``pin`` (``resolve_existing_checkpoint`` finds its part; a directory that is a
shard checkpoint itself, as older versions wrote ``<root>/NNNNNN``, is served as is).

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

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, overload

from google.protobuf import json_format

from ps.durability.rescue import set_lineage
from ps.errors import InvalidRequest, NotConfigured
from ps.store import FORMAT_VERSION, DataDirError, Storage, StorageFailed, read_manifest, write_manifest
from ps.table import Table, held_tables, spec_to_proto

__all__ = [
    "MAX_PATH_BYTES",
    "checkpoint_root_of",
    "checkpoint_target",
    "copy_checkpoint",
    "next_version_path",
    "part_name",
    "require_root",
    "resolve_checkpoint_path",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

MAX_PATH_BYTES = 4095  # PATH_MAX (4096) less the terminating NUL
_MAX_NAME_BYTES = 255  # NAME_MAX


@overload
def checkpoint_root_of(data_dir: Path, given: Path | None = None) -> Path: ...


@overload
def checkpoint_root_of(data_dir: Path | None, given: Path | None = None) -> Path | None: ...


def checkpoint_root_of(data_dir: Path | None, given: Path | None = None) -> Path | None:
    """Where a shard's checkpoints go (absolute): ``given`` (``--checkpoint-root``), else
    next to its data, ``DATA_DIR/checkpoints``, where a checkpoint is hard links; None
    without either (checkpoints are refused)."""
    root = given if given is not None else data_dir / "checkpoints" if data_dir is not None else None
    return Path(root).absolute() if root is not None else None


def part_name(shard: int, num_shards: int) -> str:
    """The directory of shard ``shard``'s part inside a checkpoint: ``shard-00001-of-00004``."""
    return f"shard-{shard:05d}-of-{num_shards:05d}"


def resolve_checkpoint_path(root: Path | None, requested: str, shard: int, *, part: str | None = None) -> Path:
    """The absolute directory to write the checkpoint ``requested`` to (it does not exist yet);
    with ``part``, the directory ``part`` inside it (``requested`` may exist then: another
    shard sharing the root wrote its part there, but it must not be a shard checkpoint).

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
    if part is not None:
        if (target / "db").is_dir():
            raise InvalidRequest(f"Checkpoint: {target} is a shard checkpoint already: choose a new name under {where}")
        target = target / part
    if len(os.fsencode(str(target))) > MAX_PATH_BYTES:
        raise InvalidRequest(f"Checkpoint: path {str(target)[:80]!r}... is over {MAX_PATH_BYTES} bytes under {where}")
    if os.path.lexists(target):
        raise InvalidRequest(f"Checkpoint: path {target} exists: choose a new directory under {where}")
    for parent in reversed(target.relative_to(base).parents):
        above = base / parent
        if os.path.lexists(above) and not above.is_dir():
            raise InvalidRequest(f"Checkpoint: {above} is not a directory (in path {requested!r} under {where})")
    return target


def checkpoint_target(root: Path | None, name: str | Path | None, shard: int, num_shards: int) -> Path:
    """Where shard ``shard`` of ``num_shards`` writes its part of the checkpoint ``name``
    (None or "": the root's next version number): ``resolve_checkpoint_path`` of ``name``
    with ``part_name``. Raises as that does."""
    if name is None or str(name) == "":
        name = next_version_path(require_root(root, shard).resolve())
    return resolve_checkpoint_path(root, str(name), shard, part=part_name(shard, num_shards))


def resolve_existing_checkpoint(root: Path | None, requested: str, shard: int, num_shards: int) -> Path:
    """This shard's part of the checkpoint ``requested``, for reading: a name under ``root``
    (a version number "3" is ``000003``) or an absolute path below it, whose
    ``part_name(shard, num_shards)`` holds the part; or a directory that is a shard
    checkpoint itself (``db/`` and ``manifest.json``).

    Raises ``NotConfigured`` without a root, ``InvalidRequest`` naming the path when it
    is outside the root or holds no checkpoint of this shard, listing the names there.
    """
    if root is None:
        raise NotConfigured(
            f"ServeFrom: shard {shard} has no checkpoint root: start it with --checkpoint-root set to its "
            "training shard's (by default that shard's <data-dir>/checkpoints)"
        )
    base = root.resolve()
    if "\0" in requested or not requested:
        raise InvalidRequest(f"checkpoint {requested[:200]!r}: give a checkpoint name, number or a path under {base}")
    name = f"{int(requested):06d}" if requested.isdigit() else requested
    try:
        target = (base / name).resolve()
    except (OSError, RuntimeError) as exc:
        raise InvalidRequest(f"checkpoint {requested!r} cannot be resolved under {base}: {exc}") from None
    if not target.is_relative_to(base):
        raise InvalidRequest(f"checkpoint {requested!r} is not under this shard's checkpoint root {base}")
    for candidate in (target / part_name(shard, num_shards), target):
        if (candidate / "db").is_dir() and (candidate / "manifest.json").is_file():
            return candidate
    names = sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
    raise InvalidRequest(
        f"checkpoint {requested!r}: {target} holds no checkpoint of shard {shard} of {num_shards} "
        f"({part_name(shard, num_shards)}/ with db/ and manifest.json); checkpoints under {base}: "
        f"{', '.join(names[-20:]) or 'none'} (a serving shard reads checkpoints under its --checkpoint-root: "
        "its training shard's root, by default that shard's <data-dir>/checkpoints)"
    )


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


def write_checkpoint(
    path: Path,
    tables: list[Table],
    storage: Storage | None,
    *,
    shard: int,
    num_shards: int,
    data_dir_failed: Callable[[StorageFailed], None],
    name: str | None = None,
    lineage: str = "",
) -> dict[str, Any]:
    """Write a consistent checkpoint of ``tables`` at ``path`` (from
    ``resolve_checkpoint_path``: absolute, not existing) and return its manifest.

    With ``storage`` (the shard's data directory) pushes wait while the tables are held,
    flushed and checkpointed; a flush that fails calls ``data_dir_failed`` (the data
    directory itself refused a write) before ``StorageFailed`` is raised. Without, the
    rows in RAM are written into a new data directory at ``path``. Raises
    ``StorageFailed`` when the checkpoint cannot be written; nothing is left at ``path``
    then. ``name``: the checkpoint's name, the manifest's ``version`` (default ``path.name``).
    ``lineage``: the shard's (``Shard.lineage``), noted in the manifest; a RocksDB checkpoint
    carries the data dir's own, and the data directory written without one gets it stored.

    The manifest: ``format``, ``shard``, ``num_shards``, ``version``, ``created_unix_s``,
    ``created``, ``lineage``, ``tables`` (specs), ``rows`` (table -> rows) and
    ``rows_estimated`` (table -> whether its count is RocksDB's estimate, as in ``Stats``:
    the table was reopened from disk).
    """
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "shard": shard,
        "num_shards": num_shards,
        "version": path.name if name is None else name,
        "created_unix_s": time.time(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "lineage": lineage,
        "tables": [json_format.MessageToDict(spec_to_proto(t.spec)) for t in tables],
    }
    existed = os.path.lexists(path)
    try:
        if storage is None:
            manifest["rows"] = _write_ram_tables(path, tables, shard, num_shards, lineage)
            manifest["rows_estimated"] = dict.fromkeys(manifest["rows"], False)
            write_manifest(path, manifest)
        else:
            with held_tables(tables) as held:
                for h in held:
                    try:
                        h.flush(metadata=True)
                    except StorageFailed as exc:
                        data_dir_failed(exc)
                        raise
                manifest["rows"] = {h.spec.name: h.rows for h in held}
                # As Stats' rows_estimated: a table reopened from disk counts its rows there
                # from RocksDB's estimate, so its count is approximate from then on.
                manifest["rows_estimated"] = {h.spec.name: h.rows_estimated for h in held}
                # A checkpoint directory that cannot be written is not the data dir failing.
                storage.checkpoint(path, manifest)
    except BaseException:
        if not existed and os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
        raise
    log.info("checkpoint written path=%s tables=%d", path, len(tables))
    return manifest


def _write_ram_tables(path: Path, tables: list[Table], shard: int, num_shards: int, lineage: str) -> dict[str, int]:
    """Write the tables of a shard without a data directory into a new one at ``path``
    (with the shard's ``lineage``, if any); returns rows written per table."""
    rows: dict[str, int] = {}
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        raise StorageFailed(f"cannot create checkpoint directory {path}: {exc.strerror}") from None
    with Storage(path, shard=shard, num_shards=num_shards) as out:
        if lineage:
            set_lineage(out, lineage)
        for t in tables:
            out.save_spec(t.spec.name, spec_to_proto(t.spec).SerializeToString())
            target = out.table(t.spec.name, t.spec.row_format)
            rows[t.spec.name] = t.write_to(target, out)
        out.flush_memtables()
    (path / "ps.lock").unlink(missing_ok=True)
    return rows


def copy_checkpoint(checkpoint: Path, data_dir: Path) -> None:
    """Make ``data_dir`` start from ``checkpoint``: its ``db/`` is hard-linked (copied where
    links are impossible) into ``data_dir/db``. ``DataDirError`` if ``data_dir`` has data."""
    checkpoint, data_dir = Path(checkpoint), Path(data_dir)
    read_manifest(checkpoint)
    if (data_dir / "db").exists():
        raise DataDirError(
            f"--restore-from {checkpoint}: data dir {data_dir} already has a db/: restore into an empty "
            "--data-dir (or remove its db/ to overwrite it)"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = data_dir / f".db.restore.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)

    def link_or_copy(src: str, dst: str) -> None:
        # RocksDB never modifies an SST file once written, so sharing one by hard link is
        # safe; the WAL and MANIFEST may be appended to, so those are copied.
        if src.endswith(".sst"):
            with contextlib.suppress(OSError):
                os.link(src, dst)
                return
        shutil.copy2(src, dst)

    shutil.copytree(checkpoint / "db", tmp, copy_function=link_or_copy)
    tmp.rename(data_dir / "db")
    log.info("restored %s into %s at %s", checkpoint, data_dir, time.strftime("%Y-%m-%dT%H:%M:%S"))
