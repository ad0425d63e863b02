"""Buffers for messages of megabytes: fresh ``bytes`` filled in place, and glibc's malloc
kept from mapping (and faulting in) a new region for each one.

Both exist for the wire codecs (``protos.wire``, which re-exports them): gRPC Python sends
and receives only ``bytes``, so a response is built straight inside the ``bytes`` gRPC
will send, and the process's allocator is tuned so that such buffers are reused.

Example:
    >>> data, view = alloc_bytes(3)
    >>> view[:] = [1, 2, 3]
    >>> data
    b'\\x01\\x02\\x03'
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["alloc_bytes", "tune_malloc"]


def _c_api(name: str, restype: Any, *argtypes: Any) -> Any:
    """A function of the CPython C API with its types declared."""
    fn = getattr(ctypes.pythonapi, name)
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


_PyBytes_FromStringAndSize = _c_api("PyBytes_FromStringAndSize", ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)
_PyBytes_AsString = _c_api("PyBytes_AsString", ctypes.c_void_p, ctypes.py_object)
_PyMemoryView_FromMemory = _c_api(
    "PyMemoryView_FromMemory", ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int
)
_PyBUF_WRITE = 0x200


def alloc_bytes(size: int) -> tuple[bytes, npt.NDArray[np.uint8]]:
    """A new ``bytes`` of ``size`` uninitialised bytes and a writable uint8 view of it.

    gRPC sends only ``bytes``; filling a fresh ``bytes`` in place (what C code does
    with ``PyBytes_FromStringAndSize(NULL, n)``) saves copying a finished buffer into
    one. Contract: write every byte through the view before the ``bytes`` object is
    shared, hashed or returned, and never write afterwards. The view does not keep the
    ``bytes`` alive: hold on to both.
    """
    if size == 0:
        # CPython shares one empty bytes object; there is nothing to write anyway.
        return b"", np.empty(0, dtype=np.uint8)
    data = _PyBytes_FromStringAndSize(None, size)
    # A memoryview, not a ctypes array: that is a new ctypes type per size (10 us, not 1.7).
    view = np.frombuffer(_PyMemoryView_FromMemory(_PyBytes_AsString(data), size, _PyBUF_WRITE), dtype=np.uint8)
    return data, view


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_malloc() -> bool:
    """Keep buffers of up to 32 MiB on glibc's heap instead of a fresh mmap each.

    Lookup responses and push requests are megabytes each. Above glibc's default mmap
    threshold every one is a new mapping whose pages fault in on first touch, which
    costs as much as copying the data (a 16 MiB push: ~36% slower). This raises the
    threshold to glibc's maximum (32 MiB) and the trim threshold to 256 MiB for the
    whole process. Returns False where glibc is not available (nothing changed).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
    return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, 256 << 20) == 1)
