"""The guards a window of online training must pass before it is published to serving.

A window (``worker.online.ProgressiveValidation``: rows scored before they trained)
passes when

* its AUC is not below the trailing baseline (the mean AUC of the last
  ``BASELINE_WINDOWS`` windows that passed) by more than ``auc_drop``;
* its calibration (mean prediction / mean label) lies in ``[calibration_min,
  calibration_max]``;
* no batch of it gave a NaN or Inf loss (such a batch is skipped, not trained), and the
  dense weights hold no NaN or Inf.

The first window has no baseline: it passes on the other guards. A window that fails
does not move the baseline, so a run of bad windows is measured against the good ones.

Example:
    >>> g = WindowGuard(auc_drop=0.02, calibration_min=0.5, calibration_max=2.0)
    >>> g.check({"auc": 0.75, "calibration": 1.1}), g.check({"auc": 0.70, "calibration": 1.0})
    ([], [('auc', 'AUC 0.7000 is below the trailing baseline 0.7500 by more than 0.02')])
    >>> [guard for guard, _ in g.check({"auc": 0.76, "calibration": 3.0}, skipped=2)]
    ['calibration', 'nonfinite']
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["BASELINE_WINDOWS", "WindowGuard", "finite"]

BASELINE_WINDOWS = 5


def finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class WindowGuard:
    """Checks windows against the guards (see the module) and keeps the trailing baseline."""

    def __init__(self, auc_drop: float, calibration_min: float, calibration_max: float) -> None:
        self.auc_drop, self.calibration_min, self.calibration_max = auc_drop, calibration_min, calibration_max
        self._passed: deque[float] = deque(maxlen=BASELINE_WINDOWS)

    @property
    def baseline(self) -> float | None:
        return sum(self._passed) / len(self._passed) if self._passed else None

    def check(self, window: dict[str, Any], *, skipped: int = 0, dense_finite: bool = True) -> list[tuple[str, str]]:
        """``(guard, why)`` of each guard ``window`` fails (empty: it passes); ``skipped``: its
        batches with a NaN or Inf loss, ``dense_finite``: whether the dense weights are finite
        at its end. Guards: ``auc``, ``calibration``, ``nonfinite`` and ``dense``."""
        reasons = []
        auc, calibration, baseline = window.get("auc"), window.get("calibration"), self.baseline
        if auc is None:
            reasons.append(("auc", "no AUC (the window holds one label only, or NaN predictions)"))
        elif baseline is not None and auc < baseline - self.auc_drop:
            why = f"AUC {auc:.4f} is below the trailing baseline {baseline:.4f} by more than {self.auc_drop}"
            reasons.append(("auc", why))
        if calibration is None:
            reasons.append(("calibration", "no calibration (no positive label, or NaN predictions)"))
        elif not self.calibration_min <= calibration <= self.calibration_max:
            why = f"calibration {calibration:.3f} outside [{self.calibration_min}, {self.calibration_max}]"
            reasons.append(("calibration", why))
        if skipped:
            reasons.append(("nonfinite", f"{skipped} batches gave a NaN or Inf loss (skipped)"))
        if not dense_finite:
            reasons.append(("dense", "NaN or Inf in the dense weights"))
        if not reasons and auc is not None:
            self._passed.append(auc)
        return reasons
