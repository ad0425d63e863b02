"""The two conversions every 16-bit row on the wire goes through, as numba kernels.

float32 to bfloat16 rounds to nearest, ties to even (NaN stays a quiet NaN), and
bfloat16 to float32 is exact. Both ends use them: the client for the gradients it
pushes and the rows it reads, the shard for the rows it answers and the gradients it
receives. One pass each, in 32-bit lanes (vectorised): numpy needs four to six passes
and an array per pass, which on the few thousand elements of one table's part costs
more than the arithmetic. ``protos.wire`` loads this module on the first 16-bit row,
so ``import protos`` does not load numba.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

__all__ = ["bfloat16_nearest", "widen_bfloat16"]


@numba.njit(nogil=True, cache=True)
def bfloat16_nearest(x: npt.NDArray[np.uint32], out: npt.NDArray[np.uint16]) -> None:
    """Write the float32 bits ``x`` (1-D) into ``out`` as bfloat16 bits, to nearest even."""
    for i in range(x.shape[0]):
        b = x[i]
        if (b & np.uint32(0x7F800000)) == np.uint32(0x7F800000) and (b & np.uint32(0x7FFFFF)) != 0:
            out[i] = np.uint16((b >> np.uint32(16)) | np.uint32(0x40))  # NaN stays a (quiet) NaN
        else:
            lsb = np.uint32(np.uint32(b >> np.uint32(16)) & np.uint32(1))
            out[i] = np.uint16(np.uint32(b + np.uint32(0x7FFF) + lsb) >> np.uint32(16))


@numba.njit(nogil=True, cache=True)
def widen_bfloat16(bits: npt.NDArray[np.uint16], out: npt.NDArray[np.uint32]) -> None:
    """Write the bfloat16 bits ``bits`` (1-D) into ``out`` as float32 bits (exact)."""
    for i in range(bits.shape[0]):
        out[i] = np.uint32(np.uint32(bits[i]) << np.uint32(16))
