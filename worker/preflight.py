"""Before ``ps-infer`` serves: are the shards at ``--ps`` the cluster the model was trained on?

``check_shards`` compares what the shards report (``Stats``, and the tables of shard 0)
with the run's manifest: the shard count and each replica's place in ``--ps``, every
table of the model with its dim and seed, rows on a shard where training left some, and
the lineage of each shard's rows (``Stats.lineage``: which data they are; the manifest's
``shard_lineages``). Any of these wrong, and scores would be silently wrong (rows of
other keys or another data set, defaults, another shard's keys).

Right after training, serving shards may still be loading: a follower not connected to
its training shard yet, or still applying its snapshot, holds no tables, no rows or the
rows of its last leader; a shard may not answer yet. Those problems may go away by
themselves, so for up to ``wait_s`` they are checked again (every ``RECHECK_S``), and
what is waited for is logged when it changes. A problem no loading explains (a count or
order mismatch, a dim, a seed, another lineage on a shard that is caught up) fails at
once. Either way the failure is one ``RuntimeError`` line naming every problem.

Example (``client`` a ``PSClient`` of the shards)::

    check_shards(model.manifest, model.dims, client, "h:1,h:2", wait_s=10.0)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from client import PSClient, PSError

__all__ = ["RECHECK_S", "check_shards"]

log = logging.getLogger(__name__)

RECHECK_S = 0.5  # how often shards that are still loading are asked again
_LOG_EVERY_S = 5.0  # what is waited for is logged when it changes, at most this often


@dataclass
class _Findings:
    """What one look at the shards found: ``problems`` (one line each) and whether all of
    them may still go away by themselves (shards loading or not answering yet)."""

    problems: list[str] = field(default_factory=list)
    passing: bool = True


def check_shards(
    manifest: Mapping[str, Any], dims: Mapping[str, int], client: PSClient, ps: str, wait_s: float = 0.0
) -> None:
    """Return once the shards of ``client`` (given as ``ps`` on the command line) are the
    cluster ``manifest`` was trained on, with the tables ``dims``; blocks up to ``wait_s``
    seconds while they are still loading (see the module docstring). Raises
    ``RuntimeError`` with one line naming what differs.
    """
    try:
        client.refresh_map()  # given the addresses of a cluster resharded since, route by its map
    except PSError:
        pass  # not answering yet: the looks below wait for it, or say so
    n = client.num_shards
    trained_on = manifest.get("num_shards")
    if isinstance(trained_on, int) and trained_on != n and client.epoch:
        log.info(
            "the model was trained on %d shards; the cluster was resharded live since (now %d shards, cluster map "
            "epoch %d): the rows moved with their keys, serving from them",
            trained_on,
            n,
            client.epoch,
        )
    elif isinstance(trained_on, int) and trained_on != n:
        raise RuntimeError(
            f"--ps names {n} shard{'s' if n != 1 else ''} ({ps}), but the model was trained on "
            f"{trained_on} shard{'s' if trained_on != 1 else ''}: give every shard in shard order, ',' between "
            "shards and '+' between the replicas of one ('|' works only quoted: a shell reads it as a pipe)"
        )
    deadline = time.monotonic() + wait_s
    logged: list[str] = []
    logged_at = -_LOG_EVERY_S
    while True:
        found = _look(manifest, dims, client)
        if not found.problems:
            if logged:
                log.info("the shards at --ps have loaded: serving")
            return
        now = time.monotonic()
        left = deadline - now
        if not found.passing or left <= 0:
            waited = f" (after waiting {wait_s:g} s, --wait-s)" if found.passing and wait_s > 0 else ""
            raise RuntimeError(f"the shards at --ps {ps} do not match the model: {'; '.join(found.problems)}{waited}")
        if found.problems != logged and now - logged_at >= _LOG_EVERY_S:
            log.info("waiting up to %.0f s for the shards at --ps: %s", left, "; ".join(found.problems))
            logged, logged_at = found.problems, now
        time.sleep(min(RECHECK_S, left))


def _look(manifest: Mapping[str, Any], dims: Mapping[str, int], client: PSClient) -> _Findings:
    """One check of every replica (``check_shards``)."""
    n = client.num_shards
    try:
        stats = client.admin.stats()
    except PSError as exc:
        # Not answering yet (starting, restarting) may pass; anything else will not.
        waiting = exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        return _Findings([str(exc)], passing=waiting)
    found = _Findings()
    shard_of = [i for i, replicas in enumerate(client.replicas) for _ in replicas]
    trained_rows = manifest.get("shard_rows") or []
    trained_lineages = manifest.get("shard_lineages") or []
    for i, s in zip(shard_of, stats, strict=True):
        where = s["address"]
        if s["num_shards"] != n:
            found.problems.append(f"{where} is shard {s['shard']} of {s['num_shards']}, but --ps names {n} shards")
            found.passing = False
            continue
        if s["shard"] != i:
            found.problems.append(
                f"{where} is shard {s['shard']}, but --ps gives it as shard {i}: list shards in shard order"
            )
            found.passing = False
            continue
        problems: list[str] = []
        held = {t["name"]: t for t in s["tables"]}
        for table, dim in dims.items():
            if table not in held:
                problems.append(
                    f"table {table!r} is not on {where} (it holds {', '.join(sorted(held)) or 'no tables'})"
                )
            elif held[table]["dim"] != dim:
                problems.append(f"table {table!r}: dim {held[table]['dim']} on the shards, {dim} in the model")
        rows = sum(int(held[t]["rows"]) for t in dims if t in held)
        if not problems and i < len(trained_rows) and trained_rows[i] and not rows:
            problems.append(
                f"{where} (shard {i}) holds no rows of the model's tables, training left {trained_rows[i]} there "
                "(a serving shard still loading, or the shards of another run)"
            )
        lineage = trained_lineages[i] if i < len(trained_lineages) else ""
        if not problems and lineage and s["lineage"] and s["lineage"] != lineage:
            problems.append(
                f"{where} (shard {i}) holds the rows of other data (lineage {s['lineage']}) than the model was "
                f"trained on (lineage {lineage}): the shards of another cluster, or a shard restarted without its "
                "data dir; give --ps the shards the model was trained on, or serving shards that follow them"
            )
        loading = _loading(s)
        if not loading and not rows and _following(s):
            # Caught up by its counters but holding none of the rows training left: a snapshot
            # whose rows are still going in (Stats does not wait for it). Wait and see.
            loading = f"no rows loaded from {s['follow']['leader']} yet"
        if problems and loading:
            problems = [f"{where} (shard {i}) is a serving shard still loading ({loading}): {'; '.join(problems)}"]
        elif lineage and not s["lineage"] and loading:
            problems = [f"{where} (shard {i}) is a serving shard still loading ({loading})"]
        found.problems += problems
        found.passing = found.passing and (not problems or bool(loading))
    if not found.problems:
        tables = client.admin.tables()
        seeds = {t["name"]: t.get("seed") for t in manifest.get("tables", [])}
        for table, seed in seeds.items():
            if table in tables and isinstance(seed, int) and tables[table].seed != seed:
                found.problems.append(f"table {table!r}: seed {tables[table].seed} on the shards, {seed} in the model")
                found.passing = False
    found.problems = list(dict.fromkeys(found.problems))
    return found


def _following(s: Mapping[str, Any]) -> bool:
    """Whether a shard (its ``Stats``) is a serving shard following a training shard."""
    return s.get("mode") == "serve" and (s.get("follow") or {}).get("source") == "follow"


def _loading(s: Mapping[str, Any]) -> str:
    """How a following serving shard (its ``Stats``) is still catching up with its training
    shard, or "" when it is not (caught up, or not a follower)."""
    f = s.get("follow") or {}
    if not _following(s):
        return ""
    if not f["connected"]:
        return f"not connected to {f['leader']}" + (f": {f['error']}" if f.get("error") else "")
    if not s["lineage"]:
        return f"nothing loaded from {f['leader']} yet"
    if f["lag_versions"]:
        return f"{f['lag_versions']} versions behind {f['leader']}"
    return ""
