"""Bearer tokens: who may call what, for ``ps-server`` and ``ps-infer``.

A token file holds one token per line as ``ROLE TOKEN`` (blank lines and ``#`` comments
are skipped); a token has at least 16 characters (``MIN_TOKEN_CHARS``) and appears once
in the file. Roles, each allowing what the one before it does:

* ``read``: look rows up without creating any (a key without a row reads as its
  table's default, as on a serving shard), list tables, stats, follow a training
  shard, predict;
* ``write``: what a trainer needs: also look up rows creating the missing ones, push
  gradients, and create tables (an identical existing one is accepted as is; another
  spec under the same name is refused);
* ``admin``: also checkpoint and pin serving shards (``ServeFrom``).

Calls carry ``authorization: Bearer TOKEN`` metadata. Tokens are compared in constant
time (``hmac.compare_digest``) against every known token, so the time taken says nothing
about how much of a token matched. Health checks and reflection need no token.

Example:
    >>> tokens = Tokens.parse("read r-0123456789abcdef\\nadmin a-0123456789abcdef\\n", "tokens.txt")
    >>> tokens.role_of("r-0123456789abcdef"), tokens.role_of("nope")
    ('read', None)
    >>> allows("read", "write")
    False
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MIN_TOKEN_CHARS",
    "ROLES",
    "AuthError",
    "Tokens",
    "allows",
    "bearer_metadata",
    "read_client_token",
]

ROLES = ("read", "write", "admin")
MIN_TOKEN_CHARS = 16
HEADER = "authorization"


class AuthError(ValueError):
    """A token file that cannot be used; the message names the file and line (never a token)."""


def allows(role: str, needed: str) -> bool:
    """Whether ``role`` may do what ``needed`` may."""
    return ROLES.index(role) >= ROLES.index(needed)


@dataclass(frozen=True)
class Tokens:
    """The tokens a server accepts, with their roles."""

    entries: tuple[tuple[bytes, str], ...]

    def __repr__(self) -> str:  # never the tokens themselves
        roles = [role for _, role in self.entries]
        return f"Tokens({', '.join(f'{r}={roles.count(r)}' for r in ROLES if r in roles)})"

    @classmethod
    def parse(cls, text: str, source: str) -> Tokens:
        """The tokens of a token file's ``text`` (``source`` names it in errors). Raises
        ``AuthError`` naming the line (never the token) for a malformed line, a token
        shorter than ``MIN_TOKEN_CHARS``, a token given twice (whatever its roles: which
        one was meant cannot be told), or no token at all."""
        entries: list[tuple[bytes, str]] = []
        lines: list[int] = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or parts[0] not in ROLES:
                raise AuthError(f"{source} line {n}: expected 'ROLE TOKEN' with ROLE one of {', '.join(ROLES)}")
            token, role = parts[1].encode(), parts[0]
            if len(parts[1]) < MIN_TOKEN_CHARS:
                raise AuthError(
                    f"{source} line {n}: {role} token has {len(parts[1])} characters, "
                    f"a token needs at least {MIN_TOKEN_CHARS}"
                )
            for (known, known_role), m in zip(entries, lines, strict=True):
                if hmac.compare_digest(known, token):
                    raise AuthError(
                        f"{source} line {n}: the {role} token of this line is already on line {m} "
                        f"(as {known_role}); give each token once, with one role"
                    )
            entries.append((token, role))
            lines.append(n)
        if not entries:
            raise AuthError(f"{source}: no tokens")
        return cls(tuple(entries))

    @classmethod
    def load(cls, path: Path) -> Tokens:
        try:
            text = path.read_text()
        except OSError as exc:
            raise AuthError(f"token file {path}: {exc.strerror}") from None
        return cls.parse(text, str(path))

    def role_of(self, token: str | bytes) -> str | None:
        """The role of ``token``, None if unknown. Every entry is compared, match or not."""
        given = token.encode() if isinstance(token, str) else token
        found = None
        for known, role in self.entries:
            if hmac.compare_digest(known, given) and found is None:
                found = role
        return found


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an ``authorization: Bearer TOKEN`` entry of call metadata, if any."""
    for key, value in metadata or ():
        if key == HEADER:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (none for None)."""
    return () if token is None else ((HEADER, f"Bearer {token}"),)


def read_client_token(path: str | os.PathLike[str] | None) -> str | None:
    """The token a client sends, read from ``path`` (the whole file, stripped; a line
    ``ROLE TOKEN`` is accepted too, so a server's one-line token file works as is)."""
    if path is None or str(path) == "":
        return None
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise AuthError(f"client token file {path}: {exc.strerror}") from None
    parts = text.split()
    if len(parts) == 2 and parts[0] in ROLES:
        return parts[1]
    if len(parts) != 1:
        raise AuthError(f"client token file {path}: expected one token")
    return parts[0]
