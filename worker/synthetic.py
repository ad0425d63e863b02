"""A synthetic Criteo-like stream whose labels come from a planted model, so AUC means something.

Example:
    >>> b = next(synthetic_criteo(8, batch_size=4, seed=1))
    >>> b.dense.shape, len(b.sparse), b.sparse["C1"].lengths().tolist(), b.labels.dtype
    (torch.Size([4, 13]), 26, [1, 1, 1, 1], torch.float32)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from protos.keys import hash_features, mix64
from worker.data import Batch, feature_seed
from worker.jagged import JaggedIds

__all__ = ["CRITEO_VOCAB_SIZES", "SyntheticBatch", "synthetic_criteo"]

F64 = npt.NDArray[np.float64]
_MASK64 = (1 << 64) - 1


CRITEO_VOCAB_SIZES: tuple[int, ...] = (
    1460,
    583,
    1_000_000,
    1_000_000,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    1_000_000,
    3194,
    27,
    14992,
    1_000_000,
    10,
    5652,
    2173,
    4,
    1_000_000,
    18,
    15,
    286181,
    105,
    142572,
)
"""Criteo Kaggle's cardinality of C1..C26, capped at 1e6."""

_SHARE_PAIR, _SHARE_DENSE = 0.15, 0.10  # of the logit variance; the rest is per-feature weights
_GOLDEN = 0x9E3779B97F4A7C15
_GRID = np.linspace(-8.0, 8.0, 4001)  # quadrature over a standard normal, for exact moments
_GRID_P = np.exp(-0.5 * _GRID**2) / np.exp(-0.5 * _GRID**2).sum()


@functools.lru_cache(maxsize=64)
def _zipf_cdf(vocab: int, alpha: float) -> F64:
    c = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -alpha)
    cdf: F64 = c / c[-1]
    return cdf  # c[-1] == 1.0 exactly, so searchsorted of u in [0, 1) stays in range


def _normal(ids: npt.NDArray[np.uint64], salt: int) -> F64:
    """N(0, 1) as a pure function of (salt, id): Box-Muller on the halves of mix64(id ^ salt)."""
    bits = mix64((ids ^ np.uint64(salt)).view(np.int64))
    u1 = ((bits >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0**-32
    u2 = (bits & np.uint64(0xFFFFFFFF)).astype(np.float64) * 2.0**-32
    z: F64 = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return z


@dataclass(frozen=True)
class _Planted:
    cdfs: tuple[F64, ...]
    salts: tuple[int, ...]
    means: tuple[float, ...]
    sigma: float
    pair: tuple[int, int] | None
    pair_salt: int
    pair_mean: float
    pair_sigma: float
    dense_mu: F64
    dense_mean: F64
    dense_coef: F64  # v / sd
    bias: float


@functools.lru_cache(maxsize=8)
def _planted(
    model_seed: int,
    vocab: tuple[int, ...],
    alpha: float,
    num_dense: int,
    logit_std: float,
    positive_rate: float,
    pair: tuple[int, int] | None,
) -> _Planted:
    """Scales chosen from exact moments under the Zipf law, so the logit has std
    ``logit_std`` and a centred mean whatever the seed draws for the head ids."""
    root = mix64(model_seed & _MASK64)
    salts = tuple(mix64(root ^ ((f + 1) * _GOLDEN & _MASK64)) for f in range(len(vocab) + 2))
    cdfs = tuple(_zipf_cdf(v, alpha) for v in vocab)
    means, var = [], 0.0
    for cdf, salt in zip(cdfs, salts):
        p, z = np.diff(cdf, prepend=0.0), _normal(np.arange(cdf.shape[0], dtype=np.uint64), salt)
        means.append(float(p @ z))
        var += float(p @ (z - means[-1]) ** 2)
    share_pair, share_dense = (_SHARE_PAIR if pair else 0.0), (_SHARE_DENSE if num_dense else 0.0)
    pair_mean = pair_sigma = 0.0
    if pair is not None:
        pa, pb = (np.diff(cdfs[i], prepend=0.0) for i in pair)
        z2 = _pair_normal(np.arange(pa.shape[0])[:, None], np.arange(pb.shape[0])[None, :], salts[-2])
        pair_mean = float(pa @ z2 @ pb)
        pair_sigma = logit_std * math.sqrt(share_pair / max(float(pa @ (z2 - pair_mean) ** 2 @ pb), 1e-12))
    mu = np.linspace(0.5, 4.0, num_dense)
    x = np.log1p(np.floor(np.exp(mu[:, None] + 1.2 * _GRID[None, :])))  # [D, grid]
    dense_mean = x @ _GRID_P
    v = _normal(np.arange(num_dense, dtype=np.uint64), salts[-1])
    v *= logit_std * math.sqrt(share_dense / max(float(v @ v), 1e-12))
    lo, hi = -30.0, 30.0  # bias: E[sigmoid(b + logit_std * Z)] = positive_rate, by bisection
    for _ in range(60):
        b = (lo + hi) / 2
        rate = float(_GRID_P @ (0.5 + 0.5 * np.tanh(0.5 * (b + logit_std * _GRID))))  # sigmoid, no overflow
        lo, hi = (b, hi) if rate < positive_rate else (lo, b)
    sigma = logit_std * math.sqrt((1 - share_pair - share_dense) / max(var, 1e-12))  # 1e-12: all vocabs of size 1
    dense_coef = v / np.sqrt(((x - dense_mean[:, None]) ** 2) @ _GRID_P)
    return _Planted(
        cdfs,
        salts[: len(vocab)],
        tuple(means),
        sigma,
        pair,
        salts[-2],
        pair_mean,
        pair_sigma,
        mu,
        dense_mean,
        dense_coef,
        (lo + hi) / 2,
    )


def _pair_normal(a: npt.ArrayLike, b: npt.ArrayLike, salt: int) -> F64:
    h = mix64((np.asarray(a).astype(np.uint64) ^ np.uint64(salt)).view(np.int64)) ^ np.asarray(b).astype(np.uint64)
    return _normal(h, 0)


@dataclass(frozen=True)
class SyntheticBatch(Batch):
    """A ``Batch`` that also carries each sample's true logit (float64 ``[B]``): labels are
    ``Bernoulli(sigmoid(logits))``, so ``auc(labels, logits)`` is the Bayes-optimal AUC."""

    logits: torch.Tensor


def synthetic_criteo(
    num_samples: int,
    batch_size: int,
    *,
    seed: int = 0,
    num_dense: int = 13,
    vocab_sizes: Sequence[int] = CRITEO_VOCAB_SIZES,
    zipf_alpha: float = 1.05,
    model_seed: int = 0,
    logit_std: float = 1.4,
    positive_rate: float = 0.25,
    interaction: tuple[int, int] | None = (0, 1),
    rank: int = 0,
    world_size: int = 1,
    start: int = 0,
) -> Iterator[Batch]:
    """A deterministic Criteo-like stream whose labels come from a planted model.

    Feature ``C{f+1}`` draws ids from Zipf(``zipf_alpha``) over ``vocab_sizes[f]``
    (exact inverse CDF: ``searchsorted`` in a cached cumulative table) and emits keys
    ``hash_features(ids, feature_seed(name))``, one per sample. Dense features are
    ``log1p(floor(lognormal))`` counts. The true logit is ``bias + sigma * sum_f
    w_f(id) + pair(id_C1, id_C2) + dense . v`` where ``w_f``, ``pair`` and ``v`` are
    N(0, 1) pure functions of (``model_seed``, feature, id), centred and scaled from
    their exact moments under the Zipf law so that the logit has std ``logit_std``
    (shares 75/15/10 %) and labels have mean about ``positive_rate``. Each batch is a
    ``SyntheticBatch`` (typed ``Batch``, as every data source) carrying the true
    ``logits``; the defaults give a Bayes-optimal AUC of about 0.805.

    Batches depend only on (``seed``, ``model_seed``, the parameters, batch index):
    equal across calls and processes. Eval streams should use another ``seed`` and the
    same ``model_seed``. ``rank``/``world_size`` take the global batches
    ``rank, rank + world_size, ...``: disjoint, and their union is the
    ``world_size=1`` stream; ranks may get one batch fewer than others, and the last
    global batch is short when ``batch_size`` does not divide ``num_samples``. ``start``
    skips the global batches before it (rank ``r`` then takes ``start + r``, ``start + r +
    world_size``, ...): a training group resumed at batch ``start``, on any number of
    ranks, gets the rest of the same stream. The
    first call builds the model (about 0.5 s for the defaults; cached per process).
    Raises ``ValueError`` for out-of-range parameters.

    >>> a = [b.labels for b in synthetic_criteo(10, 4, seed=3)]
    >>> [x.shape[0] for x in a], all(x.equal(y.labels) for x, y in zip(a, synthetic_criteo(10, 4, seed=3)))
    ([4, 4, 2], True)
    """
    if num_samples < 0 or batch_size < 1 or not 0 <= rank < world_size or start < 0:
        raise ValueError(
            f"num_samples={num_samples}, batch_size={batch_size}, rank={rank}, world_size={world_size}, start={start}"
        )
    if (
        not vocab_sizes
        or min(vocab_sizes) < 1
        or num_dense < 0
        or min(zipf_alpha, logit_std) <= 0
        or not 0 < positive_rate < 1
    ):
        raise ValueError(
            f"vocab_sizes={vocab_sizes}, num_dense={num_dense}, zipf_alpha={zipf_alpha}, "
            f"logit_std={logit_std}, positive_rate={positive_rate}: out of range"
        )
    if interaction is not None:
        i, j = interaction
        if i == j or not (0 <= i < len(vocab_sizes) and 0 <= j < len(vocab_sizes)):
            raise ValueError(f"interaction={interaction}: need two distinct indices < {len(vocab_sizes)}, or None")
        if vocab_sizes[i] * vocab_sizes[j] > 1 << 24:
            raise ValueError(f"interaction={interaction}: vocab product {vocab_sizes[i] * vocab_sizes[j]} > 2**24")
    m = _planted(model_seed, tuple(vocab_sizes), zipf_alpha, num_dense, logit_std, positive_rate, interaction)
    names = [f"C{f + 1}" for f in range(len(vocab_sizes))]
    key_seeds = [feature_seed(n) for n in names]
    for b in range(start + rank, -(-num_samples // batch_size), world_size):
        n = min(batch_size, num_samples - b * batch_size)
        # One generator per global batch: a batch depends on (seed, b) only, so ranks are disjoint
        # slices of the same stream and any rank's batches can be regenerated alone.
        rng = np.random.default_rng([seed & _MASK64, b])
        u, zd, ul = rng.random((len(names), n)), rng.standard_normal((n, num_dense)), rng.random(n)
        logit, ids, offsets = np.full(n, m.bias), [], torch.arange(n + 1, dtype=torch.int64)
        sparse: dict[str, JaggedIds] = {}
        for f, name in enumerate(names):
            ids.append(np.minimum(np.searchsorted(m.cdfs[f], u[f], side="right"), vocab_sizes[f] - 1).astype(np.uint64))
            logit += m.sigma * (_normal(ids[f], m.salts[f]) - m.means[f])
            sparse[name] = JaggedIds(torch.from_numpy(hash_features(ids[f], key_seeds[f])), offsets.clone())
        if m.pair is not None:
            logit += m.pair_sigma * (_pair_normal(ids[m.pair[0]], ids[m.pair[1]], m.pair_salt) - m.pair_mean)
        dense = np.log1p(np.floor(np.exp(m.dense_mu + 1.2 * zd)))  # lognormal counts, then log1p
        logit += (dense - m.dense_mean) @ m.dense_coef
        labels = (ul < 0.5 + 0.5 * np.tanh(0.5 * logit)).astype(np.float32)  # sigmoid without exp overflow
        dense_t, labels_t = torch.from_numpy(dense.astype(np.float32)), torch.from_numpy(labels)
        yield SyntheticBatch(dense_t, sparse, labels_t, torch.from_numpy(logit))
