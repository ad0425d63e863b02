"""MkDocs hook: generated reference tables, so the docs cannot drift from the code.

A page line ``<!-- settings: MODULE.CLASS PREFIX -->`` becomes a table of every field of
that config dataclass: its flag, environment variable, default and help text (the
field's ``help`` metadata, or the ``* ``name``: text`` bullet of the class docstring).
A line ``<!-- help: COMMAND ... -->`` becomes that command's ``--help`` text, taken from
its argument parser at build time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_SETTINGS = re.compile(r"^<!-- settings: (?P<cls>[\w.]+)(?: (?P<prefix>\w+))? -->$", re.M)
_HELP = re.compile(r"^<!-- help: (?P<command>[\w -]+?) -->$", re.M)


def _docstring_bullets(doc: str) -> tuple[dict[str, str], dict[str, str]]:
    """``* ``a``, ``b`` (``ENV_A``, ``ENV_B``): text`` bullets of a docstring: the text of
    each field name, and the environment variable named with it (upper case)."""
    out: dict[str, str] = {}
    env: dict[str, str] = {}
    for m in re.finditer(r"^ {4}\* (?P<head>``[^:]+?): (?P<text>.*(?:\n {6,}\S.*)*)", doc, re.M):
        text = " ".join(line.strip() for line in m["text"].splitlines())
        words = re.findall(r"``(\w+)``", m["head"])
        names = [w for w in words if not w.isupper()]
        variables = [w for w in words if w.isupper()]
        for i, name in enumerate(names):
            out.setdefault(name, text)
            if i < len(variables):
                env[name] = variables[i]
    return out, env


def _default(f: dataclasses.Field[Any], env: str | None) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif env is not None:  # read from the environment when the config is made
        return f"`${env}`, else unset"
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None or value == () or value == {}:
        return "unset"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value}` ({value >> 20} MiB)"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table(qualname: str, prefix: str | None) -> str:
    module, _, name = qualname.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    bullets, env = _docstring_bullets(cls.__doc__ or "")
    rows = []
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help") or bullets.get(f.name)
        if not text:
            raise ValueError(f"{qualname}.{f.name}: no help metadata and no docstring bullet; document it")
        if prefix:
            spelled = f"`--{f.name.replace('_', '-')}`<br>`{prefix}{f.name.upper()}`<br>`{f.name}`"
        else:
            spelled = f"`{f.name}`"
        rows.append(f"| {spelled} | {_default(f, env.get(f.name))} | {_cell(text)} |")
    head = "| flag / environment / file key | default | meaning |" if prefix else "| field | default | meaning |"
    return "\n".join([head, "|---|---|---|", *rows])


def _parser_help(command: str) -> str:
    words = command.split()
    out = io.StringIO()
    entry: Callable[[list[str]], object]
    if words[0] == "ps-admin":
        from deploy.admin import build_parser

        argv = [*words[1:], "--help"]
        entry = build_parser().parse_args
    elif words[0] == "ps-launch":
        from deploy.launch import _parse

        argv, entry = ["--help"], _parse
    elif words[0] == "ps-rendezvous":
        from deploy.rendezvous import parse_args

        argv, entry = ["--help"], parse_args
    else:
        raise ValueError(f"<!-- help: {command} -->: no parser known for {words[0]!r}")
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        entry(argv)
    return out.getvalue()


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    markdown = _SETTINGS.sub(lambda m: settings_table(m["cls"], m["prefix"]), markdown)
    return _HELP.sub(lambda m: f"```text\n$ {m['command']} --help\n{_parser_help(m['command'])}```", markdown)
