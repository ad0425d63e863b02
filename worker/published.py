"""The dense weights an online run published with each publication, for ``ps-infer``.

The online trainer (``worker.online``) writes ``<run>/published/<name>/dense.pt`` before
it publishes ``name`` on the training shards; serving shards started with
``--published-only`` then move to that publication, each on its own, and name it in
every lookup answer. ``PublishedDense.program(publications)`` gives the program that
scores rows read from shards at ``publications``: the dense weights of the *oldest* of
them (``""``, a shard before its first publication, is oldest of all: the run's own
weights). So a prediction never pairs a dense tower with rows older than the ones it
was published with; while the shards move to a new publication one by one, some rows
may be one publication newer than the tower (and, after ``ps-admin rollback``, the
tower is that of the publication served again).

Example:
    >>> import tempfile, torch
    >>> run = Path(tempfile.mkdtemp())
    >>> base = torch.nn.Linear(2, 1)
    >>> (run / "published" / "000002").mkdir(parents=True)
    >>> torch.save({"weight": torch.ones(1, 2), "bias": torch.zeros(1)}, run / "published" / "000002" / "dense.pt")
    >>> dense = PublishedDense(run, base)
    >>> dense.program(["", "000002"]) is base, dense.program(["000002"])(torch.ones(1, 2)).item()
    (True, 2.0)
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["PUBLISHED", "PublishedDense", "published_dir"]

PUBLISHED = "published"
KEEP = 8  # programs kept loaded


def published_dir(run_dir: str | Path, name: str) -> Path:
    """Where a run keeps the dense weights of publication ``name``."""
    return Path(run_dir) / PUBLISHED / name


class PublishedDense:
    """Copies of ``program`` holding each publication's dense weights, loaded on first use. Thread-safe."""

    def __init__(self, run_dir: str | Path, program: torch.nn.Module) -> None:
        self.run_dir, self.base = Path(run_dir), program
        self._loaded: OrderedDict[str, torch.nn.Module] = OrderedDict()
        self._lock = threading.Lock()

    def program(self, publications: Sequence[str]) -> torch.nn.Module:
        """The program for rows of ``publications`` (see the module). Raises ``RuntimeError``
        when the run directory lacks the oldest one's weights."""
        name = min(publications, default="")
        if not name:
            return self.base
        with self._lock:
            found = self._loaded.get(name)
            if found is not None:
                self._loaded.move_to_end(name)
                return found
            path = published_dir(self.run_dir, name) / "dense.pt"
            try:
                weights = torch.load(path, map_location="cpu", weights_only=True)
            except (OSError, RuntimeError) as exc:
                raise RuntimeError(
                    f"the shards serve publication {name}, whose dense weights {path} cannot be read ({exc}): give "
                    "ps-infer the run directory the online trainer writes (--model)"
                ) from None
            program = copy.deepcopy(self.base)
            # Buffers the model does not save (a constant index) are the export's own.
            missing, unexpected = program.load_state_dict(weights, strict=False)
            params = {n for n, _ in program.named_parameters()}
            if unexpected or params & set(missing):
                raise RuntimeError(
                    f"{path} does not fit the run's model: missing {sorted(params & set(missing))}, "
                    f"unexpected {sorted(unexpected)}"
                )
            self._loaded[name] = program
            while len(self._loaded) > KEEP:
                self._loaded.popitem(last=False)
            return program
