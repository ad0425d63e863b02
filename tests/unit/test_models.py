"""DLRM's pairwise interaction equals the textbook formula, bit for bit, forward and backward."""

from __future__ import annotations

import pytest
import torch

from worker.models import DLRM

FEATURES = [f"C{i}" for i in range(5)]
DIM = 4


def textbook(model: DLRM, dense: torch.Tensor, emb: dict[str, torch.Tensor]) -> torch.Tensor:
    """The same network, its interaction written as the paper does: dots[:, i, j] for i < j."""
    x = model.bottom(dense) if model.bottom is not None else None
    stacked = torch.stack(([x] if x is not None else []) + [emb[f] for f in FEATURES], dim=1)
    n = stacked.shape[1]
    i, j = torch.triu_indices(n, n, offset=1)
    pairs = torch.bmm(stacked, stacked.transpose(1, 2))[:, i, j]
    return model.top(torch.cat([x, pairs], dim=1) if x is not None else pairs).squeeze(1)


@pytest.mark.parametrize("num_dense", [3, 0])  # 0: no bottom MLP (a log without dense columns)
def test_dlrm_interaction_matches_the_textbook_formula(num_dense: int) -> None:
    torch.manual_seed(0)
    model = DLRM(num_dense, FEATURES, DIM, bottom=[8], top=[8])
    dense = torch.randn(32, num_dense)
    emb = {f: torch.randn(32, DIM, requires_grad=True) for f in FEATURES}
    ours, ref = model(dense, emb), textbook(model, dense, emb)
    assert torch.equal(ours, ref)
    grads = torch.autograd.grad(ours.sum(), [*emb.values(), *model.parameters()])
    ref_grads = torch.autograd.grad(ref.sum(), [*emb.values(), *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert "pairs" not in model.state_dict()  # saved models do not depend on how pairs are picked
