"""The example alert rules (``deploy/prometheus/alerts.yml``) against a real Prometheus.

* ``promtool`` checks the rules and runs their unit tests (``tests/alerts/alerts_test.yml``):
  each alert fires on its scenario and stays quiet before it and on a steady twin.
* A real ``prometheus`` scrapes a real shard every second: a push whose update overflows
  turns rows to Inf, and ``EmbeddingNaNRows`` fires for that table and not for its calm twin.

Both skip cleanly where Prometheus is not installed (``apt-get install prometheus``; CI
installs it).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client import PSClient
from tests.integration.shards import RunningShard, start_shard

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "alerts.yml"
needs = {
    tool: pytest.mark.skipif(shutil.which(tool) is None, reason=f"{tool} is not installed")
    for tool in ("promtool", "prometheus")
}


@needs["promtool"]
def test_promtool_checks_the_rules_and_their_scenarios() -> None:
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 5 rules found" in check.stdout
    tests = REPO / "tests" / "alerts"
    done = subprocess.run(
        ["promtool", "test", "rules", "alerts_test.yml"], cwd=tests, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait_for(what: str, check, timeout_s: float = 60.0) -> Any:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.2)
    return found


@needs["prometheus"]
def test_a_real_prometheus_fires_nan_rows_for_the_table_that_overflowed(
    tmp_path: Path, procs: list[RunningShard]
) -> None:
    shard = start_shard(0, 1, tmp_path, "--metrics-port=0")
    procs.append(shard)
    found = wait_for(
        "the metrics port in the log", lambda: re.search(r"metrics on http://[\d.]+:(\d+)/", shard.log_tail(20000))
    )
    metrics_port = int(found.group(1))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{RULES}]\n"
        "scrape_configs:\n"
        "  - job_name: shard\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}'], labels: {{pod: shard-0}}}}]\n"
    )
    web = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    prometheus = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{web}/api/v1"
    try:
        with PSClient([shard.address]) as client:
            client.create_table("calm", 4)
            client.create_table("runaway", 4, optimizer="sgd", lr=1e38)
            keys = np.arange(64, dtype=np.int64)
            client.push("calm", keys, np.ones((64, 4), np.float32))

            def scraped() -> bool:
                try:
                    got = get(f"{api}/query?query=ps_table_nonfinite_rows_total")
                except OSError:
                    return False  # not listening yet
                return {r["metric"]["table"] for r in got["data"]["result"]} == {"calm", "runaway"}

            wait_for("Prometheus to scrape both tables at 0", scraped)
            client.push("runaway", keys, np.full((64, 4), 1e10, np.float32))  # finite gradients, infinite rows

        def firing() -> list[dict[str, Any]]:
            alerts = get(f"{api}/alerts")["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "EmbeddingNaNRows" and a["state"] == "firing"]

        (alert,) = wait_for("EmbeddingNaNRows to fire", firing)
        assert alert["labels"]["table"] == "runaway" and alert["labels"]["pod"] == "shard-0"
    finally:
        prometheus.terminate()
        prometheus.wait(30)
        log.close()
