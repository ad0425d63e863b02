"""Keeping a shard's rows through crashes and stops: when acknowledged pushes reach disk
(``Durability``), checkpoints of a consistent cut (and loading one into a running shard,
from a cluster of any size), rescue dumps of what a stop could not write, and erasing rows from all of them.
"""

from __future__ import annotations

from ps.durability.checkpoint import (
    checkpoint_root_of,
    checkpoint_target,
    copy_checkpoint,
    part_name,
    resolve_existing_checkpoint,
    write_checkpoint,
)
from ps.durability.erasure import (
    PendingErase,
    close_erase,
    erase_data_done,
    erase_from_checkpoints,
    find_in_checkpoints,
    journal_erase,
    parts_under,
    pending_erasures,
)
from ps.durability.load import checkpoint_parts, read_parts, replace_rows
from ps.durability.modes import Durability
from ps.durability.rescue import (
    RescueBase,
    StopReport,
    apply_rescue,
    begin_epoch,
    dump_places,
    dumps_of,
    erase_from_dumps,
    find_in_dumps,
    is_rescue_dump,
    read_base,
    rows_at_risk,
    save_rescue,
    settle_dumps,
)

__all__ = [
    "Durability",
    "PendingErase",
    "RescueBase",
    "StopReport",
    "apply_rescue",
    "begin_epoch",
    "checkpoint_parts",
    "checkpoint_root_of",
    "checkpoint_target",
    "close_erase",
    "copy_checkpoint",
    "dump_places",
    "dumps_of",
    "erase_data_done",
    "erase_from_checkpoints",
    "erase_from_dumps",
    "find_in_checkpoints",
    "find_in_dumps",
    "is_rescue_dump",
    "journal_erase",
    "part_name",
    "parts_under",
    "pending_erasures",
    "read_base",
    "read_parts",
    "replace_rows",
    "resolve_existing_checkpoint",
    "rows_at_risk",
    "save_rescue",
    "settle_dumps",
    "write_checkpoint",
]
