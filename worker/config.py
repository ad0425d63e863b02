"""What a model's embeddings are: tables (created on the shards) and the features that read them.

Example:
    >>> user = EmbeddingTableConfig("user", dim=16, optimizer="adagrad", params={"lr": 0.05})
    >>> FeatureConfig("user_id", table="user", pooling="sum").table
    'user'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

__all__ = ["EmbeddingTableConfig", "FeatureConfig", "Pooling", "check_features", "parse_config"]

Pooling = Literal["sum", "mean", "none"]
_C = TypeVar("_C")


@dataclass(frozen=True)
class EmbeddingTableConfig:
    """A table to create on every shard (see ``PSClient.create_table`` for the options).

    ``optimizer``/``initializer`` None and absent ``params`` take the shards' defaults.
    """

    name: str
    dim: int
    optimizer: str | None = None
    initializer: str | None = None
    seed: int = 0
    params: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim={self.dim}, must be >= 1")


@dataclass(frozen=True)
class FeatureConfig:
    """A sparse input feature: its ids are keys of ``table``; ``pooling`` reduces each bag.

    ``sum``/``mean`` give ``[batch, dim]``; ``none`` gives the unpooled ``[num_ids, dim]`` rows.
    """

    name: str
    table: str
    pooling: Pooling = "sum"

    def __post_init__(self) -> None:
        if self.pooling not in ("sum", "mean", "none"):
            raise ValueError(f"feature {self.name!r}: pooling={self.pooling!r}, expected sum, mean or none")


def check_features(tables: Sequence[EmbeddingTableConfig], features: Sequence[FeatureConfig]) -> None:
    """Raise ``ValueError`` for duplicate names or a feature naming an unknown table."""
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"tables: duplicate names in {names}")
    fnames = [f.name for f in features]
    if len(set(fnames)) != len(fnames):
        raise ValueError(f"features: duplicate names in {fnames}")
    for f in features:
        if f.table not in names:
            raise ValueError(f"feature {f.name!r}: table {f.table!r} is not among the tables {names}")


def parse_config(cls: type[_C], argv: Sequence[str], environ: Mapping[str, str], prefix: str, prog: str) -> _C:
    """Fill the frozen dataclass ``cls`` from flags, ``{prefix}*`` variables and ``--config`` (TOML/JSON).

    Each field ``name`` is ``--name-with-dashes``, ``{prefix}NAME`` and ``name`` in the file;
    precedence defaults < file < environment < flags. Unknown file keys or ``{prefix}*``
    variables raise ``ValueError`` listing the valid names; ``--help`` lists every field
    with its help text (field metadata ``help``). Tuples are comma-separated.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    parser = argparse.ArgumentParser(prog=prog, argument_default=argparse.SUPPRESS,
                                     description=f"Every flag is also {prefix}<NAME> in the environment or "
                                     "a key of the --config file; flags win over the environment, which wins over the file.")  # fmt: skip
    parser.add_argument("--config", type=Path, help="TOML or JSON file of settings")
    for name, f in fields.items():
        default = f.default if f.default is not dataclasses.MISSING else None
        parser.add_argument("--" + name.replace("_", "-"), dest=name, metavar=name.upper(),
                            help=f"{f.metadata.get('help', '')} (default: {default}; env {prefix}{name.upper()})")  # fmt: skip
    args = vars(parser.parse_args(list(argv)))
    values: dict[str, Any] = {}
    path = args.pop("config", None)
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"--config {path}: {exc.strerror}") from None
        data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        for key, raw in data.items():
            if key not in fields:
                raise ValueError(f"--config {path}: unknown setting {key!r}; valid: {', '.join(fields)}")
            values[key] = _convert(key, hints[key], raw)
    for var, raw in environ.items():
        if var.startswith(prefix):
            key = var[len(prefix) :].lower()
            if key not in fields:
                raise ValueError(
                    f"environment: unknown variable {var}; valid: {', '.join(prefix + n.upper() for n in fields)}"
                )
            values[key] = _convert(key, hints[key], raw)
    for key, raw in args.items():
        values[key] = _convert(key, hints[key], raw)
    return cls(**values)


def _convert(name: str, hint: Any, raw: Any) -> Any:
    target = typing.get_origin(hint) or hint
    try:
        if target is tuple:
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            return tuple(str(x).strip() for x in items if str(x).strip())
        if target is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if target is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if target is float:
            return float(raw)
        if target is Path:
            return Path(str(raw))
        return str(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {raw!r} is not a valid {getattr(target, '__name__', target)}") from None
