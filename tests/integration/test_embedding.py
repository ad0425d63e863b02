"""DistributedEmbedding modes against real shards: staleness bounds and failure surfacing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from client import InvalidRequestError, PSClient
from worker import DistributedEmbedding, EmbeddingTableConfig, FeatureConfig, JaggedIds

KEYS = [5, 17, 2**40 + 3]
TABLES = [EmbeddingTableConfig("t", 4, optimizer="sgd", initializer="zeros", params={"lr": 1.0})]
FEATURES = [FeatureConfig("f", "t")]


def batch() -> dict[str, JaggedIds]:
    return {"f": JaggedIds.from_lists([KEYS])}


def seen_per_step(addresses: list[str], mode: str, steps: int, staleness: int = 1) -> tuple[list[float], np.ndarray]:
    """Train with loss = sum(pooled): each step pushes gradient 1 to every key (SGD lr 1, rows start at 0).

    Returns the value every step saw (minus the number of pushes already applied) and the final rows.
    """
    seen = []
    with PSClient(addresses) as client:
        emb = DistributedEmbedding(TABLES, FEATURES, client, mode=mode, staleness=staleness)  # type: ignore[arg-type]
        batches = [batch() for _ in range(steps)]
        emb.prefetch(batches[0])
        for t, b in enumerate(batches):
            if t + 1 < steps:
                emb.prefetch(batches[t + 1])
            out = emb(b)["f"]
            seen.append(-float(out.detach()[0, 0]) / len(KEYS))  # each key's row is -(pushes applied)
            out.sum().backward()
        emb.close()
        final = client.lookup("t", np.array(KEYS))
    return seen, final


def test_sync_mode_sees_every_previous_push(addresses: list[str]) -> None:
    seen, final = seen_per_step(addresses, "sync", 6)
    assert seen == [0, 1, 2, 3, 4, 5]
    np.testing.assert_array_equal(final, np.full((3, 4), -6.0, np.float32))


@pytest.mark.parametrize("staleness", [1, 2])
def test_pipelined_rows_are_at_most_staleness_steps_behind(addresses: list[str], staleness: int) -> None:
    steps = 10
    seen, final = seen_per_step(addresses, "pipelined", steps, staleness)
    # Step t's lookup sees exactly the pushes of steps <= t - 1 - staleness: later ones are held
    # until it has read, so the rows do not depend on thread timing.
    assert seen == [max(0, t - staleness) for t in range(steps)], seen
    # Nothing is lost: after close() (a flush) every push is applied exactly once.
    np.testing.assert_array_equal(final, np.full((3, 4), -float(steps), np.float32))


def test_a_failed_background_push_surfaces_in_the_loop(addresses: list[str]) -> None:
    with PSClient(addresses) as client:
        emb = DistributedEmbedding(TABLES, FEATURES, client, mode="pipelined")
        b = batch()
        out = emb(b)["f"]
        (out.sum() * float("nan")).backward()  # the shard rejects NaN gradients
        with pytest.raises(InvalidRequestError, match="NaN/Inf") as err:
            for _ in range(50):  # the push runs in the background: the next calls must raise it
                emb(batch())["f"].sum().backward()
        assert any("background push of step 0" in n for n in getattr(err.value, "__notes__", []))
        with pytest.raises(InvalidRequestError):
            emb.flush()  # and it stays raised


def test_eval_forward_pushes_nothing(addresses: list[str]) -> None:
    with PSClient(addresses) as client:
        emb = DistributedEmbedding(TABLES, FEATURES, client, mode="pipelined").eval()
        for _ in range(3):
            with torch.no_grad():
                out = emb(batch())["f"]
            assert not out.requires_grad
        emb.close()
        assert sum(s["tables"][0]["pushes"] for s in client.admin.stats()) == 0


def test_batch_must_match_the_features(addresses: list[str]) -> None:
    with PSClient(addresses) as client:
        emb = DistributedEmbedding(TABLES, FEATURES, client)
        with pytest.raises(ValueError, match=r"missing \['f'\], unexpected \['g'\]"):
            emb({"g": JaggedIds.from_lists([[1]])})
        with pytest.raises(ValueError, match=r"missing \['f'\], unexpected \['g'\]"):
            emb.prefetch({"g": JaggedIds.from_lists([[1]])})  # at the call, not later in forward
        with pytest.raises(ValueError, match="pooling='sum'"):
            DistributedEmbedding(TABLES, [FeatureConfig("f", "t", "mean")], client)(
                {"f": JaggedIds.from_lists([[1, 2]], weights=[[0.5, 0.5]])}
            )
        emb.close()


def shard_lookups(client: PSClient) -> int:
    return sum(s["tables"][0]["lookups"] for s in client.admin.stats())


def test_a_prefetched_batch_is_planned_off_the_training_thread(addresses: list[str]) -> None:
    with PSClient(addresses) as client:
        planned_on: list[str] = []
        plan = client.plan

        def recording_plan(*args: object, **kwargs: object) -> object:
            planned_on.append(threading.current_thread().name)
            return plan(*args, **kwargs)  # type: ignore[arg-type]

        client.plan = recording_plan  # type: ignore[method-assign]
        emb = DistributedEmbedding(TABLES, FEATURES, client, mode="pipelined")
        first, second = batch(), batch()
        emb.prefetch(first)
        emb.prefetch(second)
        emb(first)["f"].sum().backward()
        out = emb(second)["f"]
        out.sum().backward()
        emb.close()
        assert planned_on and all(name.startswith("ps-lookup") for name in planned_on), planned_on
        # Step 1 saw no push (staleness 1), as when the training thread planned it.
        np.testing.assert_array_equal(out.detach().numpy(), np.zeros((1, 4), np.float32))


def test_a_skipped_backward_does_not_stall_the_pipeline(addresses: list[str]) -> None:
    from client import ClientConfig

    with PSClient(addresses, ClientConfig(deadline_s=5)) as client:
        emb = DistributedEmbedding(TABLES, FEATURES, client, mode="pipelined")
        batches = [batch() for _ in range(6)]
        emb.prefetch(batches[0])
        started = time.monotonic()
        for t, b in enumerate(batches):
            if t + 1 < len(batches):
                emb.prefetch(batches[t + 1])
            out = emb(b)["f"]
            if t != 2:  # step 2 is dropped (e.g. a bad batch): its graph is freed, nothing pushed
                out.sum().backward()
            del out
        emb.close()
        assert time.monotonic() - started < 4  # no wait for the dropped step's push
        np.testing.assert_array_equal(client.lookup("t", np.array(KEYS)), np.full((3, 4), -5.0, np.float32))


def test_gradient_accumulation_keeps_the_staleness_bound(addresses: list[str]) -> None:
    with PSClient(addresses) as client:
        emb = DistributedEmbedding(TABLES, FEATURES, client, mode="pipelined", staleness=1)
        seen = []
        for _pair in range(3):  # two forwards, then one backward through both
            outs = [emb(batch())["f"] for _ in range(2)]
            seen += [-float(o.detach()[0, 0]) / len(KEYS) for o in outs]
            (outs[0].sum() + outs[1].sum()).backward()
        emb.close()
        assert seen == [max(0, step - 1) for step in range(6)], seen  # exactly the pushes through step - 2
        np.testing.assert_array_equal(client.lookup("t", np.array(KEYS)), np.full((3, 4), -6.0, np.float32))


def test_evaluation_between_steps_keeps_prefetching(addresses: list[str]) -> None:
    with PSClient(addresses) as client:
        emb = DistributedEmbedding(TABLES, FEATURES, client, mode="pipelined")
        batches = [batch() for _ in range(8)]
        emb.prefetch(batches[0])
        evals = 0
        for t, b in enumerate(batches):
            if t + 1 < len(batches):
                emb.prefetch(batches[t + 1])
            emb(b)["f"].sum().backward()
            if t % 3 == 0:
                emb.eval()
                with torch.no_grad():
                    emb(batch())
                emb.train()
                evals += 1
        emb.close()
        # One lookup per training step (every prefetch was used) plus one per evaluation.
        assert shard_lookups(client) == (len(batches) + evals) * len(KEYS)
        np.testing.assert_array_equal(client.lookup("t", np.array(KEYS)), np.full((3, 4), -8.0, np.float32))


def test_flush_waits_for_every_push_of_a_step(addresses: list[str]) -> None:
    with PSClient(addresses) as client:
        emb = DistributedEmbedding(TABLES, FEATURES, client, mode="pipelined")
        out = emb(batch())["f"]
        out.sum().backward(retain_graph=True)
        out.sum().backward()  # a second backward through the same step pushes again
        emb.flush()
        np.testing.assert_array_equal(client.lookup("t", np.array(KEYS)), np.full((3, 4), -2.0, np.float32))
        emb.close()


def test_a_stalled_pipeline_raises_a_ps_error(addresses: list[str]) -> None:
    from client import ClientConfig, DeadlineExceededError, PSError

    with PSClient(addresses, ClientConfig(deadline_s=1)) as client:
        emb = DistributedEmbedding(TABLES, FEATURES, client, mode="pipelined", staleness=1)
        kept = [emb(batch())["f"], emb(batch())["f"]]  # two forwards, no backward, graphs kept alive
        with pytest.raises(DeadlineExceededError, match="finish its backward") as err:
            emb(batch())  # step 2 must see step 0's push, which cannot come
        assert isinstance(err.value, PSError)
        del kept
        emb.close()
