"""Replica membership: entries that resolve, files that change, and which replica a call goes to."""

from __future__ import annotations

from pathlib import Path

import pytest

from client import PSClient
from client.errors import InvalidRequestError
from client.membership import Members, resolve_name
from client.replicas import OK, ReplicaSet, parse_addresses


def replica_set(replicas: list[list[str]]) -> ReplicaSet:
    return ReplicaSet(replicas, eject_after_failures=1, eject_s=1.0, eject_max_s=30.0)


class Names:
    """A resolver whose answers the test sets; ``None`` fails to resolve."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str] | None] = {}

    def __call__(self, host: str, port: int) -> list[str]:
        found = self.answers[host]
        if found is None:
            raise OSError("Name or service not known")
        return [f"{ip}:{port}" for ip in found]


def test_dns_entries_parse_and_resolve_to_every_address_then_keep_the_last_on_failure() -> None:
    assert parse_addresses("dns:serve-0.ps:50051+10.0.0.9:1,dns:serve-1.ps:50051") == [
        ["dns:serve-0.ps:50051", "10.0.0.9:1"],
        ["dns:serve-1.ps:50051"],
    ]
    with pytest.raises(InvalidRequestError, match="'dns:serve-0' is not HOST:PORT"):
        parse_addresses("dns:serve-0")
    names = Names()
    members = Members(parse_addresses("dns:a:7+10.0.0.9:1,dns:b:7"), resolve=names)
    assert members.dynamic
    assert members.placeholders() == [["a:7", "10.0.0.9:1"], ["b:7"]]
    names.answers = {"a": ["10.0.0.1", "10.0.0.2"], "b": ["10.0.1.1"]}
    resolved, server_names = members.resolve()
    assert resolved == [["10.0.0.1:7", "10.0.0.2:7", "10.0.0.9:1"], ["10.0.1.1:7"]]
    assert server_names == {"10.0.0.1:7": "a", "10.0.0.2:7": "a", "10.0.1.1:7": "b"}
    names.answers = {"a": None, "b": ["10.0.1.1", "10.0.1.2"]}  # a's name server is down: keep what it said
    assert members.resolve()[0] == [["10.0.0.1:7", "10.0.0.2:7", "10.0.0.9:1"], ["10.0.1.1:7", "10.0.1.2:7"]]
    assert not Members([["h:1"], ["h:2"]]).dynamic


def test_localhost_resolves_to_loopback() -> None:
    assert "127.0.0.1:5" in resolve_name("localhost", 5)


def test_an_addresses_file_is_read_again_and_a_bad_one_keeps_the_last(tmp_path: Path) -> None:
    path = tmp_path / "addresses"
    with pytest.raises(InvalidRequestError, match=f"addresses file {path}: cannot read it"):
        Members(path=path)
    path.write_text("h:1,h:2 ,\n")
    with pytest.raises(InvalidRequestError, match=f"addresses file {path}: .*shard 2 is empty"):
        PSClient(addresses_file=path)
    path.write_text("h:1,h:2\n")
    members = Members(path=path)
    assert members.dynamic and members.spec == [["h:1"], ["h:2"]]
    assert not members.reread()
    path.write_text("h:1+h:3,\nh:2\n")  # line breaks and spaces do not matter
    assert members.reread() and members.spec == [["h:1", "h:3"], ["h:2"]]
    path.write_text("h:1+,h:2")
    assert not members.reread() and members.spec == [["h:1", "h:3"], ["h:2"]]
    path.unlink()
    assert not members.reread() and members.spec == [["h:1", "h:3"], ["h:2"]]


def test_a_client_takes_addresses_or_a_file_not_both(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="one of the two"):
        PSClient()
    path = tmp_path / "a"
    path.write_text("h:1")
    with pytest.raises(InvalidRequestError, match="one of the two"):
        PSClient(["h:1"], addresses_file=path)


def test_calls_go_to_serving_replicas_then_draining_ones_and_never_to_one_that_left() -> None:
    rs = replica_set([["h:1", "h:2"]])
    change = rs.set_members(0, ["h:1", "h:2", "h:3"])
    assert change.joined == change.new == (2,) and rs.state(2) == "pending"
    picks = {rs.pick(0).endpoint for _ in range(20)}
    assert picks == {0, 1}  # the pending one waits for its health check
    assert rs.set_health(2, True) and rs.state(2) == "serving"
    assert {rs.pick(0).endpoint for _ in range(30)} == {0, 1, 2}
    assert rs.set_health(0, False) and rs.state(0) == "draining"
    assert not rs.set_health(0, False)
    assert {rs.pick(0).endpoint for _ in range(20)} == {1, 2}
    assert rs.set_members(0, ["h:1"]).left == (1, 2)
    assert rs.pick(0).endpoint == 0  # draining, but the only one left: better than nothing
    assert rs.addresses == ["h:1"] and rs.all_addresses == ["h:1", "h:2", "h:3"]
    assert not rs.set_health(1, True) and rs.state(1) == "gone"
    again = rs.set_members(0, ["h:1", "h:3"])
    assert again.joined == (2,) and again.new == ()  # back under its old endpoint
    assert [h["state"] for h in rs.health()] == ["draining", "pending"]


def test_a_pending_replica_is_called_when_its_shard_has_nothing_else() -> None:
    rs = replica_set([["h:1"]])
    rs.set_members(0, ["h:2"])
    pick = rs.pick(0)
    assert pick.endpoint == 1
    rs.release(pick, OK)
    with pytest.raises(InvalidRequestError, match="shard 0 has no replica"):
        replica_set([[]]).pick(0)
