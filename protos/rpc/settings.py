"""Settings of every command, read one way: a frozen dataclass, three spellings a field.

``ps-server``, ``ps-infer`` and the trainer each describe their settings as one frozen
dataclass. ``load_settings`` fills it: a field ``memory_budget_bytes`` is the flag
``--memory-budget-bytes``, the variable ``{prefix}MEMORY_BUDGET_BYTES`` and the key
``memory_budget_bytes`` of a ``--config`` file (TOML, or JSON for a ``.json`` name; the
file may also be named by ``{prefix}CONFIG``). Precedence: defaults < file <
environment < flags. A field's help text is its metadata ``help``.

Every mistake is a ``ConfigError`` whose message names where the bad value came from
and what would be valid: an unknown key in the file or an unknown ``{prefix}*``
variable (listing the valid names), a value of the wrong type, a file that does not
parse. ``--help`` and flags argparse cannot parse exit as argparse does.

Values: ``int`` (also ``0x``-hex and ``1_000``), ``float``, ``bool`` (1/0, true/false,
yes/no, on/off), ``str``, ``Path``, ``tuple`` (comma-separated), and ``X | None`` (an
empty value is None).

Example:
    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True)
    ... class DemoConfig:
    ...     threads: int = 2
    ...     tags: tuple[str, ...] = ()
    >>> load_settings(DemoConfig, ["--tags=a,b"], {"DEMO_THREADS": "4"}, "DEMO_", "demo")
    DemoConfig(threads=4, tags=('a', 'b'))
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
import tomllib
import typing
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["ConfigError", "build_parser", "load_settings"]

_C = TypeVar("_C")


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it and where it came from."""


def build_parser(cls: type[Any], prefix: str, prog: str, description: str = "") -> argparse.ArgumentParser:
    """The argument parser of ``cls``: one flag per field, plus ``--config``."""
    where = textwrap.fill(
        f"Every flag is also {prefix}<NAME> in the environment (--some-flag: {prefix}SOME_FLAG) "
        "or a key of the --config file (some_flag = ...). Flags win over the environment, "
        "which wins over the file.",
        79,
    )
    parser = argparse.ArgumentParser(
        prog=prog,
        argument_default=argparse.SUPPRESS,
        description=f"{description}\n\n{where}" if description else where,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, help=f"TOML (or .json) file of settings (env {prefix}CONFIG)")
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = str(f.metadata.get("help", "")).replace("%", "%%")
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            metavar=f.name.upper(),
            help=f"{help_text} (default: {default}; env {prefix}{f.name.upper()})",
        )
    return parser


def load_settings(
    cls: type[_C],
    argv: Sequence[str],
    environ: Mapping[str, str],
    prefix: str,
    prog: str,
    description: str = "",
    *,
    others: Collection[str] = (),
) -> _C:
    """``cls`` filled from ``argv``, the ``{prefix}*`` variables of ``environ`` and a
    ``--config`` file (see the module docstring). ``others``: variables with the prefix
    that belong to another command (one shell may export both), skipped rather than
    refused. Raises ``ConfigError``; ``SystemExit`` for ``--help`` and unparsable flags."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    args = vars(build_parser(cls, prefix, prog, description).parse_args(list(argv)))
    values: dict[str, Any] = {}

    config_path = args.pop("config", None) or environ.get(prefix + "CONFIG")
    if config_path:
        path = Path(config_path)
        for key, raw in _read_file(path).items():
            if key not in hints or key not in names:
                raise ConfigError(f"--config {path}: unknown setting {key!r}; valid: {', '.join(names)}")
            values[key] = _convert(key, hints[key], raw, f"--config {path}")

    for var, raw in environ.items():
        if not var.startswith(prefix) or var == prefix + "CONFIG" or var in others:
            continue
        key = var[len(prefix) :].lower()
        if key not in names:
            valid = ", ".join(prefix + n.upper() for n in [*names, "config"])
            raise ConfigError(f"environment: unknown variable {var}; valid: {valid}")
        values[key] = _convert(key, hints[key], raw, f"environment {var}")

    for key, raw in args.items():
        values[key] = _convert(key, hints[key], raw, "--" + key.replace("_", "-"))

    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a table of settings at the top level")
    return data


def _convert(name: str, hint: Any, raw: Any, source: str) -> Any:
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return None
        hint = next(a for a in args if a is not type(None))
    target = typing.get_origin(hint) or hint
    type_name = getattr(target, "__name__", str(target))
    if raw is None:
        raise ConfigError(f"{source}: {name} needs a value of type {type_name}, got None")
    try:
        if target is tuple:
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            return tuple(str(x).strip() for x in items if str(x).strip())
        if target is bool:
            if isinstance(raw, bool):
                return raw
            word = str(raw).strip().lower()
            if word in ("1", "true", "yes", "on"):
                return True
            if word in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if target is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            if not isinstance(raw, str):
                return int(raw)
            try:
                return int(raw)
            except ValueError:
                return int(raw.strip(), 0)  # 0x.., 0o.., 0b..
        if target is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if target is Path:
            return Path(str(raw))
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {raw!r} is not a valid {type_name} for {name}") from None


def describe_settings(settings: Any) -> str:
    """The settings of a frozen dataclass that differ from its defaults, ``key=value`` on
    one line (what a server logs as it starts; the whole is a ``--help`` away). Files are
    named, never read, so a token file's content never reaches a log."""
    out = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if value != default:
            out.append(f"{f.name}={','.join(map(str, value)) if isinstance(value, tuple) else value}")
    return " ".join(out) or "defaults"
