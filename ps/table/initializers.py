"""Initial rows as a pure function of (table seed, key).

A row that does not exist yet gets values that depend only on the table's seed, the
key and the element index, never on which shard, process or time creates it. So the
same key gets the same first row after a restart, on any cluster size, and a local
``torch.nn.EmbeddingBag`` can be started from exactly the rows the shards will hand out.

The generator is counter-based: element ``j`` of key ``k`` draws the 64-bit word
``w = mix64(mix64(k ^ mix64(seed)) + (j + 1) * 0x9E3779B97F4A7C15)`` (mod 2**64).

* UNIFORM: ``low + (high - low) * u`` with ``u = (w >> 11) * 2**-53`` in [0, 1).
* NORMAL: Box-Muller on the pair of words of elements ``2i`` and ``2i + 1``:
  ``r = sqrt(-2 ln(1 - u0))``, values ``mean + std * r * cos(2 pi u1)`` and
  ``mean + std * r * sin(2 pi u1)`` (an odd ``dim`` drops the last sine).
* ZEROS, CONSTANT: no randomness.

Arithmetic is float64, rounded to float32 once at the end.

Example:
    >>> p = InitializerParams(InitializerKind.UNIFORM, low=-1.0, high=1.0)
    >>> a = initial_rows(p, seed=7, keys=np.array([42, 42, 43]), dim=4)
    >>> bool((a[0] == a[1]).all()), bool((a[0] != a[2]).any())
    (True, True)
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numba
import numpy as np
import numpy.typing as npt

from protos.hashing import mix64_step
from protos.keys import mix64

__all__ = ["InitializerKind", "InitializerParams", "fill_initial_rows", "initial_rows"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class InitializerKind(enum.IntEnum):
    """Same numbers as ``InitializerSpec.Kind`` on the wire."""

    UNIFORM = 1
    NORMAL = 2
    ZEROS = 3
    CONSTANT = 4


@dataclass(frozen=True)
class InitializerParams:
    """How a table's new rows start. The default is U[-0.05, 0.05).

    Raises ``ValueError`` naming the field for non-finite values, ``low >= high``
    or ``std < 0``.
    """

    kind: InitializerKind = InitializerKind.UNIFORM
    low: float = -0.05
    high: float = 0.05
    mean: float = 0.0
    std: float = 0.01
    value: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", InitializerKind(self.kind))
        for name in ("low", "high", "mean", "std", "value"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"initializer.{name}={getattr(self, name)}: must be finite")
        if self.kind == InitializerKind.UNIFORM and not self.low < self.high:
            raise ValueError(f"initializer: low={self.low} must be < high={self.high}")
        if self.std < 0:
            raise ValueError(f"initializer.std={self.std}: must be >= 0")


@numba.njit(nogil=True, cache=True)
def _fill(
    out: npt.NDArray[np.float32],
    rows: npt.NDArray[np.int64],
    keys: npt.NDArray[np.uint64],
    seed_mix: np.uint64,
    kind: int,
    a: float,
    b: float,
) -> None:
    dim = out.shape[1]
    scale = 1.0 / 9007199254740992.0  # 2**-53
    for i in range(keys.shape[0]):
        r = rows[i]
        base = mix64_step(keys[i] ^ seed_mix)
        if kind == 1:
            for j in range(dim):
                w = mix64_step(base + np.uint64(j + 1) * _GOLDEN)
                out[r, j] = np.float32(a + (b - a) * (float(w >> np.uint64(11)) * scale))
        elif kind == 2:
            for j in range(0, dim, 2):
                w0 = mix64_step(base + np.uint64(j + 1) * _GOLDEN)
                w1 = mix64_step(base + np.uint64(j + 2) * _GOLDEN)
                u0 = float(w0 >> np.uint64(11)) * scale
                u1 = float(w1 >> np.uint64(11)) * scale
                radius = math.sqrt(-2.0 * math.log(1.0 - u0))
                out[r, j] = np.float32(a + b * radius * math.cos(2.0 * math.pi * u1))
                if j + 1 < dim:
                    out[r, j + 1] = np.float32(a + b * radius * math.sin(2.0 * math.pi * u1))
        else:
            for j in range(dim):
                out[r, j] = np.float32(a)


def fill_initial_rows(
    params: InitializerParams,
    seed: int,
    keys: npt.NDArray[np.int64],
    out: npt.NDArray[np.float32],
    rows: npt.NDArray[np.integer],
) -> None:
    """Write the initial row of ``keys[i]`` into ``out[rows[i]]`` for every i.

    ``out`` is a C-contiguous float32 ``[capacity, dim]`` array owned by the caller.
    Releases the GIL while it runs. Raises ``ValueError`` on mismatched lengths.
    """
    keys_u = np.ascontiguousarray(keys, dtype=np.int64).view(np.uint64)
    rows64 = np.ascontiguousarray(rows, dtype=np.int64)
    if keys_u.shape[0] != rows64.shape[0]:
        raise ValueError(f"keys: {keys_u.shape[0]} keys but {rows64.shape[0]} rows")
    # np.uint64 explicitly: a Python int would be typed int64 and mix signed with unsigned.
    seed_mix = np.uint64(mix64(seed & ((1 << 64) - 1)))
    if params.kind == InitializerKind.UNIFORM:
        a, b = params.low, params.high
    elif params.kind == InitializerKind.NORMAL:
        a, b = params.mean, params.std
    elif params.kind == InitializerKind.ZEROS:
        a, b = 0.0, 0.0
    else:
        a, b = params.value, 0.0
    _fill(out, rows64, keys_u, seed_mix, int(params.kind), float(a), float(b))


def initial_rows(params: InitializerParams, seed: int, keys: npt.ArrayLike, dim: int) -> npt.NDArray[np.float32]:
    """A new ``[len(keys), dim]`` float32 array of the keys' initial rows."""
    k = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
    out = np.empty((k.shape[0], dim), dtype=np.float32)
    fill_initial_rows(params, seed, k, out, np.arange(k.shape[0]))
    return out
