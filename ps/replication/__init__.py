"""Serving shards that follow a training shard: the training shard's change log, the stream
it sends (``Follow``), the source a serving shard takes its rows from, and the peers a
serving replica asks for their map.
"""

from __future__ import annotations

from ps.replication.changes import ChangeLog
from ps.replication.follow import Source
from ps.replication.peers import PeerMaps
from ps.replication.stream import follow_batches

__all__ = ["ChangeLog", "PeerMaps", "Source", "follow_batches"]
