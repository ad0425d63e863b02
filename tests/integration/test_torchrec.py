"""worker.torchrec against TorchRec's own modules, on real shards.

The twin of each run is TorchRec's in-process module (``nn.EmbeddingBag`` per table) started
from the rows the shards hand out (``initial_rows`` of the same seed and initializer) and trained
by the same optimizer: sync mode is bit-equal to it. TorchRec's models (DLRM, DLRM_DCN, DeepFM)
take the module in place of ``EmbeddingBagCollection`` unchanged, fed by TorchRec's own
``RandomRecDataset``. Skipped where TorchRec is not installed.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

torchrec = pytest.importorskip("torchrec", reason="TorchRec not installed (the README's set-up line installs it)")

from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec import (  # noqa: E402
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)
from torchrec.datasets.random import RandomRecDataset  # noqa: E402
from torchrec.models.deepfm import SimpleDeepFMNN  # noqa: E402
from torchrec.models.dlrm import DLRM, DLRM_DCN  # noqa: E402

from client import PSClient  # noqa: E402
from ps.table import InitializerParams  # noqa: E402
from ps.table.initializers import initial_rows  # noqa: E402
from tests.integration.shards import start_shard, stop_shard  # noqa: E402
from tests.twins import RowwiseAdagrad  # noqa: E402
from worker.torchrec import PSEmbeddingBagCollection, PSEmbeddingCollection  # noqa: E402

VOCAB, DIM, BATCH, STEPS = 30, 8, 12, 8


@pytest.fixture(scope="module")
def addresses(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two shards for the whole module (each test names its own tables)."""
    root = tmp_path_factory.mktemp("shards")
    shards = [start_shard(i, 2, root) for i in range(2)]
    try:
        yield [s.address for s in shards]
    finally:
        for s in shards:
            stop_shard(s)


def configs() -> list[EmbeddingBagConfig]:
    """Feature "f_shared" is read by two tables; "t_mean" pools by mean; dims differ."""
    return [
        EmbeddingBagConfig(name="t_sum", embedding_dim=DIM, num_embeddings=VOCAB, feature_names=["f_a", "f_shared"]),
        EmbeddingBagConfig(
            name="t_mean",
            embedding_dim=4,
            num_embeddings=VOCAB,
            feature_names=["f_b", "f_shared"],
            pooling=PoolingType.MEAN,
            weight_init_min=-0.5,
            weight_init_max=0.5,
        ),
    ]


def kjts(keys: list[str], seed: int, *, weighted: bool = False, steps: int = STEPS) -> list[KeyedJaggedTensor]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(0, 4, BATCH * len(keys))  # empty bags included
        values = rng.integers(0, VOCAB, int(lengths.sum()))
        weights = torch.from_numpy(rng.random(len(values)).astype(np.float32)) if weighted else None
        out.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=keys, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths), weights=weights
            )
        )
    return out


def twin_of(ps_module: Any, local: torch.nn.Module, tables: list[Any]) -> None:
    """Set each table of TorchRec's ``local`` module to the rows the shards start ``ps_module``'s from."""
    bags = getattr(local, "embedding_bags", None) or local.embeddings  # type: ignore[union-attr]
    for c in tables:
        t = ps_module.embedding.tables[c.name]
        init = InitializerParams(low=t.params["low"], high=t.params["high"])
        rows = initial_rows(init, t.seed, np.arange(c.num_embeddings), c.embedding_dim)
        with torch.no_grad():
            bags[c.name].weight.copy_(torch.from_numpy(rows))


def shard_rows(client: PSClient, tables: list[Any]) -> dict[str, np.ndarray]:
    return client.lookup_many({c.name: np.arange(c.num_embeddings) for c in tables})


def test_pooled_outputs_and_sgd_steps_equal_torchrec_ebc(addresses: list[str]) -> None:
    tables = configs()
    with PSClient(addresses) as client:
        ebc = PSEmbeddingBagCollection(
            tables, client, {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5}, "sync"
        )
        local = EmbeddingBagCollection(copy.deepcopy(tables))
        twin_of(ebc, local, tables)
        opt = torch.optim.SGD(local.parameters(), lr=0.5)
        head = torch.nn.Linear(2 * DIM + 2 * 4, 1)
        for kjt in kjts(["f_a", "f_shared", "f_b"], 1):
            ours, theirs = ebc(kjt), local(kjt)
            assert ours.keys() == theirs.keys() == ["f_a", "f_shared@t_sum", "f_b", "f_shared@t_mean"]
            assert ours.length_per_key() == theirs.length_per_key() == [DIM, DIM, 4, 4]
            torch.testing.assert_close(ours.values(), theirs.values(), rtol=0, atol=0)
            head(ours.values()).sum().backward()
            opt.zero_grad()
            head(theirs.values()).sum().backward()
            opt.step()
        ebc.close()
        rows = shard_rows(client, tables)
    for c in tables:
        np.testing.assert_array_equal(rows[c.name], local.embedding_bags[c.name].weight.detach().numpy())
    assert not np.allclose(rows["t_mean"], 0)


def test_weighted_kjt_pools_with_its_weights(addresses: list[str]) -> None:
    tables = [EmbeddingBagConfig(name="t_w", embedding_dim=DIM, num_embeddings=VOCAB, feature_names=["f_w"])]
    with PSClient(addresses) as client:
        ebc = PSEmbeddingBagCollection(tables, client, {"optimizer": EmbOptimType.EXACT_SGD}, "sync", is_weighted=True)
        local = EmbeddingBagCollection(copy.deepcopy(tables), is_weighted=True)
        twin_of(ebc, local, tables)
        assert ebc.is_weighted()
        for kjt in kjts(["f_w"], 2, weighted=True, steps=3):
            torch.testing.assert_close(ebc(kjt).values(), local(kjt).values(), rtol=0, atol=0)
        ebc.close()


@pytest.mark.parametrize(
    ("fused", "sparse_opt"),
    [
        ({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}, lambda p: torch.optim.SGD(p, lr=0.1)),
        ({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}, lambda p: RowwiseAdagrad(p, lr=0.1)),
    ],
    ids=["exact_sgd", "exact_rowwise_adagrad"],
)
def test_dlrm_trains_bit_equal_to_dlrm_on_torchrec_ebc(
    addresses: list[str], fused: dict[str, Any], sparse_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
) -> None:
    """TorchRec's DLRM, SGD on its dense parameters, on our module through 2 shards (sync) and on
    TorchRec's own: the losses of every step and the final rows and weights are bit-equal."""
    keys = ["c0", "c1", "c2"]
    tables = [
        EmbeddingBagConfig(
            name=f"dlrm_{fused['optimizer']}_{k}", embedding_dim=DIM, num_embeddings=VOCAB, feature_names=[k]
        )
        for k in keys
    ]
    data = iter(RandomRecDataset(keys, BATCH, hash_size=VOCAB, ids_per_feature=3, num_dense=5, manual_seed=3))
    batches = [next(data) for _ in range(STEPS)]

    def model(ebc: Any) -> DLRM:
        torch.manual_seed(0)
        return DLRM(ebc, dense_in_features=5, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])

    with PSClient(addresses) as client:
        ebc = PSEmbeddingBagCollection(tables, client, fused, "sync")
        ours = model(ebc)
        local_ebc = EmbeddingBagCollection(copy.deepcopy(tables))
        twin_of(ebc, local_ebc, tables)
        theirs = model(local_ebc)
        assert [n for n, _ in ours.named_parameters()] == [
            n for n, _ in theirs.named_parameters() if not n.startswith("sparse_arch.embedding_bag_collection.")
        ]
        dense_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
        dense_theirs = torch.optim.SGD([p for n, p in theirs.named_parameters() if "embedding_bags" not in n], lr=0.1)
        sparse_theirs = sparse_opt(list(local_ebc.parameters()))
        loss_fn = torch.nn.BCEWithLogitsLoss()
        for b in batches:
            loss_ours = loss_fn(ours(b.dense_features, b.sparse_features).squeeze(-1), b.labels.float())
            dense_ours.zero_grad()
            loss_ours.backward()
            dense_ours.step()
            loss_theirs = loss_fn(theirs(b.dense_features, b.sparse_features).squeeze(-1), b.labels.float())
            dense_theirs.zero_grad()
            sparse_theirs.zero_grad()
            loss_theirs.backward()
            dense_theirs.step()
            sparse_theirs.step()
            assert loss_ours.item() == loss_theirs.item()
        ebc.close()
        rows = shard_rows(client, tables)
    for c in tables:
        np.testing.assert_array_equal(rows[c.name], local_ebc.embedding_bags[c.name].weight.detach().numpy())
    for (n, p), q in zip(
        ours.named_parameters(), [q for n, q in theirs.named_parameters() if "embedding_bags" not in n]
    ):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


def test_embedding_collection_equals_torchrec_ec(addresses: list[str]) -> None:
    tables = [EmbeddingConfig(name="t_seq", embedding_dim=DIM, num_embeddings=VOCAB, feature_names=["f_seq", "f_hist"])]
    with PSClient(addresses) as client:
        ec = PSEmbeddingCollection(
            tables, client, {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5}, "sync", need_indices=True
        )
        local = EmbeddingCollection(copy.deepcopy(tables), need_indices=True)
        twin_of(ec, local, tables)
        opt = torch.optim.SGD(local.parameters(), lr=0.5)
        scale = torch.linspace(-1, 1, DIM)
        for kjt in kjts(["f_seq", "f_hist"], 4, steps=4):
            ours, theirs = ec(kjt), local(kjt)
            assert list(ours) == list(theirs) == ["f_seq", "f_hist"]
            for k in ours:
                torch.testing.assert_close(ours[k].values(), theirs[k].values(), rtol=0, atol=0)
                torch.testing.assert_close(ours[k].lengths(), theirs[k].lengths())
                torch.testing.assert_close(ours[k].weights().to(torch.int64), theirs[k].weights().to(torch.int64))
            sum((j.values() * scale).sum() for j in ours.values()).backward()
            opt.zero_grad()
            sum((j.values() * scale).sum() for j in theirs.values()).backward()
            opt.step()
        ec.close()
        rows = shard_rows(client, tables)
    np.testing.assert_array_equal(rows["t_seq"], local.embeddings["t_seq"].weight.detach().numpy())


@pytest.mark.parametrize("which", ["dlrm_dcn", "deepfm"])
def test_torchrec_models_train_on_it_pipelined(addresses: list[str], which: str) -> None:
    keys = ["c0", "c1"]
    tables = [
        EmbeddingBagConfig(name=f"{which}_{k}", embedding_dim=DIM, num_embeddings=1000, feature_names=[k]) for k in keys
    ]
    data = iter(RandomRecDataset(keys, 64, hash_size=1000, ids_per_feature=2, num_dense=4, manual_seed=5))
    with PSClient(addresses) as client:
        ebc = PSEmbeddingBagCollection(tables, client, {"learning_rate": 0.05})
        before = shard_rows(client, tables)
        torch.manual_seed(0)
        if which == "deepfm":
            model: torch.nn.Module = SimpleDeepFMNN(4, ebc, hidden_layer_size=8, deep_fm_dimension=4)
        else:
            model = DLRM_DCN(ebc, 4, [8, DIM], [8, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
        batches = [next(data) for _ in range(6)]
        for b, nxt in zip(batches, batches[1:] + [None]):
            if nxt is not None:
                ebc.prefetch(nxt.sparse_features)  # the next lookup overlaps this step
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                model(b.dense_features, b.sparse_features).squeeze(-1), b.labels.float()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert torch.isfinite(loss)
        ebc.flush()
        after = shard_rows(client, tables)
        ebc.close()
    seen = np.unique(np.concatenate([b.sparse_features["c0"].values().numpy() for b in batches]))
    table = f"{which}_c0"
    assert not np.array_equal(after[table][seen], before[table][seen])  # the sparse rows trained
    unseen = np.setdiff1d(np.arange(1000), seen)
    np.testing.assert_array_equal(after[table][unseen], before[table][unseen])


def _bad(client: PSClient, tables: list[Any], **kwargs: Any) -> None:
    PSEmbeddingBagCollection(tables, client, **kwargs)


@pytest.mark.parametrize(
    ("tables", "kwargs", "message"),
    [
        (
            [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10)],
            {},
            "table 't': feature_names is empty",
        ),
        (
            [EmbeddingBagConfig(name="", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
            {},
            "tables[0]: name is empty",
        ),
        (
            [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
            {"fused_params": {"optimizer": EmbOptimType.LAMB}},
            "fused_params: optimizer=lamb: not supported",
        ),
        (
            [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
            {"fused_params": {"weight_decay": 0.01}},
            "weight_decay=0.01 with weight_decay_mode=NONE",
        ),
        (
            [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
            {"fused_params": {"momentum": 0.9}},
            "fused_params: 'momentum' not supported",
        ),
        (
            [
                EmbeddingBagConfig(
                    name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"], init_fn=torch.nn.init.ones_
                )
            ],
            {},
            "table 't': init_fn=",
        ),
        (
            [
                EmbeddingBagConfig(
                    name="t",
                    embedding_dim=4,
                    num_embeddings=10,
                    feature_names=["f"],
                    data_type=torchrec.DataType.INT8,
                )
            ],
            {},
            "table 't': data_type=INT8",
        ),
    ],
)
def test_config_mistakes_name_the_table_or_key(addresses: list[str], tables: Any, kwargs: Any, message: str) -> None:
    with PSClient(addresses) as client, pytest.raises(ValueError, match=_literal(message)):
        _bad(client, tables, **kwargs)


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def test_batch_mistakes_name_the_feature(addresses: list[str]) -> None:
    tables = [EmbeddingBagConfig(name="t_bad", embedding_dim=4, num_embeddings=10, feature_names=["f", "g"])]
    with PSClient(addresses) as client:
        ebc = PSEmbeddingBagCollection(tables, client, check_ids=True, is_weighted=True)
        one = functools.partial(KeyedJaggedTensor.from_lengths_sync, lengths=torch.tensor([1, 1]))
        with pytest.raises(ValueError, match=r"no key for \['g'\]"):
            ebc(one(keys=["f", "h"], values=torch.tensor([1, 2]), weights=torch.ones(2)))
        with pytest.raises(ValueError, match=r"no table reads the KeyedJaggedTensor key\(s\) \['h'\]"):
            ebc(
                KeyedJaggedTensor.from_lengths_sync(
                    keys=["f", "g", "h"],
                    values=torch.tensor([1, 2, 3]),
                    lengths=torch.tensor([1, 1, 1]),
                    weights=torch.ones(3),
                )
            )
        with pytest.raises(ValueError, match="is_weighted=True.*has no weights"):
            ebc(one(keys=["f", "g"], values=torch.tensor([1, 2])))
        with pytest.raises(ValueError, match=r"feature 'g': id 10 outside \[0, 10\) of table 't_bad'"):
            ebc(one(keys=["f", "g"], values=torch.tensor([1, 10]), weights=torch.ones(2)))
        ebc.close()
        # The same name with another dim on the shards: the shard's error names the difference.
        other = [EmbeddingBagConfig(name="t_bad", embedding_dim=8, num_embeddings=10, feature_names=["f"])]
        with pytest.raises(Exception, match="dim"):
            PSEmbeddingBagCollection(other, client)


def test_embedding_collection_needs_one_dim(addresses: list[str]) -> None:
    tables = [
        EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"]),
        EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=10, feature_names=["g"]),
    ]
    with PSClient(addresses) as client, pytest.raises(ValueError, match=r"embedding_dim differs \(a: 4, b: 8\)"):
        PSEmbeddingCollection(tables, client)


CRITEO = Path(__file__).resolve().parents[3] / "shared" / "data" / "criteo_kaggle_train_head10k.txt"


@pytest.mark.skipif(not CRITEO.is_file(), reason=f"no Criteo sample at {CRITEO}")
def test_torchrec_criteo_pipeline_batches_train_with_raw_ids(addresses: list[str], tmp_path: Path) -> None:
    """TorchRec's Criteo pipeline (TSV -> .npy -> ``InMemoryBinaryCriteoIterDataPipe``) feeds its
    ``Batch``es to a DLRM on the shards unchanged. Without ``hashes`` its ids are the raw hashed
    values (up to 2**32): each is a key of its own, so the shards hold one row per distinct id."""
    pytest.importorskip("iopath", reason="iopath not installed (TorchRec's datasets extra)")
    from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, BinaryCriteoUtils, InMemoryBinaryCriteoIterDataPipe

    files = [str(tmp_path / f"{n}.npy") for n in ("dense", "sparse", "labels")]
    BinaryCriteoUtils.tsv_to_npys(str(CRITEO), *files, dataset_name="criteo_kaggle")
    pipe = InMemoryBinaryCriteoIterDataPipe("train", [files[0]], [files[1]], [files[2]], 512, rank=0, world_size=1)
    names = list(DEFAULT_CAT_NAMES)
    tables = [
        EmbeddingBagConfig(name=f"criteo_{f}", embedding_dim=DIM, num_embeddings=1000, feature_names=[f]) for f in names
    ]
    with PSClient(addresses) as client:
        ebc = PSEmbeddingBagCollection(tables, client, {"learning_rate": 0.05})
        torch.manual_seed(0)
        model = DLRM(ebc, dense_in_features=13, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
        seen = []
        for batch in itertools.islice(pipe, 6):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                model(batch.dense_features, batch.sparse_features).squeeze(-1), batch.labels.float()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert torch.isfinite(loss)
            seen.append(batch.sparse_features)
        ebc.flush()
        rows = {t["name"]: 0 for t in client.admin.stats()[0]["tables"]}
        for shard in client.admin.stats():
            for t in shard["tables"]:
                rows[t["name"]] += int(t["rows"])
        ebc.close()
    for f in ("cat_0", "cat_2"):
        ids = torch.cat([kjt[f].values() for kjt in seen])
        assert int(ids.max()) > 1000  # raw ids, far past num_embeddings
        assert rows[f"criteo_{f}"] == int(torch.unique(ids).numel())
