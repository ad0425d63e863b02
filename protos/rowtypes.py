"""Row element types both ends share: decoding stored 16-bit and 8-bit rows, and rounding
float32 rows to them to nearest (numpy only: ``ps.store.precision`` adds the shards' stochastic
rounding and gather kernels).

``as_served(kind, rows)`` is what a serving shard holding its rows as ``kind`` returns for
float32 ``rows`` (``ps-server --serve-dtype``): a trainer can score a model as it will be
served.

Example:
    >>> rows = np.array([[0.0, 0.3, 1.0]], np.float32)
    >>> served = as_served("int8", rows)  # 256 codes from 0.0 to 1.0: within half a step
    >>> served[0, [0, 2]].tolist(), bool(abs(served[0, 1] - 0.3) <= 0.5 / 255)
    ([0.0, 1.0], True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from protos import ps_pb2 as pb
from protos import wire

__all__ = [
    "BFLOAT16",
    "FLOAT16",
    "FLOAT32",
    "INT8",
    "Rounding",
    "as_served",
    "decode",
    "dequantize",
    "encode_nearest",
    "quantize",
]

FLOAT32, BFLOAT16, FLOAT16, INT8 = "float32", "bfloat16", "float16", "int8"
_BF16_MAX_BITS = np.uint16(0x7F7F)


@dataclass
class Rounding:
    """Elements clamped to the largest finite stored value, and non-zero ones rounded to zero."""

    clamped: int = 0
    flushed: int = 0


def decode(kind: str, stored: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """``stored`` elements (any shape) as a new float32 array (exact: every stored value is a float32)."""
    if kind == FLOAT32:
        return np.array(stored, dtype=np.float32)
    if kind == FLOAT16:
        return np.asarray(stored, dtype=np.float16).astype(np.float32)
    return (np.asarray(stored, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode_nearest(kind: str, rows: npt.NDArray[np.float32], counts: Rounding | None = None) -> npt.NDArray[Any]:
    """``rows`` rounded to the nearest ``kind`` value (ties to even), as a new stored array;
    float16 magnitudes above 65504 are clamped (and counted in ``counts``)."""
    x = np.ascontiguousarray(rows, dtype=np.float32)
    if kind == FLOAT32:
        return x.copy()
    if kind == FLOAT16:
        big = np.abs(x) > 65504.0
        if counts is not None:
            counts.clamped += int(np.count_nonzero(big))
        return np.clip(x, -65504.0, 65504.0).astype(np.float16)
    rounded = wire.rows_to_dtype(x, pb.BFLOAT16).view(np.uint16)  # to nearest, as 16-bit rows travel
    inf = (rounded & np.uint16(0x7FFF)) == np.uint16(0x7F80)
    if inf.any():  # a finite float32 above bfloat16's largest value
        rounded[inf] = (rounded[inf] & np.uint16(0x8000)) | _BF16_MAX_BITS
        if counts is not None:
            counts.clamped += int(np.count_nonzero(inf))
    return rounded


def quantize(rows: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """Row-wise 8-bit codes of ``rows`` and each row's ``[scale, bias]``: the 256 codes span
    the row's minimum to its maximum, and ``code * scale + bias`` is within ``scale / 2`` of
    the value (a row of equal values is exact, with scale 0)."""
    x = np.ascontiguousarray(rows, dtype=np.float32)
    lo = x.min(axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    hi = x.max(axis=1) if x.shape[1] else lo
    scale = ((hi.astype(np.float64) - lo) / 255.0).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    codes = np.clip(np.rint((x - lo[:, None]) / safe[:, None]), 0, 255).astype(np.uint8)
    return codes, np.stack([scale, lo], axis=1)


def dequantize(codes: npt.NDArray[np.uint8], params: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``code * scale + bias`` per element, in float32 (as the serving gather computes it)."""
    return (codes.astype(np.float32) * params[:, :1] + params[:, 1:]).astype(np.float32)


def as_served(kind: str, rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Float32 ``rows`` as a serving shard holding them as ``kind`` reads them back: 8-bit
    codes (``quantize``), or 16 bits rounded to nearest; float32 as they are."""
    if kind == INT8:
        return dequantize(*quantize(rows))
    return decode(kind, encode_nearest(kind, rows))
