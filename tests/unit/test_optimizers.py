"""ps.table.optimizers against torch.optim (SGD, Adagrad, Adam) and a float64 reference (FTRL).

What is bit-exact and what is not, and why:

- SGD: values bit-exact against torch.optim.SGD.
- Adagrad and Adam: the state (Adagrad's sum; Adam's m, v and step) is bit-exact against
  torch.optim. The values are not: torch 2.13's CPU float32 ``sqrt`` is not correctly rounded
  (it goes through a vectorized math library; measured up to 0.75 ulp, about 1 element in 6
  off by one ulp), while ours is IEEE ``sqrt``. That makes the denominator differ by an ulp now
  and then, so the values are compared with ``assert_allclose(rtol=1e-6, atol=1e-7)``. To show
  that this is the *only* difference, the values are also compared bit-exactly against
  torch's single-tensor step written out with the same torch ops and an IEEE sqrt
  (``_torch_adagrad_step`` / ``_torch_adam_step``).
- Bit-exactness relies on torch's CPU kernels fusing multiply-adds (they do when built for
  FMA-capable x86). ``TORCH_FUSES`` checks that; where it is false, the exact comparisons fall
  back to a tolerance.
- FTRL: no torch implementation; compared with a float64 reference at ``rtol=1e-5``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from ps.table import OptimizerKind, OptimizerParams
from ps.table.optimizers import apply, init_state, state_width

F32 = npt.NDArray[np.float32]
ROWS, DIM, STEPS = 40, 19, 20  # DIM not a multiple of the SIMD width: tails get tested too


def _torch_fuses() -> bool:
    # torch.add(alpha=) is a fused multiply-add in FMA builds; compare with an exact emulation.
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 4096)).astype(np.float32)
    alpha = np.float32(0.0137)
    # The float64 product of two float32 is exact, so this rounds (almost always) like an FMA.
    fused = (a.astype(np.float64) + np.float64(alpha) * b.astype(np.float64)).astype(np.float32)
    ours = torch.from_numpy(a).add(torch.from_numpy(b), alpha=float(alpha)).numpy()
    return bool(np.array_equal(ours, fused))


TORCH_FUSES = _torch_fuses()


def assert_same(ours: npt.NDArray[Any], theirs: npt.NDArray[Any]) -> None:
    """Bit-exact where torch fuses like we do; otherwise about an ulp per step may differ."""
    if TORCH_FUSES:
        np.testing.assert_array_equal(ours, theirs)
    else:
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def assert_close_sqrt(ours: F32, theirs: F32) -> None:
    # Values after Adagrad/Adam steps: torch's sqrt is off by up to an ulp (module docstring).
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


def make_table(params: OptimizerParams, seed: int, rows: int = ROWS) -> tuple[F32, F32]:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, DIM)).astype(np.float32)
    state = np.full((rows, state_width(params, DIM)), np.nan, dtype=np.float32)
    init_state(params, state, np.arange(rows))
    return values, state


def pushes(seed: int, subset: bool, rows: int = ROWS) -> list[tuple[npt.NDArray[np.int64], F32]]:
    """STEPS pushes: unique slots in random order, every row or a different random subset."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        slots = rng.permutation(rows)
        if subset:
            slots = slots[: rng.integers(1, rows)]
        grads = rng.standard_normal((len(slots), DIM)).astype(np.float32)
        out.append((slots.astype(np.int64), grads))
    return out


def dense(slots: npt.NDArray[np.int64], grads: F32, rows: int = ROWS) -> torch.Tensor:
    full = np.zeros((rows, DIM), dtype=np.float32)
    full[slots] = grads
    return torch.from_numpy(full)


def run_torch(
    make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    values: F32,
    steps: list[tuple[npt.NDArray[np.int64], F32]],
) -> tuple[F32, dict[str, Any]]:
    param = torch.nn.Parameter(torch.from_numpy(values.copy()))
    opt = make_opt([param])
    for slots, grads in steps:
        param.grad = dense(slots, grads)
        opt.step()
    return param.detach().numpy(), opt.state[param]


def run_ours(
    params: OptimizerParams, seed: int, steps: list[tuple[npt.NDArray[np.int64], F32]]
) -> tuple[F32, F32, F32]:
    """Apply ``steps`` to a fresh table; returns (initial values, values, state)."""
    values, state = make_table(params, seed)
    initial = values.copy()
    touched = np.zeros(ROWS, dtype=bool)
    for slots, grads in steps:
        before_v, before_s = values.copy(), state.copy()
        apply(params, values, state, slots, grads)
        untouched = np.ones(ROWS, dtype=bool)
        untouched[slots] = False
        # Untouched rows stay bit-identical, whatever the optimizer.
        np.testing.assert_array_equal(values[untouched], before_v[untouched])
        np.testing.assert_array_equal(state[untouched], before_s[untouched])
        touched[slots] = True
    assert touched.any()
    return initial, values, state


# --- SGD ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_matches_torch(weight_decay: float) -> None:
    params = OptimizerParams(kind=OptimizerKind.SGD, lr=0.1, weight_decay=weight_decay)
    # torch decays every row of a dense parameter; with decay, push every row every step.
    steps = pushes(1, subset=weight_decay == 0.0)
    initial, values, _ = run_ours(params, 2, steps)
    expected, _ = run_torch(
        lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=weight_decay, foreach=False),
        initial,
        steps,
    )
    assert_same(values, expected)


# --- Adagrad ------------------------------------------------------------------------------------


def _torch_adagrad_step(
    p: torch.Tensor, state_sum: torch.Tensor, grad: torch.Tensor, lr: float, wd: float, eps: float
) -> None:
    """torch 2.13 _single_tensor_adagrad (lr_decay=0), with an IEEE sqrt."""
    if wd != 0:
        grad = grad.add(p, alpha=wd)
    state_sum.addcmul_(grad, grad, value=1)
    std = torch.from_numpy(np.sqrt(state_sum.numpy())).add_(eps)
    p.addcdiv_(grad, std, value=-lr)


@pytest.mark.parametrize(("weight_decay", "initial_accumulator_value"), [(0.0, 0.0), (0.0, 0.1), (0.01, 0.1)])
def test_adagrad_matches_torch(weight_decay: float, initial_accumulator_value: float) -> None:
    lr = 0.1
    params = OptimizerParams(
        kind=OptimizerKind.ADAGRAD,
        lr=lr,
        weight_decay=weight_decay,
        initial_accumulator_value=initial_accumulator_value,
    )
    # A zero gradient row is left unchanged by torch Adagrad, unless weight decay is on.
    steps = pushes(3, subset=weight_decay == 0.0)
    initial, values, state = run_ours(params, 4, steps)

    expected, torch_state = run_torch(
        lambda p: torch.optim.Adagrad(
            p,
            lr=lr,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            foreach=False,
        ),
        initial,
        steps,
    )
    assert_same(state, torch_state["sum"].numpy())
    assert_close_sqrt(values, expected)

    p = torch.from_numpy(initial.copy())
    state_sum = torch.full_like(p, initial_accumulator_value)
    for slots, grads in steps:
        _torch_adagrad_step(p, state_sum, dense(slots, grads), lr, weight_decay, 1e-10)
    assert_same(values, p.numpy())


# --- Adam ---------------------------------------------------------------------------------------


def _torch_adam_step(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: float,
    grad: torch.Tensor,
    lr: float,
    betas: tuple[float, float],
    wd: float,
    eps: float,
) -> None:
    """torch 2.13 _single_tensor_adam (no amsgrad/capturable), with an IEEE sqrt."""
    beta1, beta2 = betas
    if wd != 0:
        grad = grad.add(p, alpha=wd)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (torch.from_numpy(np.sqrt(v.numpy())) / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)


# beta1=0.3 takes torch's other lerp branch (weight 1-beta1 >= 0.5).
@pytest.mark.parametrize(("beta1", "weight_decay"), [(0.9, 0.0), (0.9, 0.01), (0.3, 0.0)])
def test_adam_matches_torch_when_every_row_is_pushed(beta1: float, weight_decay: float) -> None:
    lr, betas = 0.01, (beta1, 0.999)
    params = OptimizerParams(kind=OptimizerKind.ADAM, lr=lr, beta1=beta1, beta2=0.999, weight_decay=weight_decay)
    steps = pushes(5, subset=False)  # per-row step == global step
    initial, values, state = run_ours(params, 6, steps)

    expected, torch_state = run_torch(
        lambda p: torch.optim.Adam(p, lr=lr, betas=betas, weight_decay=weight_decay, foreach=False),
        initial,
        steps,
    )
    assert_same(state[:, :DIM], torch_state["exp_avg"].numpy())
    assert_same(state[:, DIM : 2 * DIM], torch_state["exp_avg_sq"].numpy())
    np.testing.assert_array_equal(state[:, 2 * DIM], np.full(ROWS, float(torch_state["step"])))
    assert_close_sqrt(values, expected)

    p, m, v = torch.from_numpy(initial.copy()), torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM)
    for t, (slots, grads) in enumerate(steps, start=1):
        _torch_adam_step(p, m, v, float(t), dense(slots, grads), lr, betas, weight_decay, 1e-8)
    assert_same(values, p.numpy())


def test_adam_is_lazy_per_row() -> None:
    """A row's step counts its own pushes; a row that is not pushed does not decay."""
    lr, betas = 0.01, (0.9, 0.999)
    params = OptimizerParams(kind=OptimizerKind.ADAM, lr=lr)
    steps = pushes(7, subset=True)
    initial, values, state = run_ours(params, 8, steps)  # checks untouched rows are unchanged

    counts = np.zeros(ROWS)
    for slots, _ in steps:
        counts[slots] += 1
    np.testing.assert_array_equal(state[:, 2 * DIM], counts)

    # Each row equals torch Adam run on that row alone, stepping only when the row is pushed.
    for row in range(ROWS):
        p, m, v = torch.from_numpy(initial[row].copy()), torch.zeros(DIM), torch.zeros(DIM)
        t = 0
        for slots, grads in steps:
            (hit,) = np.nonzero(slots == row)
            if hit.size:
                t += 1
                grad = torch.from_numpy(grads[hit[0]].copy())
                _torch_adam_step(p, m, v, float(t), grad, lr, betas, 0.0, 1e-8)
        assert_same(values[row], p.numpy())
        assert_same(state[row, :DIM], m.numpy())
        assert_same(state[row, DIM : 2 * DIM], v.numpy())


# --- FTRL ---------------------------------------------------------------------------------------


def ftrl_reference(
    params: OptimizerParams, values: F32, steps: list[tuple[npt.NDArray[np.int64], F32]]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """FTRL-Proximal (McMahan et al. 2013, Algorithm 1 with TensorFlow's beta), in float64."""
    w = values.astype(np.float64)
    z, n = np.zeros_like(w), np.zeros_like(w)
    alpha, power = params.lr, -params.lr_power
    for slots, grads in steps:
        g = grads.astype(np.float64) + params.weight_decay * w[slots]
        n_new = n[slots] + g * g
        sigma = (n_new**power - n[slots] ** power) / alpha
        z[slots] += g - sigma * w[slots]
        n[slots] = n_new
        zs = z[slots]
        w[slots] = np.where(
            np.abs(zs) <= params.l1,
            0.0,
            (np.sign(zs) * params.l1 - zs) / ((params.beta + n_new**power) / alpha + 2 * params.l2),
        )
    return w, z, n


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"l1": 0.5, "l2": 0.1, "beta": 0.5},
        {"l1": 0.2, "l2": 0.0, "lr_power": -0.6, "weight_decay": 0.01},
        {"lr_power": 0.0, "l1": 0.1},
    ],
)
def test_ftrl_matches_float64_reference(extra: dict[str, float]) -> None:
    params = OptimizerParams(kind=OptimizerKind.FTRL, lr=0.5, **extra)
    steps = pushes(9, subset=True)
    initial, values, state = run_ours(params, 10, steps)
    w, z, n = ftrl_reference(params, initial, steps)
    # Our state is stored in float32 between steps, so ~1e-7 relative per step drifts in;
    # atol covers weights near the l1 threshold, where |z| - l1 cancels.
    np.testing.assert_allclose(state[:, :DIM], z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state[:, DIM:], n, rtol=1e-5)
    np.testing.assert_allclose(values, w, rtol=1e-5, atol=2e-6)
    if params.l1 > 0:
        assert (values == 0).any()  # l1 makes some weights exactly zero
        np.testing.assert_array_equal(values[np.abs(z) < params.l1 * 0.99], 0)


# --- state, edge cases --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "width"),
    [
        (OptimizerKind.SGD, 0),
        (OptimizerKind.ADAGRAD, 8),
        (OptimizerKind.ADAM, 17),
        (OptimizerKind.FTRL, 16),
        (OptimizerKind.ROWWISE_ADAGRAD, 1),
    ],
)
def test_state_width(kind: OptimizerKind, width: int) -> None:
    assert state_width(OptimizerParams(kind=kind), 8) == width


@pytest.mark.parametrize(
    ("params", "fill"),
    [
        (OptimizerParams(kind=OptimizerKind.ADAGRAD), 0.0),
        (
            OptimizerParams(kind=OptimizerKind.ADAGRAD, initial_accumulator_value=0.1),
            np.float32(0.1),
        ),
        (OptimizerParams(kind=OptimizerKind.ADAM), 0.0),
        (OptimizerParams(kind=OptimizerKind.FTRL), 0.0),
    ],
)
def test_init_state_fills_only_the_given_rows(params: OptimizerParams, fill: float) -> None:
    state = np.full((6, state_width(params, 4)), 7.0, dtype=np.float32)
    init_state(params, state, np.array([4, 1], dtype=np.int32))
    np.testing.assert_array_equal(state[[1, 4]], fill)
    np.testing.assert_array_equal(state[[0, 2, 3, 5]], 7.0)


def test_init_state_sgd_and_empty_are_noops() -> None:
    init_state(OptimizerParams(), np.empty((3, 0), dtype=np.float32), np.array([1]))
    state = np.ones((3, 2), dtype=np.float32)
    init_state(OptimizerParams(kind=OptimizerKind.FTRL), state, np.array([], dtype=np.int64))
    np.testing.assert_array_equal(state, 1.0)


def test_int32_slots_readonly_grads_and_empty_push() -> None:
    params = OptimizerParams(kind=OptimizerKind.SGD, lr=0.5)
    values = np.ones((4, 3), dtype=np.float32)
    state = np.empty((4, 0), dtype=np.float32)
    grads = np.full((2, 3), 2.0, dtype=np.float32)
    grads.flags.writeable = False  # e.g. np.frombuffer over a request's bytes
    apply(params, values, state, np.array([3, 0], dtype=np.int32), grads)
    np.testing.assert_array_equal(values[:, 0], [0.0, 1.0, 1.0, 0.0])
    np.testing.assert_array_equal(grads, 2.0)
    apply(params, values, state, np.array([], dtype=np.int64), np.empty((0, 3), dtype=np.float32))
    np.testing.assert_array_equal(values[:, 0], [0.0, 1.0, 1.0, 0.0])


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lr", -1.0, "optimizer.lr=-1.0: must be > 0"),
        ("lr", 0.0, "optimizer.lr=0.0: must be > 0"),
        ("lr", float("inf"), "optimizer.lr=inf: must be finite"),
        ("lr", float("nan"), "optimizer.lr=nan: must be finite"),
        ("weight_decay", -0.1, "optimizer.weight_decay=-0.1: must be >= 0"),
        ("eps", 0.0, "optimizer.eps=0.0: must be > 0"),
        ("initial_accumulator_value", -1.0, "optimizer.initial_accumulator_value=-1.0"),
        ("beta1", 1.0, "optimizer.beta1=1.0: must be in [0, 1)"),
        ("beta2", -0.1, "optimizer.beta2=-0.1: must be in [0, 1)"),
        ("l1", -1.0, "optimizer.l1=-1.0: must be >= 0"),
        ("l2", -1.0, "optimizer.l2=-1.0: must be >= 0"),
        ("lr_power", 0.5, "optimizer.lr_power=0.5: must be <= 0"),
        ("beta", -1.0, "optimizer.beta=-1.0: must be >= 0"),
        ("lr", "0.1", "optimizer.lr='0.1': must be a real number"),
        ("kind", 7, "optimizer.kind=7: must be one of SGD=1, ADAGRAD=2, ADAM=3, FTRL=4, ROWWISE_ADAGRAD=5"),
    ],
)
def test_params_validation(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        OptimizerParams(**{field: value})


def test_params_defaults_and_normalization() -> None:
    assert OptimizerParams(kind=OptimizerKind.ADAGRAD).eps == 1e-10
    assert OptimizerParams(kind=OptimizerKind.ADAM).eps == 1e-8
    assert OptimizerParams(kind=OptimizerKind.ADAM, eps=1e-6).eps == 1e-6
    p = OptimizerParams(kind=3, lr=1)  # type: ignore[arg-type]  # ints from the wire
    assert p.kind is OptimizerKind.ADAM
    assert isinstance(p.lr, float)
    adam = OptimizerParams(kind=OptimizerKind.ADAM)
    assert adam == OptimizerParams(kind=OptimizerKind.ADAM, eps=1e-8)


def _apply_args() -> dict[str, Any]:
    return {
        "values": np.zeros((5, 16), dtype=np.float32),
        "state": np.zeros((5, 16), dtype=np.float32),
        "slots": np.array([0, 2, 4], dtype=np.int64),
        "grads": np.zeros((3, 16), dtype=np.float32),
    }


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("grads", np.zeros((3, 8), dtype=np.float32), "grads: shape (3, 8), expected (3, 16)"),
        ("grads", np.zeros((2, 16), dtype=np.float32), "grads: shape (2, 16), expected (3, 16)"),
        ("grads", np.zeros((3, 16), dtype=np.float64), "grads: dtype float64, expected float32"),
        ("grads", np.zeros((16, 3), dtype=np.float32).T, "grads: must be C-contiguous"),
        ("grads", [[0.0] * 16] * 3, "grads: expected a numpy array, got list"),
        ("values", np.zeros((5, 16), dtype=np.float16), "values: dtype float16, expected float32"),
        ("values", np.zeros(80, dtype=np.float32), "values: shape (80,), expected 2-D"),
        ("values", np.zeros((16, 5), dtype=np.float32).T, "values: must be C-contiguous"),
        (
            "state",
            np.zeros((5, 15), dtype=np.float32),
            "state: shape (5, 15), expected (5, 16) for ADAGRAD with dim 16",
        ),
        ("state", np.zeros((4, 16), dtype=np.float32), "state: shape (4, 16), expected (5, 16)"),
        ("slots", np.array([0, 2, 5]), "slots: slot 5 out of range [0, 5)"),
        ("slots", np.array([0, -1, 4]), "slots: slot -1 out of range [0, 5)"),
        (
            "slots",
            np.array([0, 2, 4], dtype=np.uint64),
            "slots: dtype uint64, expected int32 or int64",
        ),
        ("slots", np.array([0.0, 2.0, 4.0]), "slots: dtype float64, expected int32 or int64"),
        ("slots", np.array([[0, 2, 4]]), "slots: shape (1, 3), expected 1-D"),
    ],
)
def test_apply_validation(name: str, bad: Any, message: str) -> None:
    args = _apply_args()
    args[name] = bad
    before = {k: np.array(v, copy=True) for k, v in _apply_args().items()}
    with pytest.raises(ValueError) as info:
        apply(OptimizerParams(kind=OptimizerKind.ADAGRAD), **args)
    assert message in str(info.value)
    for key in ("values", "state"):
        if key != name:
            np.testing.assert_array_equal(args[key], before[key])  # nothing written


def test_apply_rejects_readonly_table() -> None:
    args = _apply_args()
    args["values"].flags.writeable = False
    with pytest.raises(ValueError, match="values: must be writable"):
        apply(OptimizerParams(kind=OptimizerKind.ADAGRAD), **args)
