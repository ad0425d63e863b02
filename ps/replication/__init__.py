"""Serving shards that follow a training shard: the training shard's change log, the stream
it sends (``Follow``), its publications (what ``--published-only`` serving shards move to),
the source a serving shard takes its rows from, and the peers a serving replica asks for
their map.
"""

from __future__ import annotations

from ps.replication.changes import ChangeLog
from ps.replication.follow import Source
from ps.replication.peers import PeerMaps
from ps.replication.publish import DEFAULT_WAIT_S, Held, Publications
from ps.replication.stream import follow_batches

__all__ = ["ChangeLog", "DEFAULT_WAIT_S", "Held", "PeerMaps", "Publications", "Source", "follow_batches"]
