"""``Limits``: what one request may ask of a shard, and how many tables it may hold.

Past a limit the shard answers RESOURCE_EXHAUSTED (``RequestTooLarge``,
``OutOfCapacity``) naming the flag that sets it, before doing any of the work.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ps.errors import OutOfCapacity, RequestTooLarge

__all__ = ["Limits"]


@dataclass(frozen=True)
class Limits:
    """``--max-tables`` and ``--max-keys-per-request`` of a shard (no limit by default)."""

    max_tables: int = 1 << 30
    max_keys_per_request: int = 1 << 62

    def check_keys(self, method: str, counts: Iterable[int]) -> None:
        """Raise ``RequestTooLarge`` when a request carries more keys (all its entries) than allowed."""
        n = sum(counts)
        if n > self.max_keys_per_request:
            raise RequestTooLarge(
                f"{method} carries {n} keys, over this shard's --max-keys-per-request={self.max_keys_per_request}: "
                "send fewer keys per request"
            )

    def check_new_table(self, shard: int, held: int) -> None:
        """Raise ``OutOfCapacity`` when a shard holding ``held`` tables may not create another."""
        if held >= self.max_tables:
            raise OutOfCapacity(
                f"CreateTable refused: shard {shard} holds {held} tables, its limit "
                f"(--max-tables={self.max_tables}); drop the table count or raise the limit"
            )
