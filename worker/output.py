"""Where a run's output goes and how its progress shows.

``run_dir`` gives every run its own directory (``runs/<UTC time>/`` unless one is named)
and points ``runs/latest`` at the newest; ``progress`` draws a bar on a terminal and
writes a log line every few seconds anywhere else (a pipe, a file, CI), where a bar's
carriage returns would pile up or show nothing.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from worker.config import TrainerConfig

__all__ = ["ProgressLines", "progress", "run_dir"]

log = logging.getLogger(__name__)


def run_dir(config: TrainerConfig) -> Path:
    """``config.output_dir``, or a new ``runs/<UTC time>[-N]/`` that ``runs/latest`` then points at."""
    if config.output_dir is not None:
        config.output_dir.mkdir(parents=True, exist_ok=True)
        return config.output_dir
    root = Path("runs")
    root.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    for n in itertools.count(1):
        out = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            out.mkdir()  # atomic: two runs in the same second get different directories
            break
        except FileExistsError:
            continue
    latest, tmp = root / "latest", root / f".latest.{os.getpid()}"
    if latest.exists() and not latest.is_symlink():
        log.warning("%s is a directory (from an older version), not a link: left as it is", latest)
        return out
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(out.name)
    os.replace(tmp, latest)  # atomic: readers see the old run or the new one, never no link
    return out


class ProgressLines:
    """Progress for logs and pipes: a log line every ``every_s`` seconds and at each quarter."""

    def __init__(self, total: int, desc: str, every_s: float = 10.0) -> None:
        self.total, self.desc, self.every_s = max(1, total), desc, every_s
        self.n, self.shown, self.postfix = 0, 0, ""
        self.started = self.last = time.monotonic()
        self.quarter = 0

    def update(self, n: int) -> None:
        self.n += n
        now, quarter = time.monotonic(), 4 * self.n // self.total
        if now - self.last >= self.every_s or (quarter > self.quarter and now - self.last >= 1.0):
            self._line(now)
        self.quarter = max(self.quarter, quarter)

    def set_postfix(self, **values: str) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if self.n != self.shown:
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        self.last, self.shown = now, self.n
        log.info(
            "%s step=%d/%d (%d%%) %s elapsed_s=%.0f",
            self.desc,
            self.n,
            self.total,
            100 * self.n // self.total,
            self.postfix,
            now - self.started,
        )


def progress(enabled: bool, total: int, desc: str) -> Any:
    """A tqdm bar on a terminal, ``ProgressLines`` otherwise, None when not ``enabled``."""
    if not enabled:
        return None
    if not sys.stderr.isatty():
        return ProgressLines(total, desc)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)
