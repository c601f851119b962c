"""deploy/: the alerts and the dashboard parse, pass their tests, and name only metrics that exist."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "modality-gateway.json"
METRIC = re.compile(r"\b((?:gateway|vision_encoder)_[a-z_]+)")

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None and os.environ.get("CI") != "true",
    reason="needs Debian's prometheus package (make test installs it)",
)


def promtool(*args: str, cwd: Path = ROOT) -> None:
    result = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def alert_queries() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_the_alerts_are_valid_and_pass_their_unit_tests() -> None:
    promtool("check", "rules", "alerts.yml", cwd=DEPLOY / "prometheus")
    promtool("test", "rules", "alerts_test.yml", cwd=DEPLOY / "prometheus")
    promtool("check", "config", "prometheus.yml", cwd=DEPLOY / "prometheus")


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 15
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {
                        "record": f"dashboard:query_{i}",
                        "expr": q.replace("$__rate_interval", "5m").replace("$model", ".*"),
                    }
                    for i, q in enumerate(queries)
                ],
            }
        ]
    }
    (tmp_path / "dashboard_rules.yml").write_text(yaml.safe_dump(rules))
    promtool("check", "rules", str(tmp_path / "dashboard_rules.yml"))
