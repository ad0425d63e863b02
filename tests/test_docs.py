"""The documentation runs: the site builds strictly and every shell block of it works.

Python blocks of README.md and docs/ run through pytest-markdown-docs (``--markdown-docs``
in pyproject.toml). This module builds the MkDocs site with ``--strict`` (a broken link,
a missing page or an unresolved API reference fails) and runs every ``bash``/``sh`` block.

How shell blocks run: the blocks of one page run in order as one bash script
(``set -euo pipefail``), so a variable or a server started in one block serves the next.
Every page runs in the same working directory, one after another, as a reader typing
them all in one checkout would: a temp dir holding a link to each top-level entry of the
repository (``examples/``, ``deploy/`` ...), and ``../shared`` beside it when the checkout
has one, so relative paths in the docs work and what the commands write (``runs/``,
``ps-data/``) stays out of the checkout. So pages must not step on each other: each keeps
its files in a folder of its own (``ps-data/<page>/``) and its servers bind port 0 (no
block names a fixed port). A command ending in ``&`` runs in the background (a server);
when the page ends, its whole process group is stopped. A block waits for a server with
its ``--port-file``, through the one ``wait_for`` every page defines alike (``WAIT_FOR``),
which fails when the server exits first or after 60 s.

A block that cannot run in a test says so just above its fence, visibly:
``<!-- not-run: REASON -->`` with REASON one of ``NOT_RUN`` below, each checked against
what the block holds. ``<!-- requires: PROGRAM -->`` runs the block only where PROGRAM
is installed (an optional client such as grpcurl) and skips it elsewhere. ``<!-- host:
NAME ... -->`` marks a block typed on the hosts named (the multi-host guide): those run in
network namespaces of their own, in ``tests/integration/test_multi_host_guide.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SHELL = ("bash", "sh", "shell")
PAGE_TIMEOUT_S = 300

# Why a block may stay out of the test, and what such a block must contain (so the
# marker cannot hide an ordinary command).
NOT_RUN = {
    "set-up": re.compile(r"\bpip install\b|python3 -m venv"),  # would reinstall the environment under test
    "runs-the-suite": re.compile(r"\bpytest\b"),  # the test suite itself
    "kubernetes": re.compile(r"\b(kubectl|docker)\b"),  # needs a cluster or an image registry
    "gpu": re.compile(r"cuda|nvidia-smi"),  # needs a CUDA device
    "benchmark": re.compile(r"benchmarks/"),  # minutes of full CPU each; run them on purpose
}
# Waits a page describes that its test may shorten (the commands stay as written): the
# operations page shrinks right after it grows, which waits --reshard-settle-s (120 s) first.
PAGE_ENV = {"docs/guides/operations.md": {"PS_RESHARD_SETTLE_S": "2"}}
# How every page waits for a server it started: the port file, the server's pid.
WAIT_FOR = """\
wait_for() {  # wait_for PORT_FILE PID: until the server PID writes its port; fails if it exits, or after 60 s
  for _ in $(seq 600); do [ -s "$1" ] && return; kill -0 "$2" 2>/dev/null || break; sleep 0.1; done
  echo "no port in $1: the server (pid $2) exited or did not start within 60 s; its log says why" >&2; return 1
}
"""
# A server bound to a fixed port (a page run after another, or twice, would find it taken).
_FIXED_PORT = re.compile(r"--(?:listen|metrics-port)[ =](?:\S*:)?(?!0\b)\d+(?![\d.:])|\b127\.0\.0\.1:[1-9]\d*")
_MARKER = re.compile(r"<!-- (?P<kind>not-run|requires|host): (?P<value>[\w.-]+(?: [\w.-]+)*) -->\s*$")
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: tuple[str, str] | None


def blocks(page: Path) -> Iterator[Block]:
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent, lang = i, len(m["indent"]), m["lang"]
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        i += 1
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mm = _MARKER.search(before)
        marker = (mm["kind"], mm["value"]) if mm else None
        yield Block(page, start + 1, lang, "\n".join(body) + "\n", marker)


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_markers_are_used_only_where_they_must() -> None:
    """Every not-run block names a known reason and holds what that reason is about."""
    for page in PAGES:
        for b in blocks(page):
            where = f"{_name(page)}:{b.line}"
            if b.marker is None:
                continue
            assert b.lang in SHELL, f"{where}: a marker before a {b.lang!r} block; only shell blocks take one"
            kind, value = b.marker
            if kind == "not-run":
                assert value in NOT_RUN, f"{where}: not-run reason {value!r}; known: {', '.join(NOT_RUN)}"
                assert NOT_RUN[value].search(b.code), f"{where}: not-run: {value}, but the block has no such command"


def test_readme_first_commands_are_the_documented_ones() -> None:
    """README's set-up + first command, and its test command (which .ci/run runs), stay as they are."""
    text = (ROOT / "README.md").read_text()
    setup = "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e '.[dev]' ./deploy/fbgemm-gpu-cpu"
    assert f"{setup}\npython examples/train_and_serve.py\n" in text
    assert f"{setup} && python -m pytest -q -n 2 --dist loadfile\n" in text
    assert "\npython -m pytest -q -n 2 --dist loadfile\n" in (ROOT / ".ci" / "run").read_text()


def test_readme_links_resolve() -> None:
    """README.md is read outside the site (on a forge, on PyPI): its relative links and their
    anchors must still point at a file and a heading (the site build checks docs/ itself)."""
    text = (ROOT / "README.md").read_text()
    for target, anchor in re.findall(r"\]\((?!https?:)([^)#\s]+)(?:#([^)\s]+))?\)", text):
        path = ROOT / target
        assert path.exists(), f"README.md links to {target}, which does not exist"
        if anchor:
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
            assert anchor in slugs, f"README.md links to {target}#{anchor}: no such heading"


def _slug(heading: str) -> str:
    """The anchor MkDocs and GitHub give a heading (lower case, punctuation dropped, spaces to -)."""
    return re.sub(r"[^\w\s-]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def test_pages_wait_alike_and_bind_no_fixed_port() -> None:
    """Every runnable shell block defines ``wait_for`` as ``WAIT_FOR`` does (or not at all),
    and none binds or dials a fixed port."""
    for page in PAGES:
        for b in blocks(page):
            if b.lang not in SHELL or (b.marker and b.marker[0] == "not-run"):
                continue
            where = f"{_name(page)}:{b.line}"
            if "wait_for()" in b.code:
                assert WAIT_FOR in b.code, f"{where}: define wait_for as tests/test_docs.py's WAIT_FOR does"
            if b.marker and b.marker[0] == "host":
                continue  # a host of its own: its ports are the host's to choose
            found = _FIXED_PORT.search(b.code)
            assert found is None, f"{where}: {found[0]!r}: bind port 0 and read the port back from --port-file"


@pytest.mark.parametrize("exits", [False, True], ids=["server-writes-its-port", "server-exits-first"])
def test_the_pages_wait_for_notices_a_server_that_exits(tmp_path: Path, exits: bool) -> None:
    """The pages' ``wait_for`` returns once the port file is written, and fails at once,
    saying so, when the server exits before it writes it (it does not wait for good)."""
    server = "sleep 0.3; exit 1" if exits else "sleep 0.3; echo 4242 > port; sleep 5"
    script = f"set -euo pipefail\n{WAIT_FOR}bash -c '{server}' &\nwait_for port $!\necho ready $(cat port)\n"
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    if exits:
        assert done.returncode == 1 and "exited or did not start" in done.stderr, done
    else:
        assert done.returncode == 0 and done.stdout == "ready 4242\n", done


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one working directory every page's shell blocks run in, in turn."""
    return _workdir(tmp_path_factory.mktemp("docs"))


def _workdir(tmp: Path) -> Path:
    work = tmp / "work"
    work.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".git", ".venv", "runs", "ps-data", "site", ".pytest_cache", ".mypy_cache"}:
            (work / entry.name).symlink_to(entry)
    if (ROOT.parent / "shared").is_dir():  # ../shared/data: the real click-log samples, when present
        (tmp / "shared").symlink_to(ROOT.parent / "shared")
    return work


def _script(page: Path) -> str | None:
    parts = []
    for b in blocks(page):
        if b.lang not in SHELL:
            continue
        if b.marker and b.marker[0] in ("not-run", "host"):
            continue
        if b.marker and b.marker[0] == "requires" and shutil.which(b.marker[1]) is None:
            continue
        parts.append(f"echo '--- {_name(page)}:{b.line}' >&2\n{b.code}")
    return "set -euo pipefail\n" + "\n".join(parts) if parts else None


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.lang in SHELL for b in blocks(p))], ids=_name)
def test_shell_blocks_run(page: Path, tmp_path: Path, workdir: Path) -> None:
    script = _script(page)
    if script is None:
        pytest.skip(
            "no shell block of this page runs here (each is marked not-run, or requires a program not installed)"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(PAGE_ENV.get(_name(page), {}))
    log = tmp_path / "output.txt"
    with log.open("w") as out:  # a file, not a pipe: servers left running in the background hold it open
        proc = subprocess.Popen(
            ["bash", "-c", script],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: servers started with & stop with it
        )
        try:
            proc.wait(timeout=PAGE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            _stop_group(proc.pid)
    output = log.read_text()[-6000:]
    assert proc.returncode is not None and proc.returncode >= 0, (
        f"{_name(page)}: shell blocks ran over {PAGE_TIMEOUT_S} s; output:\n{output}"
    )
    assert proc.returncode == 0, f"{_name(page)}: a shell block failed (exit {proc.returncode}); output:\n{output}"


def _stop_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(100):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link, anchor, nav entry or API reference fails it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["NO_MKDOCS_2_WARNING"] = "1"  # Material's banner about its successor, printed on every build
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()
    # The diagrams' library is in the site (offline readers see diagrams), unless this machine
    # could not fetch it, which the build then says.
    mermaid = tmp_path / "site" / "javascripts" / "mermaid.min.js"
    assert (mermaid.is_file() and b'globalThis["mermaid"]' in mermaid.read_bytes()[-4096:]) or (
        "not fetched" in result.stderr
    ), result.stderr[-3000:]


def test_every_ps_admin_command_has_its_help_in_the_cli_reference() -> None:
    """A new ``ps-admin`` subcommand is listed in ``docs/reference/cli.md`` (its ``--help``
    is generated there from the parser)."""
    from deploy.admin import build_parser

    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    commands = set(actions[0].choices)
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    listed = set(re.findall(r"^<!-- help: ps-admin (\S+) -->$", page, re.M))
    assert commands - listed == set(), f"add <!-- help: ps-admin COMMAND --> for {sorted(commands - listed)}"
