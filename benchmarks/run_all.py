#!/usr/bin/env python3
"""Run every benchmark, one after another, and write one Markdown report of their figures.

Each benchmark runs as a subprocess (never two at once: they measure the machine), with
``--quick`` passed through; its JSON (and PNG) under ``benchmarks/results/`` is read back, and
``REPORT.md`` puts every headline figure beside its ceiling or peer from the same run, as a
ratio, with the goal and pass/fail where the benchmark sets one (``headlines.py``). Also: the
machine, the command lines, each benchmark's wall time and exit status, and a chart of the
ratios. A benchmark that fails (non-zero exit, no fresh JSON, a JSON the report cannot read) gets
its stderr tail in the report, the others still run, and run_all exits 1 at the end.

Usage::

    benchmarks/run_all [--quick] [--only NAME[,NAME]] [--skip NAME[,NAME]] [--out DIR]
                       [--args NAME=ARGS] [--timeout-s S] [--from-json [DIR]]

``--out`` (default ``benchmarks/results``) receives ``REPORT.md``, ``report-ratios.png``,
``run_all.json`` (what was run: the report can be rebuilt from it), ``logs/NAME.log`` and a copy
of each benchmark's JSON and PNG. ``--from-json`` runs nothing: it rebuilds the report from the
JSON files in DIR (default: ``--out``), using DIR's ``run_all.json`` where there is one.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # headlines, beside this file

from headlines import READERS, Headline, Section, md_table  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
STDERR_TAIL_LINES = 40
PACKAGES = ("grpcio", "protobuf", "numpy", "numba", "torch", "rocksdict", "torchrec")


@dataclass(frozen=True)
class Benchmark:
    """A benchmark script and the JSON files it writes: ``stem.json``, or ``stem-<part>.json``
    when told to run part of itself."""

    name: str
    script: str  # relative to the repository root
    stem: str


BENCHMARKS = [
    Benchmark("foundation", "benchmarks/bench_foundation.py", "foundation"),
    Benchmark("tier", "benchmarks/bench_tier.py", "tier"),
    Benchmark("training", "benchmarks/bench_training.py", "training"),
    Benchmark("serving", "benchmarks/bench_serving.py", "serving"),
    Benchmark("reshard", "benchmarks/bench_reshard.py", "reshard"),
    Benchmark("resume", "benchmarks/bench_resume.py", "resume"),
]
BY_NAME = {b.name: b for b in BENCHMARKS}


@dataclass
class Run:
    """One benchmark's run (or, from ``--from-json``, what ``run_all.json`` says of it)."""

    command: list[str] = field(default_factory=list)
    started: str = ""
    wall_s: float | None = None
    exit: int | None = None
    error: str = ""  # why it failed, in words; "" if it did not
    json: str = ""  # the JSON file read, relative to the output dir
    stderr_tail: str = ""
    loadavg_before: list[float] = field(default_factory=list)
    loadavg_after: list[float] = field(default_factory=list)


# -- the machine -------------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def machine() -> dict[str, Any]:
    """CPU, cores, RAM, versions (read from package metadata: nothing heavy is imported), git."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "?",
    )
    mem = next(
        (int(line.split()[1]) * 1024 for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal:")), 0
    )
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "ram_bytes": mem,
        "platform": platform.platform(),
        "versions": versions,
        "git_commit": git("rev-parse", "HEAD"),
        "git_changed_files": changed,
    }


def now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- running -----------------------------------------------------------------------------------


def _tee(src: IO[bytes], sinks: list[IO[bytes]], tail: collections.deque[str] | None) -> None:
    for line in iter(src.readline, b""):
        for sink in sinks:
            sink.write(line)
            sink.flush()
        if tail is not None:
            tail.append(line.decode(errors="replace").rstrip("\n"))


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM to the benchmark's process group (it and the servers it started), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def command(bench: Benchmark, quick: bool, extra: Sequence[str]) -> list[str]:
    return [sys.executable, bench.script, *(["--quick"] if quick else []), *extra]


def fresh_json(bench: Benchmark, since: float) -> Path | None:
    """The newest ``stem.json`` / ``stem-*.json`` in ``benchmarks/results`` written since ``since``."""
    found = [
        p
        for p in (*RESULTS.glob(f"{bench.stem}.json"), *RESULTS.glob(f"{bench.stem}-*.json"))
        if p.stat().st_mtime >= since
    ]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def run_benchmark(bench: Benchmark, cmd: list[str], out: Path, timeout_s: float) -> Run:
    """Run ``cmd`` from the repository root, its output shown and kept in ``out/logs/NAME.log``."""
    run = Run(command=cmd, started=now(), loadavg_before=loadavg())
    print(f"\n=== {bench.name}: {shlex.join(display(cmd))}", flush=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
    since, t0 = time.time() - 1.0, time.perf_counter()
    with (out / "logs" / f"{bench.name}.log").open("wb") as log:
        # Its own session: a timeout or Ctrl-C here stops its whole process group.
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        assert proc.stdout is not None and proc.stderr is not None
        readers = [
            threading.Thread(target=_tee, args=(proc.stdout, [sys.stdout.buffer, log], None)),
            threading.Thread(target=_tee, args=(proc.stderr, [sys.stderr.buffer, log], tail)),
        ]
        for r in readers:
            r.start()
        try:
            run.exit = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            run.error = f"timed out after {timeout_s:g} s (stopped)"
        except KeyboardInterrupt:
            _stop_group(proc)
            raise
        finally:
            for r in readers:
                r.join()
    run.wall_s, run.loadavg_after, run.stderr_tail = time.perf_counter() - t0, loadavg(), "\n".join(tail)
    found = fresh_json(bench, since)
    if run.exit and not run.error:
        run.error = f"exit status {run.exit}"
    elif not run.error and found is None:
        run.error = f"wrote no {bench.stem}.json (nor {bench.stem}-*.json) in {RESULTS}"
    if found is not None and not run.error:
        run.json = found.name
        if out.resolve() != RESULTS.resolve():
            for path in (found, found.with_suffix(".png")):
                if path.exists():
                    shutil.copy2(path, out / path.name)
    print(f"=== {bench.name}: {run.error or 'done'} in {run.wall_s:.0f} s", flush=True)
    return run


def display(cmd: Sequence[str]) -> list[str]:
    """``cmd`` with the interpreter's path relative to the repository where it lies inside it."""
    exe = Path(cmd[0])
    if exe.is_absolute() and exe.is_relative_to(REPO):
        return [str(exe.relative_to(REPO)), *cmd[1:]]
    return list(cmd)


# -- the report --------------------------------------------------------------------------------


def pick_json(bench: Benchmark, src: Path, named: str) -> Path | None:
    """``named`` if given (run_all.json's record), else ``stem.json``, else the newest ``stem-*.json``."""
    if named:
        return src / named if (src / named).exists() else None
    if (src / f"{bench.stem}.json").exists():
        return src / f"{bench.stem}.json"
    return max(src.glob(f"{bench.stem}-*.json"), key=lambda p: p.stat().st_mtime, default=None)


def read_section(path: Path) -> tuple[dict[str, Any], Section]:
    res = json.loads(path.read_text())
    if not isinstance(res, dict):
        raise TypeError(f"{path.name} holds a {type(res).__name__}, not an object")
    return res, READERS[path.stem.split("-")[0]](res)


def _ratio(h: Headline) -> str:
    return f"{h.ratio:.2f}×" if h.ratio is not None else ""


def _pass(passed: bool | None) -> str:
    return "" if passed is None else ("pass" if passed else "**fail**")


def _changed(files: list[str], shown: int = 15) -> str:
    """The files changed on top of the commit: the working tree is what ran."""
    if not files:
        return ", no changes"
    more = f" and {len(files) - shown} more" if len(files) > shown else ""
    return f" + {len(files)} changed files: " + ", ".join(f.strip() for f in files[:shown]) + more


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def _load(xs: Sequence[float] | None) -> str:
    return " ".join(f"{x:.2f}" for x in xs) if xs else "?"


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _run_line(res: dict[str, Any]) -> str:
    """What a benchmark's JSON says about its own run."""
    bits = [f"quick: {res.get('quick', '?')}"]
    if isinstance(res.get("wall_s"), int | float):
        bits.append(f"wall {res['wall_s']:.0f} s (its own count)")
    if res.get("loadavg_start") and res.get("loadavg_end"):
        bits.append(f"load average {res['loadavg_start'][0]:.2f} → {res['loadavg_end'][0]:.2f}")
    return "; ".join(bits)


def chart(rows: list[tuple[str, Headline]], path: Path) -> None:
    """The headline ratios as bars from 1× (log scale), coloured by pass/fail, the goal marked.
    Figures whose goal is not a ratio of the two (an absolute time) are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # here only: running the benchmarks does not need it
    from matplotlib.ticker import FuncFormatter, LogLocator

    rows = [(b, h) for b, h in rows if h.ratio is not None and h.ratio > 0 and (h.passed is None or h.target)]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(12, 0.3 * len(rows) + 1.3))
    y = list(range(len(rows)))[::-1]
    ratios = [float(h.ratio or 0) for _, h in rows]
    colors = ["C2" if h.passed else "C3" if h.passed is False else "C0" for _, h in rows]
    ax.barh(y, [r - 1 for r in ratios], left=1.0, color=colors, height=0.65)
    for yi, r, (_, h) in zip(y, ratios, rows):
        if h.target is not None:
            ax.plot([h.target], [yi], marker="|", markersize=13, color="black", mew=2)
        at = (max if r >= 1 else min)(r, h.target or r)  # beyond the goal's marker, so they do not overlap
        ax.annotate(f" {r:.2f}× ", (at, yi), va="center", ha="left" if r >= 1 else "right", fontsize=7)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=2))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.3g}×"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
    labels = [f"{b}: {h.figure}" for b, h in rows]
    labels = [
        (s if len(s) <= 90 else s[:87] + "...") + (" ↓" if h.lower_is_better else "") for s, (_, h) in zip(labels, rows)
    ]
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlim(min(ratios + [1.0]) / 2, max(ratios + [1.0]) * 2)
    ax.set_xlabel(
        "ours / ceiling or peer, same run (log scale). | goal; green pass, red fail, blue no goal; ↓ lower is better",
        fontsize=8,
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def render(names: list[str], src: Path, out: Path, meta: dict[str, Any]) -> tuple[str, bool]:
    """The report's Markdown for the benchmarks ``names`` (JSON read from ``src``, files written to
    ``out``), and whether every one ran and was read."""
    runs = {n: Run(**meta.get("runs", {}).get(n, {})) for n in names}
    sections: dict[str, tuple[dict[str, Any], Section] | str] = {}
    for name in names:
        run = runs[name]
        path = pick_json(BY_NAME[name], src, run.json)
        if run.error:
            sections[name] = run.error
        elif path is None:
            sections[name] = f"missing: no {BY_NAME[name].stem}.json (nor {BY_NAME[name].stem}-*.json) in {src}"
        else:
            try:
                sections[name] = read_section(path)
                run.json = path.name
            except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
                sections[name] = f"{path.name} could not be read: {type(exc).__name__}: {exc}"
        if src.resolve() != out.resolve() and path is not None and isinstance(sections[name], tuple):
            for p in (path, path.with_suffix(".png")):
                if p.exists():
                    shutil.copy2(p, out / p.name)
    ok = all(isinstance(s, tuple) for s in sections.values())
    rows = [(n, h) for n, s in sections.items() if isinstance(s, tuple) for h in s[1].headlines]
    goals = [h for _, h in rows if h.passed is not None]
    mach = meta.get("machine")

    lines = ["# Benchmark report", ""]
    when = f"{meta.get('started')} → {meta.get('finished', '?')}" if meta.get("started") else "time not recorded"
    commit = (mach or {}).get("git_commit", "")[:12] or "not recorded"
    lines.append(
        f"Run {when}; commit `{commit}`"
        + (
            " with `--quick` (a smoke run: sizes and times cut down, figures are not for comparison)"
            if meta.get("quick")
            else ""
        )
        + "."
    )
    failed = [n for n, s in sections.items() if isinstance(s, str)]
    lines += [
        "",
        f"{len(names) - len(failed)} of {len(names)} benchmarks ran and were read"
        + (f"; **failed or missing: {', '.join(failed)}**" if failed else "")
        + f". Goals met: {sum(bool(h.passed) for h in goals)} of {len(goals)}.",
        "",
    ]
    summary = []
    for name in names:
        run, s = runs[name], sections[name]
        status = "ok" if isinstance(s, tuple) else "missing" if s.startswith("missing") else "**FAILED**"
        wall = _secs(run.wall_s) if run.wall_s is not None else "—"
        met = [h.passed for h in s[1].headlines if h.passed is not None] if isinstance(s, tuple) else []
        summary.append((name, status, wall, f"{sum(met)} of {len(met)}" if met else "—", run.json or "—"))
    lines += md_table(("benchmark", "status", "wall", "goals met", "JSON"), summary) + [""]

    lines += ["## Headline figures", "", "Each figure beside its ceiling or peer measured in the same run.", ""]
    table = [(n, h.figure, h.ours, h.peer, _ratio(h), h.goal, _pass(h.passed)) for n, h in rows]
    table += [
        (
            n,
            str(sections[n]) if str(sections[n]).startswith("missing") else f"benchmark failed: {sections[n]}",
            "",
            "",
            "",
            "",
            "**fail**",
        )
        for n in failed
    ]
    lines += md_table(("benchmark", "figure", "ours", "ceiling or peer", "ratio", "goal", "pass"), table)
    try:
        chart(rows, out / "report-ratios.png")
        if (out / "report-ratios.png").exists() and rows:
            lines += ["", "![headline ratios](report-ratios.png)"]
    except ImportError:
        lines += ["", "(matplotlib is not installed: no chart; pip install -e '.[bench]')"]
    lines.append("")

    for name in names:
        run, s = runs[name], sections[name]
        lines += [f"## {name}", ""]
        if run.command:
            lines += [
                f"`{shlex.join(display(run.command))}`" + (f" — {_secs(run.wall_s)}" if run.wall_s is not None else ""),
                "",
            ]
        if isinstance(s, str):
            lines += [f"**Missing**: {s[len('missing: ') :]}" if s.startswith("missing") else f"**Failed**: {s}", ""]
            if run.stderr_tail:
                lines += [f"Last {STDERR_TAIL_LINES} lines of its stderr:", "", "```text", run.stderr_tail, "```", ""]
            continue
        res, sec = s
        lines += [
            f"From `{run.json}`: {_run_line(res)}; its {len(sec.headlines)} headline figures are in the table above.",
            "",
        ]
        lines += sec.details
        while lines[-1] == "":
            lines.pop()
        png = Path(run.json).with_suffix(".png").name
        if (out / png).exists():
            lines += ["", f"![{name}]({png})"]
        lines.append("")

    lines += ["## Machine", ""]
    if mach:
        v = mach["versions"]
        lines += md_table(
            ("", ""),
            [
                ("CPU", f"{mach['cpu']}, {mach['cores']} cores ({mach['cores_usable']} usable by this process)"),
                ("RAM", _gib(mach["ram_bytes"])),
                ("platform", mach["platform"]),
                ("versions", ", ".join(f"{k} {x}" for k, x in v.items())),
                ("git", f"`{mach['git_commit']}`" + _changed(mach["git_changed_files"])),
                ("date", f"{meta.get('started', '?')} → {meta.get('finished', '?')}"),
                (
                    "load average (1, 5, 15 min)",
                    f"before {_load(meta.get('loadavg_before'))}, after {_load(meta.get('loadavg_after'))}",
                ),
            ],
        )
    else:
        lines.append(
            "Not recorded: this report was rebuilt from benchmark JSON without a `run_all.json`. What the "
            "benchmarks' own JSON says:"
        )
        for n, s in sections.items():
            if isinstance(s, tuple):
                m = s[0].get("machine", "?")
                lines.append(
                    f"- {n}: " + (", ".join(f"{k} {x}" for k, x in m.items()) if isinstance(m, dict) else str(m))
                )
    lines.append("")

    lines += ["## Commands", ""]
    if meta.get("argv"):
        lines += [f"`{shlex.join(meta['argv'])}`", ""]
    lines += md_table(
        ("benchmark", "command", "wall", "exit", "load average before → after"),
        [
            (
                n,
                f"`{shlex.join(display(r.command))}`" if r.command else "—",
                f"{r.wall_s:.1f} s" if r.wall_s is not None else "—",
                "—" if r.exit is None else str(r.exit),
                f"{_load(r.loadavg_before)} → {_load(r.loadavg_after)}" if r.loadavg_before else "—",
            )
            for n, r in runs.items()
        ],
    )
    for name, run in runs.items():
        meta.setdefault("runs", {})[name] = asdict(run)
    return "\n".join(lines) + "\n", ok


def write_report(names: list[str], src: Path, out: Path, meta: dict[str, Any]) -> bool:
    """``out/REPORT.md`` (and its chart); True if every benchmark in ``names`` ran and was read."""
    out.mkdir(parents=True, exist_ok=True)
    text, ok = render(names, src, out, meta)
    (out / "REPORT.md").write_text(text)
    return ok


# -- command line ------------------------------------------------------------------------------


def names_arg(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected names among {','.join(BY_NAME)}")
    return names


def args_arg(text: str) -> tuple[str, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or name not in BY_NAME:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=ARGS with NAME among {','.join(BY_NAME)}")
    return name, shlex.split(rest)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark (a smoke run, ~3 min)")
    p.add_argument("--only", type=names_arg, help=f"comma-separated, of {','.join(BY_NAME)}")
    p.add_argument("--skip", type=names_arg, default=[], help="comma-separated names not to run")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the report goes (default benchmarks/results)")
    p.add_argument(
        "--args",
        type=args_arg,
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="more flags for one benchmark, e.g. --args 'serving=--parts lookup' (repeatable)",
    )
    p.add_argument("--timeout-s", type=float, default=3600.0, help="stop a benchmark after this long (default 1 h)")
    p.add_argument(
        "--from-json",
        nargs="?",
        const="",
        metavar="DIR",
        help="run nothing: rebuild the report from the JSON in DIR (default: --out)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    names = [n for n in (a.only or list(BY_NAME)) if n not in a.skip]
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    if a.from_json is not None:
        src = Path(a.from_json) if a.from_json else out
        meta_path = src / "run_all.json"
        recorded = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if recorded.get("runs") and not a.only:  # the report of that run, not of whatever else lies there
            names = [n for n in names if n in recorded["runs"]]
        ok = write_report(names, src, out, recorded)
        print(f"wrote {out / 'REPORT.md'} from the JSON in {src}")
        return 0 if ok else 1
    extra = dict(a.args)
    meta: dict[str, Any] = {
        "argv": ["benchmarks/run_all", *(sys.argv[1:] if argv is None else argv)],
        "quick": a.quick,
        "started": now(),
        "machine": machine(),
        "loadavg_before": loadavg(),
        "runs": {},
    }
    for name in names:
        bench = BY_NAME[name]
        run = run_benchmark(bench, command(bench, a.quick, extra.get(name, [])), out, a.timeout_s)
        meta["runs"][name] = asdict(run)
        (out / "run_all.json").write_text(json.dumps(meta, indent=1))  # so far: a report can be rebuilt mid-way
    meta["finished"], meta["loadavg_after"] = now(), loadavg()
    ok = write_report(names, out, out, meta)
    (out / "run_all.json").write_text(json.dumps(meta, indent=1))
    print(f"\nwrote {out / 'REPORT.md'}" + ("" if ok else "; some benchmarks failed (see the report)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
