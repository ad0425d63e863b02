"""Server-side sparse optimizers: update only the rows that one push touches.

A table's storage belongs to the caller (the shard). This module only reads and writes it:

- ``values``: ``float32[capacity, dim]``, C-contiguous, one row per slot;
- ``state``: ``float32[capacity, width]``, C-contiguous, the optimizer's state for each row, with
  ``width = state_width(params, dim)`` (``0`` for SGD).

A push is ``slots: int32|int64[n]`` (unique: the caller sums the gradients of duplicate keys
first) and ``grads: float32[n, dim]``. :func:`apply` updates ``values`` and ``state`` in place,
in the rows named by ``slots`` and nowhere else. :func:`init_state` fills the state rows of
newly created slots.

>>> import numpy as np
>>> params = OptimizerParams(kind=OptimizerKind.ADAGRAD, lr=0.5)
>>> values = np.ones((4, 2), dtype=np.float32)
>>> state = np.empty((4, state_width(params, 2)), dtype=np.float32)
>>> slots = np.array([3, 1], dtype=np.int64)
>>> init_state(params, state, slots)
>>> apply(params, values, state, slots, np.full((2, 2), 2.0, dtype=np.float32))
>>> values.tolist()
[[1.0, 1.0], [0.5, 0.5], [1.0, 1.0], [0.5, 0.5]]

Math and state layout (per element, float32 unless noted):

- SGD, ``torch.optim.SGD(lr, weight_decay)`` without momentum: ``g += wd*p; p -= lr*g``.
  No state.
- Adagrad, ``torch.optim.Adagrad(lr, lr_decay=0, weight_decay, initial_accumulator_value,
  eps)``: ``g += wd*p; sum += g*g; p -= lr*g / (sqrt(sum) + eps)``. State ``[sum(dim)]``.
- Adam, ``torch.optim.Adam(lr, betas, eps, weight_decay)`` (L2 decay, not AdamW):
  ``t += 1; g += wd*p; m = lerp(m, g, 1-beta1); v = beta2*v + (1-beta2)*g*g;
  p -= (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)`` with ``bc = 1 - beta**t`` in float64.
  State ``[m(dim), v(dim), t]``, the step count ``t`` stored as a float32 (exact to 2**24).
- FTRL-Proximal (McMahan et al. 2013; TensorFlow's ``FtrlOptimizer`` with ``beta``), with
  ``alpha = lr`` and ``q = -lr_power``: ``g += wd*w; n' = n + g*g;
  z += g - (n'**q - n**q)/alpha * w; n = n';
  w = 0 if |z| <= l1 else (sign(z)*l1 - z) / ((beta + n**q)/alpha + 2*l2)``.
  State ``[z(dim), n(dim)]``, computed in float64 and stored as float32.
- Row-wise Adagrad, FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (TorchRec's default) with L2 weight
  decay (its ``weight_decay_mode`` L2): per row, ``s = sum_j (g_j + wd*p_j)**2`` added up in
  column order, ``acc += s / dim; m = lr / (sqrt(acc) + eps); p_j = (1 - m*wd)*p_j - m*g_j``.
  State ``[acc]``: one float per row whatever the dim, so a row costs about half an Adagrad row
  (a third with bfloat16 values). Every operation is a float32 operation rounded on its own
  (no fused multiply-add), so a numpy loop in the same order matches it bit for bit.
  FBGEMM's CPU kernel adds the squares up in another order: the two agree within float rounding.

The SGD, Adagrad and Adam kernels use the operation order of torch 2.13's single-tensor
(``foreach=False``) implementations, with fused multiply-adds exactly where torch's CPU kernels
(built with FMA) fuse them: ``add(alpha=)``, ``addcmul`` and ``lerp``. On an FMA-capable x86
CPU, SGD's values and the Adagrad/Adam state (sum; m, v, step) match ``torch.optim`` bit for
bit. Adagrad/Adam values differ by about an ulp now and then, only because torch's CPU float32
``sqrt`` is not correctly rounded (measured up to 0.75 ulp) and ours is; with an IEEE sqrt in
torch's op sequence they match bit for bit. See ``tests/unit/test_optimizers.py``.

Differences from ``torch.optim``:

- Only the rows in ``slots`` change. torch updates every row of a dense parameter; a row whose
  gradient is zero is left unchanged by SGD (without weight decay) and Adagrad, but torch still
  applies weight decay to it, and still decays Adam's moments and advances its step.
- Adam counts steps per row (the number of pushes that touched it), and a row that is not
  pushed is not decayed ("lazy Adam"). This equals ``torch.optim.Adam`` exactly when every row
  is pushed in every step. The float32 step count stops growing at 2**24 pushes to a row;
  by then both bias corrections are 1 for any practical beta.
- No momentum, Nesterov, dampening, ``maximize``, ``amsgrad``, AdamW-style decoupled decay,
  Adagrad ``lr_decay``, or learning-rate schedules.
- Duplicate slots in one push are not supported: the caller sums them first (as torch
  does when it coalesces a sparse gradient).
- Fused multiply-adds are always used (``llvm.fma``, exact even without hardware FMA). torch
  only fuses when its CPU kernels were built for a CPU with FMA; elsewhere the two differ by
  about an ulp per step.
- ``sqrt`` is IEEE (correctly rounded); torch's CPU float32 ``sqrt`` is within 0.75 ulp.
- Adam's ``sqrt(bc2)`` uses ``math.sqrt``; torch uses ``bc2 ** 0.5``. Both are float64 and
  round to the same float32 except in astronomically rare cases.
- FTRL does not exist in torch. Like TensorFlow, the initial row value enters only through the
  first ``sigma * w`` term; after the first push ``w`` is a function of ``z`` and ``n``. Unlike
  TensorFlow's default ``initial_accumulator_value=0.1``, ``n`` starts at 0.

Thread-safety: the functions hold no global state and the kernels release the GIL, so pushes
to different tables (or disjoint rows) can run in parallel. Two concurrent calls that touch the
same row race; the caller serializes pushes to one table. The kernels are compiled on first use
(about a second each) and cached on disk next to this file (numba ``cache=True``).
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt
from numba.core import types as nbtypes
from numba.extending import intrinsic

from ps.table.prefetch import prefetch

__all__ = [
    "OptimizerKind",
    "OptimizerParams",
    "apply",
    "init_state",
    "state_width",
]


class OptimizerKind(enum.IntEnum):
    """Which optimizer a table uses; the numbers are those of the wire enum.

    >>> OptimizerKind(2).name
    'ADAGRAD'
    """

    SGD = 1
    ADAGRAD = 2
    ADAM = 3
    FTRL = 4
    ROWWISE_ADAGRAD = 5


# torch's defaults; SGD and FTRL have no eps, so it only needs to be a valid number there.
_DEFAULT_EPS = {
    OptimizerKind.SGD: 1e-8,
    OptimizerKind.ADAGRAD: 1e-10,
    OptimizerKind.ADAM: 1e-8,
    OptimizerKind.FTRL: 1e-8,
    OptimizerKind.ROWWISE_ADAGRAD: 1e-8,  # FBGEMM's default
}


@dataclass(frozen=True)
class OptimizerParams:
    """Hyperparameters of one table's optimizer; immutable and validated on construction.

    ``eps=None`` means torch's default for ``kind`` (Adagrad ``1e-10``, Adam ``1e-8``); after
    construction ``eps`` is always a float. For FTRL, ``lr`` is the paper's ``alpha``. Fields a
    kind does not use are ignored (but still validated).

    Raises ``ValueError`` naming the field, e.g. ``optimizer.lr=-1.0: must be > 0``.

    >>> OptimizerParams(kind=OptimizerKind.ADAM, lr=1e-3).eps
    1e-08
    >>> OptimizerParams(lr=-1.0)
    Traceback (most recent call last):
    ...
    ValueError: optimizer.lr=-1.0: must be > 0
    """

    kind: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.01
    weight_decay: float = 0.0
    eps: float | None = None
    initial_accumulator_value: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    l1: float = 0.0
    l2: float = 0.0
    lr_power: float = -0.5
    beta: float = 1.0

    def __post_init__(self) -> None:
        try:
            kind = OptimizerKind(self.kind)
        except ValueError:
            names = ", ".join(f"{k.name}={k.value}" for k in OptimizerKind)
            raise ValueError(f"optimizer.kind={self.kind!r}: must be one of {names}") from None
        # Frozen dataclass: __post_init__ is the one place that may normalize fields.
        object.__setattr__(self, "kind", kind)
        if self.eps is None:
            object.__setattr__(self, "eps", _DEFAULT_EPS[kind])

        checks: list[tuple[str, Callable[[float], bool], str]] = [
            ("lr", lambda x: x > 0, "> 0"),
            ("weight_decay", lambda x: x >= 0, ">= 0"),
            ("eps", lambda x: x > 0, "> 0"),
            ("initial_accumulator_value", lambda x: x >= 0, ">= 0"),
            ("beta1", lambda x: 0 <= x < 1, "in [0, 1)"),
            ("beta2", lambda x: 0 <= x < 1, "in [0, 1)"),
            ("l1", lambda x: x >= 0, ">= 0"),
            ("l2", lambda x: x >= 0, ">= 0"),
            ("lr_power", lambda x: x <= 0, "<= 0"),
            ("beta", lambda x: x >= 0, ">= 0"),
        ]
        for name, ok, rule in checks:
            value = getattr(self, name)
            # bool is an int subclass, but True as a learning rate is surely a mistake.
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"optimizer.{name}={value!r}: must be a real number")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"optimizer.{name}={value!r}: must be finite and {rule}")
            if not ok(value):
                raise ValueError(f"optimizer.{name}={value!r}: must be {rule}")
            object.__setattr__(self, name, value)


def state_width(params: OptimizerParams, dim: int) -> int:
    """Number of float32 state columns per row for ``params.kind`` and row width ``dim``.

    SGD 0; Adagrad ``dim`` (sum); Adam ``2*dim + 1`` (m, v, step); FTRL ``2*dim`` (z, n);
    row-wise Adagrad 1 (the row's accumulator).

    >>> state_width(OptimizerParams(kind=OptimizerKind.ADAM), 8)
    17
    """
    if dim < 0:
        raise ValueError(f"dim={dim}: must be >= 0")
    kind = params.kind
    if kind == OptimizerKind.SGD:
        return 0
    if kind == OptimizerKind.ADAGRAD:
        return dim
    if kind == OptimizerKind.ADAM:
        return 2 * dim + 1
    if kind == OptimizerKind.FTRL:
        return 2 * dim
    if kind == OptimizerKind.ROWWISE_ADAGRAD:
        return 1
    raise ValueError(f"optimizer.kind={kind!r}: unknown")


def init_state(
    params: OptimizerParams,
    state: npt.NDArray[np.float32],
    slots: npt.NDArray[np.integer[Any]],
) -> None:
    """Set the state rows of newly created ``slots`` to the optimizer's initial state.

    Adagrad (either): every column ``initial_accumulator_value``; Adam: zeros (step 0); FTRL: zeros;
    SGD: nothing (``state`` has width 0). Writes ``state`` in place and nothing else; releases
    the GIL while filling. Raises ``ValueError`` on a bad dtype, shape or out-of-range slot.

    >>> import numpy as np
    >>> p = OptimizerParams(kind=OptimizerKind.ADAGRAD, initial_accumulator_value=0.1)
    >>> state = np.zeros((3, 2), dtype=np.float32)
    >>> init_state(p, state, np.array([2], dtype=np.int32))
    >>> state[2].tolist() == [np.float32(0.1)] * 2
    True
    """
    _check_table("state", state)
    slots = _check_slots(slots, state.shape[0])
    if state.shape[1] == 0 or slots.shape[0] == 0:
        return
    adagrad = params.kind in (OptimizerKind.ADAGRAD, OptimizerKind.ROWWISE_ADAGRAD)
    fill = params.initial_accumulator_value if adagrad else 0.0
    _fill_rows(state, slots, np.float32(fill))


def apply(
    params: OptimizerParams,
    values: npt.NDArray[np.float32],
    state: npt.NDArray[np.float32],
    slots: npt.NDArray[np.integer[Any]],
    grads: npt.NDArray[np.float32],
) -> None:
    """Apply one optimizer step to the rows ``values[slots]`` with gradients ``grads``.

    Updates ``values`` and ``state`` in place, in the rows named by ``slots`` only; ``grads``
    is only read. ``slots`` must be unique (not checked: a duplicate slot gets the later
    update computed from a stale read). NaN/Inf in ``grads`` are not checked either; the
    caller rejects them. Blocks until done, with the GIL released during the update.

    Raises ``ValueError`` naming the bad argument when a dtype, shape, layout or slot is
    wrong, e.g. ``grads: shape (3, 8), expected (3, 16)``; nothing is written then.

    >>> import numpy as np
    >>> p = OptimizerParams(kind=OptimizerKind.SGD, lr=0.5)
    >>> values = np.ones((3, 2), dtype=np.float32)
    >>> state = np.empty((3, 0), dtype=np.float32)
    >>> apply(p, values, state, np.array([1]), np.ones((1, 2), dtype=np.float32))
    >>> values[:, 0].tolist()
    [1.0, 0.5, 1.0]
    """
    _check_table("values", values)
    _check_table("state", state)
    capacity, dim = values.shape
    width = state_width(params, dim)
    if state.shape != (capacity, width):
        raise ValueError(
            f"state: shape {state.shape}, expected {(capacity, width)} for {params.kind.name} with dim {dim}"
        )
    slots = _check_slots(slots, capacity)
    n = slots.shape[0]
    if not isinstance(grads, np.ndarray):
        raise ValueError(f"grads: expected a numpy array, got {type(grads).__name__}")
    if grads.dtype != np.float32:
        raise ValueError(f"grads: dtype {grads.dtype}, expected float32")
    if grads.shape != (n, dim):
        raise ValueError(f"grads: shape {grads.shape}, expected {(n, dim)}")
    if not grads.flags.c_contiguous:
        raise ValueError("grads: must be C-contiguous")
    if n == 0 or dim == 0:
        return

    kind = params.kind
    wd = params.weight_decay
    if kind == OptimizerKind.SGD:
        _sgd(values, slots, grads, np.float32(-params.lr), np.float32(wd), wd != 0.0)
    elif kind == OptimizerKind.ADAGRAD:
        _adagrad(
            values,
            state,
            slots,
            grads,
            np.float32(-params.lr),
            np.float32(wd),
            wd != 0.0,
            np.float32(_eps(params)),
        )
    elif kind == OptimizerKind.ADAM:
        beta1, beta2 = params.beta1, params.beta2
        # torch passes these as Python floats, i.e. rounds the float64 result to float32.
        lerp_weight = np.float32(1.0 - beta1)
        _adam(
            values,
            state,
            slots,
            grads,
            params.lr,
            beta1,
            beta2,
            lerp_weight,
            np.float32(beta2),
            np.float32(1.0 - beta2),
            np.float32(wd),
            wd != 0.0,
            np.float32(_eps(params)),
        )
    elif kind == OptimizerKind.ROWWISE_ADAGRAD:
        _rowwise_adagrad(
            values,
            state,
            slots,
            grads,
            np.float32(params.lr),
            np.float32(wd),
            wd != 0.0,
            np.float32(_eps(params)),
        )
    elif kind == OptimizerKind.FTRL:
        _ftrl(
            values,
            state,
            slots,
            grads,
            params.lr,
            -params.lr_power,
            params.l1,
            params.l2,
            params.beta,
            wd,
        )
    else:  # pragma: no cover - OptimizerParams only admits known kinds
        raise ValueError(f"optimizer.kind={kind!r}: unknown")


# --- validation -------------------------------------------------------------------------------


def _eps(params: OptimizerParams) -> float:
    # __post_init__ always resolves eps; the Optional is only for the constructor's default.
    return _DEFAULT_EPS[params.kind] if params.eps is None else params.eps


def _check_table(name: str, array: npt.NDArray[np.float32]) -> None:
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(array).__name__}")
    if array.dtype != np.float32:
        raise ValueError(f"{name}: dtype {array.dtype}, expected float32")
    if array.ndim != 2:
        raise ValueError(f"{name}: shape {array.shape}, expected 2-D")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    if not array.flags.writeable:
        raise ValueError(f"{name}: must be writable")


def _check_slots(slots: npt.NDArray[np.integer[Any]], capacity: int) -> npt.NDArray[np.integer[Any]]:
    if not isinstance(slots, np.ndarray):
        raise ValueError(f"slots: expected a numpy array, got {type(slots).__name__}")
    if slots.dtype != np.int32 and slots.dtype != np.int64:
        raise ValueError(f"slots: dtype {slots.dtype}, expected int32 or int64")
    if slots.ndim != 1:
        raise ValueError(f"slots: shape {slots.shape}, expected 1-D")
    if slots.shape[0]:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= capacity:
            bad = lo if lo < 0 else hi
            raise ValueError(f"slots: slot {bad} out of range [0, {capacity})")
    # One memory layout keeps the number of compiled kernel variants down; no copy if already C.
    return np.ascontiguousarray(slots)


# --- kernels ----------------------------------------------------------------------------------

_F = TypeVar("_F", bound=Callable[..., Any])


# Single-threaded kernels on purpose: a prange version is 1.75x faster on an idle 2-core
# machine but 2.5x slower than this one when another thread holds a core (measured), and the
# server already runs pushes for different tables on different threads.
def _kernel(fn: _F) -> _F:
    # numba has no type stubs; the cast keeps mypy --strict seeing the Python signature.
    # error_model="numpy": x/0 gives inf/nan as in torch instead of raising, and without the
    # per-element zero check LLVM can vectorize the row loops (about 5x faster for Adagrad).
    return cast(_F, numba.njit(nogil=True, cache=True, error_model="numpy")(fn))


def _fma_typer(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    f32 = nbtypes.float32
    if not (a == f32 and b == f32 and c == f32):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fma(*args)

    return f32(f32, f32, f32), codegen


# a*b + c in float32 with one rounding (llvm.fma). torch's CPU kernels fuse add(alpha=),
# addcmul and lerp this way; numba would otherwise round the product separately.
_fma = cast(Callable[[np.float32, np.float32, np.float32], np.float32], intrinsic(_fma_typer))


# The kernels index 1-D row views (values[s], state[s][:dim], ...) rather than 2-D elements:
# with 2-D indexing LLVM cannot prove that the loads and stores of one row don't overlap and
# leaves the inner loop scalar (5x slower for Adam).

# Rows are updated in the order the push lists them, which no hardware prefetcher can guess:
# each kernel asks for the first cache line of the param (and state) row _AHEAD pushes on
# while it updates this one, so the misses of several rows overlap; the core's own prefetcher
# brings the rest of a row once its first line is asked for. A hint only: same bits. Written
# out in each loop: from a helper numba inlines, the gain was lost (measured).
_AHEAD = 8


@_kernel
def _fill_rows(state: npt.NDArray[np.float32], slots: npt.NDArray[np.integer[Any]], fill: np.float32) -> None:
    for i in range(slots.shape[0]):
        state[slots[i]] = fill


@_kernel
def _sgd(
    values: npt.NDArray[np.float32],
    slots: npt.NDArray[np.integer[Any]],
    grads: npt.NDArray[np.float32],
    neg_lr: np.float32,
    wd: np.float32,
    use_wd: bool,
) -> None:
    dim = values.shape[1]
    count = slots.shape[0]
    for i in range(count):
        if i + _AHEAD < count:
            prefetch(values, slots[i + _AHEAD])
        param = values[slots[i]]
        grad = grads[i]
        for j in range(dim):
            p = param[j]
            g = grad[j]
            if use_wd:
                g = _fma(p, wd, g)  # grad.add(param, alpha=wd)
            param[j] = _fma(g, neg_lr, p)  # param.add_(grad, alpha=-lr)


@_kernel
def _adagrad(
    values: npt.NDArray[np.float32],
    state: npt.NDArray[np.float32],
    slots: npt.NDArray[np.integer[Any]],
    grads: npt.NDArray[np.float32],
    neg_lr: np.float32,
    wd: np.float32,
    use_wd: bool,
    eps: np.float32,
) -> None:
    dim = values.shape[1]
    count = slots.shape[0]
    for i in range(count):
        if i + _AHEAD < count:
            prefetch(values, slots[i + _AHEAD])
            prefetch(state, slots[i + _AHEAD])
        s = slots[i]
        param = values[s]
        state_sum = state[s]
        grad = grads[i]
        for j in range(dim):
            p = param[j]
            g = grad[j]
            if use_wd:
                g = _fma(p, wd, g)  # grad.add(param, alpha=wd)
            acc = _fma(g, g, state_sum[j])  # state_sum.addcmul_(grad, grad, value=1)
            state_sum[j] = acc
            std = np.sqrt(acc) + eps
            param[j] = p + (neg_lr * g) / std  # param.addcdiv_(grad, std, value=-lr)


@_kernel
def _rowwise_adagrad(
    values: npt.NDArray[np.float32],
    state: npt.NDArray[np.float32],
    slots: npt.NDArray[np.integer[Any]],
    grads: npt.NDArray[np.float32],
    lr: np.float32,
    wd: np.float32,
    use_wd: bool,
    eps: np.float32,
) -> None:
    dim = values.shape[1]
    inv = np.float32(dim)
    one = np.float32(1.0)
    count = slots.shape[0]
    for i in range(count):
        if i + _AHEAD < count:
            prefetch(values, slots[i + _AHEAD])
            prefetch(state, slots[i + _AHEAD])
        s = slots[i]
        param = values[s]
        grad = grads[i]
        square = np.float32(0.0)
        for j in range(dim):
            g = grad[j]
            if use_wd:
                g = g + wd * param[j]
            square = square + g * g
        acc = state[s, 0] + square / inv
        state[s, 0] = acc
        step = lr / (np.sqrt(acc) + eps)
        keep = one - step * wd if use_wd else one
        for j in range(dim):
            param[j] = keep * param[j] - grad[j] * step


_ADAM_MEMO_STEPS = 4096


@_kernel
def _adam(
    values: npt.NDArray[np.float32],
    state: npt.NDArray[np.float32],
    slots: npt.NDArray[np.integer[Any]],
    grads: npt.NDArray[np.float32],
    lr: float,
    beta1: float,
    beta2: float,
    lerp_weight: np.float32,
    beta2_f: np.float32,
    one_minus_beta2: np.float32,
    wd: np.float32,
    use_wd: bool,
    eps: np.float32,
) -> None:
    dim = values.shape[1]
    one = np.float32(1.0)
    # torch's lerp: small weight -> start + w*(end-start); else end + (w-1)*(end-start).
    small = abs(lerp_weight) < np.float32(0.5)
    coeff = lerp_weight if small else lerp_weight - one
    # Two float64 pow() per row cost more than the row's arithmetic, and most rows have small
    # step counts, so memoize the per-step factors for this call. 0 means "not computed yet":
    # -lr/bc1 is never 0 because lr > 0 and 0 < bc1 <= 1.
    memo = np.zeros((_ADAM_MEMO_STEPS, 2), dtype=np.float32)
    count = slots.shape[0]
    for i in range(count):
        if i + _AHEAD < count:
            prefetch(values, slots[i + _AHEAD])
            prefetch(state, slots[i + _AHEAD])
        s = slots[i]
        param = values[s]
        row = state[s]
        exp_avg = row[:dim]
        exp_avg_sq = row[dim : 2 * dim]
        grad = grads[i]
        step = row[2 * dim] + one
        row[2 * dim] = step
        k = int(step)
        if k < _ADAM_MEMO_STEPS and memo[k, 0] != 0:
            neg_step_size = memo[k, 0]
            bc2_sqrt = memo[k, 1]
        else:
            # torch computes the bias corrections in float64 from step_t.item().
            t = np.float64(step)
            bias_correction1 = 1.0 - beta1**t
            bias_correction2 = 1.0 - beta2**t
            neg_step_size = np.float32(-(lr / bias_correction1))
            bc2_sqrt = np.float32(math.sqrt(bias_correction2))
            if k < _ADAM_MEMO_STEPS:
                memo[k, 0] = neg_step_size
                memo[k, 1] = bc2_sqrt
        for j in range(dim):
            p = param[j]
            g = grad[j]
            if use_wd:
                g = _fma(p, wd, g)  # grad.add(param, alpha=wd)
            m = exp_avg[j]
            m = _fma(coeff, g - m, m if small else g)  # exp_avg.lerp_(grad, 1 - beta1)
            v = exp_avg_sq[j] * beta2_f  # exp_avg_sq.mul_(beta2)
            v = _fma(one_minus_beta2 * g, g, v)  # .addcmul_(grad, grad, value=1 - beta2)
            exp_avg[j] = m
            exp_avg_sq[j] = v
            denom = np.sqrt(v) / bc2_sqrt + eps
            param[j] = p + (neg_step_size * m) / denom  # addcdiv_(value=-step_size)


@_kernel
def _ftrl(
    values: npt.NDArray[np.float32],
    state: npt.NDArray[np.float32],
    slots: npt.NDArray[np.integer[Any]],
    grads: npt.NDArray[np.float32],
    alpha: float,
    power: float,
    l1: float,
    l2: float,
    beta: float,
    wd: float,
) -> None:
    dim = values.shape[1]
    # float64 inside: z accumulates differences and |z| - l1 cancels, so float32 would lose
    # digits that matter near the sparsity threshold. The state is still stored as float32.
    is_sqrt = power == 0.5
    two_l2 = 2.0 * l2
    count = slots.shape[0]
    for i in range(count):
        if i + _AHEAD < count:
            prefetch(values, slots[i + _AHEAD])
            prefetch(state, slots[i + _AHEAD])
        s = slots[i]
        param = values[s]
        row = state[s]
        linear = row[:dim]
        accum = row[dim : 2 * dim]
        grad = grads[i]
        for j in range(dim):
            w = np.float64(param[j])
            g = np.float64(grad[j]) + wd * w
            z = np.float64(linear[j])
            n = np.float64(accum[j])
            n_new = n + g * g
            if is_sqrt:
                n_pow = math.sqrt(n)
                n_new_pow = math.sqrt(n_new)
            else:
                n_pow = n**power
                n_new_pow = n_new**power
            z += g - (n_new_pow - n_pow) / alpha * w
            linear[j] = np.float32(z)
            accum[j] = np.float32(n_new)
            sign_l1 = l1 if z > 0.0 else -l1
            w_new = (sign_l1 - z) / ((beta + n_new_pow) / alpha + two_l2)
            param[j] = np.float32(0.0) if abs(z) <= l1 else np.float32(w_new)
