"""Row-wise Adagrad (``ps.table.optimizers``, ``ROWWISE_ADAGRAD``) against a numpy twin and FBGEMM.

- The twin (``tests/twins.py``) writes the update out with numpy float32 operations in the kernel's order: the
  values and the accumulators must be bit-equal after many pushes, with and without weight decay.
- FBGEMM's CPU kernel (``EXACT_ROWWISE_ADAGRAD``, through its table-batched embedding module)
  gets the same rows and the same row gradients: equal within float rounding. FBGEMM adds the
  squares of a row up in another order (vectorised partial sums), so its accumulator can be an
  ulp away from ours; that is the only difference. Skipped where FBGEMM is not installed.
  Without weight decay only: FBGEMM 1.8's CPU kernel leaves weight decay out of row-wise
  Adagrad in every ``weight_decay_mode`` (measured); ours applies it as FBGEMM's GPU kernel
  does in its L2 mode, which the twin checks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from ps.table import OptimizerKind, OptimizerParams
from ps.table.optimizers import apply, init_state, state_width
from tests.twins import rowwise_adagrad_step

F32 = npt.NDArray[np.float32]
ROWS, DIM, STEPS = 60, 19, 25


def rowwise(**extra: float) -> OptimizerParams:
    return OptimizerParams(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1, **extra)


def twin(params: OptimizerParams, values: F32, acc: F32, slots: npt.NDArray[np.int64], grads: F32) -> None:
    rowwise_adagrad_step(values, acc, slots, grads, lr=params.lr, eps=params.eps, weight_decay=params.weight_decay)


def steps(seed: int, dim: int = DIM) -> list[tuple[npt.NDArray[np.int64], F32]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        slots = rng.permutation(ROWS)[: rng.integers(1, ROWS)].astype(np.int64)
        out.append((slots, (rng.standard_normal((len(slots), dim)) * rng.uniform(0.01, 3)).astype(np.float32)))
    return out


@pytest.mark.parametrize("extra", [{}, {"weight_decay": 0.01}, {"initial_accumulator_value": 0.5, "eps": 1e-6}])
def test_bit_equal_to_the_numpy_twin(extra: dict[str, float]) -> None:
    params = rowwise(**extra)
    rng = np.random.default_rng(1)
    values = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    state = np.full((ROWS, state_width(params, DIM)), np.nan, np.float32)
    init_state(params, state, np.arange(ROWS))
    np.testing.assert_array_equal(state, np.float32(params.initial_accumulator_value))
    ref_values, ref_state = values.copy(), state.copy()
    for slots, grads in steps(2):
        before = values.copy()
        apply(params, values, state, slots, grads)
        twin(params, ref_values, ref_state, slots, grads)
        untouched = np.setdiff1d(np.arange(ROWS), slots)
        np.testing.assert_array_equal(values[untouched], before[untouched])
    np.testing.assert_array_equal(state, ref_state)
    np.testing.assert_array_equal(values, ref_values)
    assert not np.array_equal(values, rng.standard_normal((ROWS, DIM)).astype(np.float32))


def test_one_accumulator_per_row_the_mean_square() -> None:
    params = rowwise()
    assert state_width(params, 64) == 1
    values = np.zeros((2, 4), np.float32)
    state = np.zeros((2, 1), np.float32)
    apply(params, values, state, np.array([1]), np.array([[1, 2, 2, 4]], np.float32))
    assert state[1, 0] == np.float32(25 / 4)  # (1 + 4 + 4 + 16) / 4
    np.testing.assert_allclose(values[1], -0.1 * np.array([1, 2, 2, 4]) / 2.5, rtol=1e-6)
    assert state[0, 0] == 0 and not values[0].any()


def _fbgemm() -> Any:
    fbgemm_gpu = pytest.importorskip("fbgemm_gpu", reason="FBGEMM not installed (the dev set-up installs it)")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    del fbgemm_gpu
    return (
        SplitTableBatchedEmbeddingBagsCodegen,
        EmbOptimType,
        SparseType,
        EmbeddingLocation,
        PoolingMode,
        ComputeDevice,
    )


def test_matches_fbgemm_cpu_kernel_within_rounding() -> None:
    tbe, opt, sparse, location, pooling, device = _fbgemm()
    params = rowwise(eps=1e-8)
    dim = 20  # FBGEMM takes multiples of 4
    module = tbe(
        embedding_specs=[(ROWS, dim, location.HOST, device.CPU)],
        optimizer=opt.EXACT_ROWWISE_ADAGRAD,
        learning_rate=params.lr,
        eps=params.eps,
        pooling_mode=pooling.SUM,
        weights_precision=sparse.FP32,
        output_dtype=sparse.FP32,
    )
    weights = module.split_embedding_weights()[0]
    with torch.no_grad():
        weights.copy_(torch.from_numpy(np.random.default_rng(4).standard_normal((ROWS, dim)).astype(np.float32)))
    values = weights.detach().numpy().copy()
    state = np.zeros((ROWS, 1), np.float32)
    for slots, grads in steps(3, dim):
        # One id per bag: each row's gradient is exactly its bag's output gradient.
        offsets = torch.arange(len(slots) + 1, dtype=torch.int64)
        module(torch.from_numpy(slots), offsets).backward(torch.from_numpy(grads))
        apply(params, values, state, slots, grads)
    theirs_acc = module.split_optimizer_states()[0][0].detach().numpy()
    np.testing.assert_allclose(state[:, 0], theirs_acc, rtol=2e-6)
    np.testing.assert_allclose(values, weights.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert (np.abs(values - weights.detach().numpy()) <= 1e-6 * np.abs(values) + 1e-7).mean() > 0.99
