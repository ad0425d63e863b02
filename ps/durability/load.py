"""Loading a checkpoint's rows into a running training shard, from a cluster of any size.

``checkpoint_parts`` finds the parts of checkpoint NAME (written by a cluster of ``n``
shards) that may hold keys shard ``index`` of ``m`` owns: its own part when ``n == m`` (a key
stays with the same shard), every part otherwise. Each must lie under this shard's
checkpoint root; a root that all shards share holds every part. ``read_parts`` opens them
read-only and checks that each is the part it claims to be; ``replace_rows`` makes tables'
rows those of the parts that this shard owns under ``protos.keys.shard_of``, chunk by chunk
(``Shard.load_checkpoint`` runs it under the shard's checks and locks).

Example:
    >>> import tempfile
    >>> checkpoint_parts(Path(tempfile.mkdtemp()), "run1", 3, index=0, num_shards=2)
    Traceback (most recent call last):
    ...
    ps.errors.InvalidRequest: LoadCheckpoint: checkpoint 'run1' part shard-00000-of-00003 is not under this shard's ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos.keys import shard_of
from ps.durability.checkpoint import part_name
from ps.errors import InvalidRequest, NotConfigured, ShardError
from ps.store import DataDirError, Rows, Storage
from ps.table import Table, TableSpec, spec_from_proto

__all__ = ["checkpoint_parts", "read_parts", "replace_rows"]

Sources = list[tuple[Storage, dict[str, TableSpec]]]
Changes = Callable[[list[tuple[str, npt.NDArray[np.int64]]]], object]  # the change log's record

SCAN_ROWS = 1 << 16


def checkpoint_parts(root: Path | None, name: str, saved_shards: int, *, index: int, num_shards: int) -> list[Path]:
    """The part directories of checkpoint ``name`` (of ``saved_shards`` shards) that shard
    ``index`` of ``num_shards`` reads. ``NotConfigured`` without a root; ``InvalidRequest``
    naming the first part that is missing, with what to do."""
    if root is None:
        raise NotConfigured(
            f"LoadCheckpoint: shard {index} has no checkpoint root: start it with --checkpoint-root (the root "
            "the checkpoint was written under)"
        )
    if saved_shards < 1:
        raise InvalidRequest(f"LoadCheckpoint: num_shards={saved_shards}: the shard count that wrote it, >= 1")
    if not name or "\0" in name or ".." in Path(name).parts:
        raise InvalidRequest(f"LoadCheckpoint: checkpoint {name[:200]!r}: give its name under the root")
    base = root.resolve()
    folder = (base / (f"{int(name):06d}" if name.isdigit() else name)).resolve()
    if not folder.is_relative_to(base) or folder == base:
        raise InvalidRequest(f"LoadCheckpoint: checkpoint {name!r} is not under this shard's checkpoint root {base}")
    wanted = [index] if saved_shards == num_shards else list(range(saved_shards))
    parts = []
    for i in wanted:
        part = folder / part_name(i, saved_shards)
        if not (part / "db").is_dir():
            shared = (
                ""
                if saved_shards == num_shards
                else f"; loading {saved_shards} shards' checkpoint into {num_shards} needs every part where each "
                "shard reads it: a --checkpoint-root all shards share, or a copy of every part under each root"
            )
            raise InvalidRequest(
                f"LoadCheckpoint: checkpoint {name!r} part {part.name} is not under this shard's checkpoint root "
                f"{base} (looked for {part}/db){shared}"
            )
        parts.append(part)
    return parts


@contextlib.contextmanager
def read_parts(parts: Sequence[Path], saved_shards: int) -> Iterator[Sources]:
    """Each part opened read-only, with the specs of its tables; ``InvalidRequest`` for a part
    that is not what its name says."""
    with contextlib.ExitStack() as stack:
        out = []
        for part in parts:
            try:
                st = stack.enter_context(Storage(part, shard=-1, num_shards=0, read_only=True))
            except DataDirError as exc:
                raise InvalidRequest(f"LoadCheckpoint: cannot read {part}: {exc}") from None
            if part_name(st.shard, st.num_shards) != part.name or st.num_shards != saved_shards:
                raise InvalidRequest(
                    f"LoadCheckpoint: {part} holds shard {st.shard} of {st.num_shards}, not what its name says: "
                    "the checkpoint is damaged"
                )
            specs = {}
            for table, blob in st.specs().items():
                try:
                    specs[table] = spec_from_proto(pb.TableSpec.FromString(blob))
                except (ShardError, ValueError) as exc:
                    raise InvalidRequest(f"LoadCheckpoint: {part}: stored spec of table {table!r}: {exc}") from None
            out.append((st, specs))
        yield out


def replace_rows(
    tables: Mapping[str, Table],
    sources: Sources,
    parts: Sequence[Path],
    *,
    index: int,
    num_shards: int,
    record: Changes,
    install: Callable[[Table, Rows], None],
) -> dict[str, int]:
    """Make each of ``tables``' rows exactly those of ``sources`` (the parts ``read_parts``
    opened) that shard ``index`` of ``num_shards`` owns: check every part's spec of each table
    first (``InvalidRequest`` naming the part and the differences), then drop the table's rows
    and ``install`` the owned ones, a chunk at a time. ``record`` gets every key that changed,
    the dropped ones included. Returns the rows installed per table."""
    for (_, specs), part in zip(sources, parts, strict=True):
        for name, table in tables.items():
            diff = table.spec.differences(specs[name]) if name in specs else []
            if diff:
                raise InvalidRequest(f"LoadCheckpoint: table {name!r} in {part} differs: {'; '.join(diff)}")
    installed = dict.fromkeys(tables, 0)
    for name, table in tables.items():
        dropped = table.remove_where(lambda keys: np.ones(keys.shape[0], bool))
        if dropped.size:
            record([(name, dropped)])
        for storage, specs in sources:
            if name not in specs:
                continue
            for rows in _rows_owned(storage, table.spec, index=index, num_shards=num_shards):
                install(table, rows)
                record([(name, rows.keys.copy())])
                installed[name] += len(rows)
    return installed


def _rows_owned(
    part: Storage, spec: TableSpec, *, index: int, num_shards: int, chunk_rows: int = SCAN_ROWS
) -> Iterator[Rows]:
    """The rows of ``spec``'s table in ``part`` that shard ``index`` of ``num_shards`` owns."""
    for rows in part.table(spec.name, spec.row_format).scan(chunk_rows):
        mine = shard_of(rows.keys, num_shards) == index
        if mine.all():
            yield rows
        elif mine.any():
            yield rows[np.flatnonzero(mine)]
