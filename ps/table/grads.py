"""Checking a push's gradients before anything of it is applied: their shape, and that
every value is finite (one NaN or Inf would spread through a row's optimizer state).

Example:
    >>> check_grads("table 't'", np.array([1, 2]), np.ones((2, 3), np.float32), 3)
    >>> try:
    ...     check_grads("table 't'", np.array([1]), np.array([[1.0, np.nan]], np.float32), 2)
    ... except InvalidRequest as exc:
    ...     print(exc)
    table 't': grads[0][1] is nan (NaN/Inf gradients are rejected; nothing was applied)
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

from ps.errors import InvalidRequest

__all__ = ["check_grads"]


@numba.njit(nogil=True, cache=True)
def _first_non_finite(grads: npt.NDArray[np.float32]) -> int:
    bits = grads.reshape(-1).view(np.uint32)
    # NaN and +-Inf are exactly the floats whose exponent bits are all ones. An integer
    # max over the exponent field vectorises (a float reduction would not, without
    # reassociation), and the search for the culprit only runs when there is one.
    exp_max = np.uint32(0)
    for i in range(bits.shape[0]):
        exp_max = max(exp_max, bits[i] & np.uint32(0x7F800000))
    if exp_max != np.uint32(0x7F800000):
        return -1
    for i in range(bits.shape[0]):
        if bits[i] & np.uint32(0x7F800000) == np.uint32(0x7F800000):
            return i
    return -1


def check_grads(what: str, keys: npt.NDArray[np.int64], grads: npt.NDArray[np.float32], dim: int) -> None:
    """Raise ``InvalidRequest`` naming ``what`` unless ``grads`` is ``[len(keys), dim]`` and
    all finite. One pass over the bits, no array written."""
    if grads.shape != (keys.shape[0], dim):
        raise InvalidRequest(f"{what}: grads shape {tuple(grads.shape)}, expected ({keys.shape[0]}, {dim})")
    bad = _first_non_finite(np.ascontiguousarray(grads, dtype=np.float32))
    if bad >= 0:
        raise InvalidRequest(
            f"{what}: grads[{bad // dim}][{bad % dim}] is {grads.reshape(-1)[bad]} "
            "(NaN/Inf gradients are rejected; nothing was applied)"
        )
