"""One shard: its tables by name, its mode, its memory budget, its background work and what it
does while its data dir refuses writes. ``Shard`` composes the other wings; the service
talks to it, one method per RPC.
"""

from __future__ import annotations

from ps.shard.batches import LookupBatch, Mode, PushBatch
from ps.shard.budget import check_budget
from ps.shard.limits import Limits
from ps.shard.shard import Shard

__all__ = ["Limits", "LookupBatch", "Mode", "PushBatch", "Shard", "check_budget"]
