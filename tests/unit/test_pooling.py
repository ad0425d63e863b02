"""``pool_and_push``: the sums and row gradients of ``F.embedding_bag(mode="sum")``, in one node."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from worker.pooling import SumFeature, pool_and_push


def feature(table: int, num_rows: int, lengths: list[int], rng: np.random.Generator) -> SumFeature:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return SumFeature(table, rng.integers(0, num_rows, int(offsets[-1])).astype(np.int64), offsets)


def test_sums_and_gradients_match_embedding_bag() -> None:
    rng = np.random.default_rng(0)
    rows = [
        rng.standard_normal((50, 16)).astype(np.float32),
        rng.standard_normal((7, 16)).astype(np.float32),
        rng.standard_normal((3, 16)).astype(np.float32),
    ]
    feats = [
        feature(0, 50, [1] * 64, rng),  # one id per sample, each row many times
        feature(1, 7, [0, 3, 1, 0, 5, 2, 0] * 9 + [0], rng),  # empty bags, several ids per bag
        feature(0, 50, [2] * 32, rng),  # a second feature on table 0: its gradient adds in
        feature(2, 3, [1] * 64, rng),  # a feature the loss does not use
    ]
    pushed: list[Callable[[], Sequence[torch.Tensor | None]]] = []
    anchor = torch.zeros((), requires_grad=True)
    ours = pool_and_push(rows, feats, pushed.append, anchor)

    leaves = [torch.from_numpy(r.copy()).requires_grad_() for r in rows]
    ref = [
        F.embedding_bag(torch.from_numpy(f.index), leaves[f.table], torch.from_numpy(f.offsets[:-1]), mode="sum")
        for f in feats
    ]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    weights = [torch.randn(o.shape) for o in ours]
    sum((o * w).sum() for o, w in zip(ours[:3], weights)).backward()  # type: ignore[union-attr]
    sum((o * w).sum() for o, w in zip(ref[:3], weights)).backward()  # type: ignore[union-attr]
    assert len(pushed) == 1  # one push per step, every table in it
    got = pushed[0]()  # folded later, as the push thread does
    assert got[2] is None  # no gradient reached table 2: nothing to push for it
    for t in (0, 1):
        expected = leaves[t].grad
        assert got[t] is not None and expected is not None
        torch.testing.assert_close(got[t], expected, rtol=1e-5, atol=1e-5)
        assert float(got[t].abs().sum()) > 0
    assert anchor.grad is None


def test_no_backward_no_push() -> None:
    rng = np.random.default_rng(1)
    pushed: list[object] = []
    with torch.no_grad():
        (out,) = pool_and_push(
            [np.ones((4, 2), np.float32)],
            [feature(0, 4, [2, 2], rng)],
            pushed.append,
            torch.zeros((), requires_grad=True),
        )
    assert out.tolist() == [[2.0, 2.0], [2.0, 2.0]] and not out.requires_grad and pushed == []
