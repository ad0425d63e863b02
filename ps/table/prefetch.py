"""``prefetch(array, i)``, ``prefetch_row(array, i)``: ask the CPU to start loading row ``i`` of ``array`` into cache.

For the compiled kernels that visit rows in an order no hardware prefetcher can guess
(hash-index probes, gathers of rows by slot): issued a few rows ahead, the memory loads
of several rows overlap instead of each one stalling the loop in turn. A hint only: it
never faults, so ``i`` need not be a valid row, and results do not depend on it.

Example:
    >>> import numba, numpy as np
    >>> @numba.njit
    ... def total(values, rows):
    ...     s = 0.0
    ...     for k in range(rows.size):
    ...         if k + 8 < rows.size:
    ...             prefetch(values, rows[k + 8])
    ...         s += values[rows[k], 0]
    ...     return s
    >>> total(np.ones((4, 2), np.float32), np.array([3, 1], np.int64))
    2.0
"""

from __future__ import annotations

from typing import Any

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["LINE_BYTES", "prefetch", "prefetch_at", "prefetch_row"]

LINE_BYTES = 64  # a cache line on x86-64 and most arm64 cores

_cg: Any = cgutils  # untyped to mypy
_I32 = ir.IntType(32)
_READ, _KEEP_IN_ALL_LEVELS, _DATA_CACHE = 0, 3, 1  # llvm.prefetch's rw, locality, cache type


def _codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
    """The address of ``array[index..., 0...]`` and one ``llvm.prefetch`` of it."""
    array_type = signature.args[0]
    arr = context.make_array(array_type)(context, builder, args[0])
    index = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], signature.args[1:])]
    zero = context.get_constant(types.intp, 0)
    ptr = _cg.get_item_pointer2(
        context,
        builder,
        data=arr.data,
        shape=_cg.unpack_tuple(builder, arr.shape),
        strides=_cg.unpack_tuple(builder, arr.strides),
        layout=array_type.layout,
        inds=index + [zero] * (array_type.ndim - len(index)),
        wraparound=False,
        boundscheck=False,
    )
    address = builder.bitcast(ptr, _cg.voidptr_t)
    # LLVM names the intrinsic by its pointer type: "p0" where pointers are opaque.
    name = "llvm.prefetch.p0" if getattr(address.type, "is_opaque", False) else "llvm.prefetch.p0i8"
    fnty = ir.FunctionType(ir.VoidType(), [address.type, _I32, _I32, _I32])
    fn = _cg.get_or_insert_function(builder.module, fnty, name)
    flags = [ir.Constant(_I32, v) for v in (_READ, _KEEP_IN_ALL_LEVELS, _DATA_CACHE)]
    builder.call(fn, [address, *flags])
    return context.get_dummy_value()


def _prefetch(typingctx: Any, array: Any, row: Any) -> Any:
    if not isinstance(array, types.Array) or not isinstance(row, types.Integer):
        return None
    return types.void(array, row), _codegen


def _prefetch_at(typingctx: Any, array: Any, row: Any, col: Any) -> Any:
    if not isinstance(array, types.Array) or array.ndim != 2:
        return None
    if not isinstance(row, types.Integer) or not isinstance(col, types.Integer):
        return None
    return types.void(array, row, col), _codegen


# Typed ``Any``: to a type checker an intrinsic's signature is its typing function's.
prefetch: Any = intrinsic(_prefetch)
"""``prefetch(array, row)``: prefetch the cache line that holds ``array[row, 0, ...]``."""
prefetch_at: Any = intrinsic(_prefetch_at)
"""``prefetch_at(array, row, col)``: prefetch the cache line that holds ``array[row, col]`` (2-D)."""


@numba.njit(nogil=True, cache=True, inline="always")
def prefetch_row(array: Any, row: int) -> None:
    """Prefetch every cache line of ``array[row]`` (a C-contiguous 2-D array)."""
    step = max(1, LINE_BYTES // array.itemsize)
    for col in range(0, array.shape[1], step):
        prefetch_at(array, row, col)
