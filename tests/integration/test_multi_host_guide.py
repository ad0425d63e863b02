"""The multi-host guide (docs/guides/multi-host.md) runs as written, each host a network
namespace of its own.

Each host the page names gets a namespace with its address on an interface ``eth0``,
joined to the others by a bridge (an address-less switch in this namespace), and so does
"your machine" (``operator``, at .5): nothing changes in this namespace's own routes. Every shell block marked
``<!-- host: A B -->`` runs, unchanged, in page order, once in each host it names (at the
same time when it names several: both worker hosts start torchrun together), after every
``host: all`` block before it; a block runs only once the one before it ended on every
host. Servers a block starts in the background keep running in their namespace until
the test ends. The hosts share this file system, where real hosts would copy the
certificates and the run directory (the page says so).

Needs root (namespaces, a bridge); skipped elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_docs import ROOT, _workdir, blocks

PAGE = ROOT / "docs" / "guides" / "multi-host.md"
SUBNET = "198.51.100"  # TEST-NET-2: documentation addresses, routed nowhere
BLOCK_TIMEOUT_S = 400


# The page's hosts and their addresses, as its table and its "On every host" block give them.
HOSTS = {
    "shard-0": f"{SUBNET}.11",
    "shard-1": f"{SUBNET}.12",
    "shard-2": f"{SUBNET}.13",
    "worker-0": f"{SUBNET}.21",
    "worker-1": f"{SUBNET}.22",
    "serving": f"{SUBNET}.31",
    "operator": f"{SUBNET}.5",
}


def test_the_page_names_the_hosts_this_test_builds() -> None:
    text = PAGE.read_text()
    shards = ",".join(HOSTS[f"shard-{i}"] for i in range(3))
    workers = ",".join(HOSTS[f"worker-{i}"] for i in range(2))
    for line in (f"SHARD_HOSTS={shards}", f"WORKER_HOSTS={workers}", f"SERVING={HOSTS['serving']}"):
        assert line in text, f"{PAGE.name} no longer says {line!r}: change HOSTS here with it"


def _can_make_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("openssl") is None:
        return False
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    if f"{SUBNET}." in routes:
        return False  # this machine's own network uses the page's addresses
    probe = f"psprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


NEEDS_NAMESPACES = pytest.mark.skipif(
    not _can_make_namespaces(),
    reason=f"needs root, `ip netns` and openssl, and {SUBNET}.0/24 unused by this machine",
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespaces() -> Iterator[dict[str, str]]:
    """A namespace per host (name -> namespace), each with ``eth0`` at its address."""
    tag = f"{os.getpid() % 100000}"
    bridge = f"psbr{tag}"
    hosts = HOSTS
    made: dict[str, str] = {}
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for n, (host, address) in enumerate(hosts.items()):
            ns, outside = f"ps{tag}-{host}", f"psv{tag}x{n}"
            _ip("netns", "add", ns)
            made[host] = ns
            _ip("link", "add", outside, "type", "veth", "peer", "name", f"psv{tag}y{n}")
            _ip("link", "set", f"psv{tag}y{n}", "netns", ns)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", ns, "link", "set", f"psv{tag}y{n}", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield made
    finally:
        for ns in made.values():
            for _ in range(50):  # until nothing runs there (a process may start another meanwhile)
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                time.sleep(0.1)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for n in range(len(hosts)):  # a veth left outside when its move failed (gone with its namespace else)
            subprocess.run(["ip", "link", "del", f"psv{tag}x{n}"], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


@NEEDS_NAMESPACES
def test_the_multi_host_guide_runs_as_written(namespaces: dict[str, str], tmp_path: Path) -> None:
    work = _workdir(tmp_path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    common: list[str] = []
    ran = 0
    for block in blocks(PAGE):
        if block.lang != "bash":
            continue
        assert block.marker is not None and block.marker[0] == "host", f"line {block.line}: a block names no host"
        names = block.marker[1].split()
        if names == ["all"]:
            common.append(block.code)
            continue
        script = "set -euo pipefail\n" + "\n".join(common) + block.code
        procs = []
        for host in names:
            assert host in namespaces, f"line {block.line}: no host {host!r} in the page's table"
            prefix = ["ip", "netns", "exec", namespaces[host]]
            log = (tmp_path / f"{host}-{block.line}.log").open("w")
            procs.append(
                (
                    host,
                    log,
                    subprocess.Popen(
                        [*prefix, "bash", "-c", script],
                        cwd=work,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    ),
                )
            )
        failed = []
        for host, log, proc in procs:  # every host's run of the block ends before any is judged
            try:
                code = proc.wait(timeout=BLOCK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            log.close()
            if code != 0:
                failed.append(f"line {block.line} on {host}: exit {code}\n{Path(log.name).read_text()[-4000:]}")
        assert not failed, "\n".join(failed) + "\n" + _server_logs(work)
        ran += 1
    assert ran >= 6  # certificates, shards, serving shards, training, ps-infer, the checks
    scores = Path(tmp_path / f"operator-{_last_operator_line()}.log").read_text()
    assert re.search(r"\[(0\.\d+\s+){4}0\.\d+\s*\]", scores), scores[-2000:]  # 5 probabilities


def _last_operator_line() -> int:
    return [b.line for b in blocks(PAGE) if b.marker == ("host", "operator")][-1]


def _server_logs(work: Path) -> str:
    logs = sorted((work / "ps-data" / "multi-host").glob("*.log")) if (work / "ps-data").exists() else []
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs)
