"""Row storage and the disk: the ``Rows`` a table's rows travel as, the stored element
types and their rounding (``precision``), and a shard's data directory with RocksDB in it
(``Storage``). Knows nothing of tables, optimizers or the cluster.
"""

from __future__ import annotations

from ps.store import precision
from ps.store.datadir import FORMAT_VERSION, DataDirBusy, DataDirError, read_manifest, write_manifest
from ps.store.precision import bfloat16_bits_to_float32_bits, float16_bits_to_float32_bits
from ps.store.rows import RowFormat, Rows
from ps.store.storage import COMPRESSIONS, Storage, StorageClosed, StorageFailed, TableRows, table_options

__all__ = [
    "COMPRESSIONS",
    "DataDirBusy",
    "DataDirError",
    "FORMAT_VERSION",
    "RowFormat",
    "Rows",
    "Storage",
    "StorageClosed",
    "StorageFailed",
    "TableRows",
    "bfloat16_bits_to_float32_bits",
    "float16_bits_to_float32_bits",
    "precision",
    "read_manifest",
    "table_options",
    "write_manifest",
]
