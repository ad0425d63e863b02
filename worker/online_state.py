"""What an online run keeps: its progress over the stream's parts, its checkpoints, the
rows it parsed, and the predictions of progressive validation (``worker.online``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from worker.config import TrainerConfig
from worker.data import Batch, ColumnSchema, parse_lines
from worker.loop import TrainingPass
from worker.metrics import auc, logloss
from worker.resume import CheckpointDir, CheckpointError, fingerprint
from worker.schema import BadLines, DataError, Layout, SchemaColumns, columns_of, resolve_layout
from worker.stream import Lines, StreamBadLines

__all__ = [
    "OnlineProgress",
    "ProgressiveValidation",
    "StreamRows",
    "load_checkpoint",
    "save_checkpoint",
    "window_figures",
]


@dataclass
class OnlineProgress:
    """How far an online run got. ``parts``: per worker (the part of the stream it owns),
    ``batches`` trained (the seq of its last push), ``rows`` in them and the stream
    ``position`` after the last one; ``steps``: optimizer steps of the group."""

    run_id: str
    batch_size: int
    world: int = 1
    parts: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    output_dir: str | None = None
    published: str = ""  # the newest publication (worker.published)
    windows: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.parts:
            self.parts = [{"batches": 0, "rows": 0, "position": None} for _ in range(self.world)]

    @property
    def batches(self) -> int:
        return sum(int(p["batches"]) for p in self.parts)

    @property
    def rows(self) -> int:
        return sum(int(p["rows"]) for p in self.parts)


class ProgressiveValidation:
    """Labels and predictions made before training, kept until a window closes (``take``).

    >>> pv = ProgressiveValidation()
    >>> pv.add(torch.tensor([0.0, 1.0]), torch.tensor([0.2, 0.6])); pv.add(torch.tensor([0.0, 1.0]), torch.tensor([0.4, 0.8]))
    >>> w = window_figures(1, *pv.take())
    >>> w["rows"], w["auc"], round(w["calibration"], 3), pv.take()[0].shape
    (4, 1.0, 1.0, (0,))
    """

    def __init__(self) -> None:
        self._labels: list[np.ndarray] = []
        self._probs: list[np.ndarray] = []

    def add(self, labels: torch.Tensor, probs: torch.Tensor) -> None:
        self._labels.append(labels.numpy().astype(np.float64))
        self._probs.append(probs.numpy().astype(np.float64))

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """Every label and prediction since the last ``take``."""
        y = np.concatenate(self._labels) if self._labels else np.empty(0)
        p = np.concatenate(self._probs) if self._probs else np.empty(0)
        self._labels, self._probs = [], []
        return y, p


def window_figures(number: int, y: np.ndarray, p: np.ndarray) -> dict[str, Any]:
    """A window's AUC, logloss and calibration (None where undefined: one label, NaN predictions)."""
    mean_y = float(y.mean()) if y.size else 0.0
    mean_p = float(p.mean()) if p.size else 0.0
    finite = bool(np.isfinite(p).all())
    return {
        "window": number,
        "rows": int(y.shape[0]),
        "auc": auc(y, p) if finite and 0 < y.sum() < y.shape[0] else None,
        "logloss": logloss(y, p) if finite and y.size else None,
        "calibration": mean_p / mean_y if mean_y > 0 and finite else None,
        "mean_label": mean_y,
        "mean_prediction": mean_p,
    }


class StreamRows:
    """``Lines`` into ``Batch``es under ``schema``: one layout per header, malformed rows
    raised or (``skip``) counted."""

    def __init__(self, schema: ColumnSchema, skip: bool) -> None:
        self.schema = schema
        self.bad = StreamBadLines() if skip else None
        self._layouts: dict[tuple[str, ...] | None, Layout] = {}
        self.columns: SchemaColumns | None = None

    def batch(self, lines: Lines) -> Batch:
        lay = self._layouts.get(lines.header)
        if lay is None:
            first = lines.data[: lines.data.index(b"\n")]
            try:
                lay = resolve_layout(self.schema, None if lines.header is None else list(lines.header), first)
                self.columns = self.columns or columns_of(self.schema, lines.header, first)
            except ValueError as exc:
                raise DataError(f"{lines.where}: {exc}", lines.where) from None
            self._layouts[lines.header] = lay
        bad = BadLines() if self.bad is not None else None
        batch = parse_lines(lines.data, self.schema, lay, lines.where, lines.first_line, bad)
        if self.bad is not None and bad is not None and bad.count:
            self.bad.add(lines.where, bad.count, bad.first)
        return batch


def load_checkpoint(ckpts: CheckpointDir | None, config: TrainerConfig) -> dict[str, Any] | None:
    state = ckpts.newest() if ckpts is not None else None
    if state is None:
        return None
    if "online" not in state:
        raise CheckpointError(
            f"{state['path']} is a checkpoint of a run on a file, not a stream: pass another --checkpoint-dir"
        )
    theirs, ours = state["fingerprint"], fingerprint(config)
    differ = [f"{k}={theirs.get(k)!r} there, {ours.get(k)!r} here" for k in sorted(ours) if theirs.get(k) != ours[k]]
    if differ:
        raise CheckpointError(
            f"{state['path']} holds the checkpoints of another run ({'; '.join(differ)}): resume with that run's "
            "settings, or pass another --checkpoint-dir"
        )
    return state


def save_checkpoint(
    ckpts: CheckpointDir,
    config: TrainerConfig,
    progress: OnlineProgress,
    run: TrainingPass | None,
    held: tuple[int | None, dict[str, tuple[np.ndarray, np.ndarray]]] | None = None,
    inputs: dict[str, Any] | None = None,
) -> None:
    """Write the run's checkpoint at ``progress.steps``: its progress, the dense model, its
    optimizer and RNG, a held push, and ``inputs`` (the features the model was built for,
    ``OnlineLoop.saved_inputs``: a run resumed with no row left to read rebuilds it from them)."""
    state: dict[str, Any] = {"online": dataclasses.asdict(progress), "fingerprint": fingerprint(config)}
    if inputs is not None:
        state["inputs"] = inputs
    if run is not None:
        state |= {
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
        }
    if held is not None:  # the step's push, sent when this file is safe (and again at a restart)
        seq, updates = held
        state["held"] = {
            "seq": seq,
            "updates": {t: (torch.from_numpy(k), torch.from_numpy(g)) for t, (k, g) in updates.items()},
        }
    ckpts.save(state, progress.steps)
