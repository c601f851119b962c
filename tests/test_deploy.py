"""deploy/: the alerts and the dashboard parse, pass their tests, and name only metrics that exist."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.config import parse_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "modality-gateway.json"
METRIC = re.compile(r"\b((?:gateway|vision_encoder)_[a-z_]+)")
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
# The replica pools' metrics (gateway.replicas, gateway.retries): each on the dashboard's
# "Upstream health" row; the alerted ones also in alerts.yml.
POOL_METRICS = (
    "gateway_upstream_healthy",
    "gateway_upstream_breaker_state",
    "gateway_upstream_in_flight",
    "gateway_upstream_ejections_total",
    "gateway_retries_total",
    "gateway_retries_refused_total",
)
POOL_ALERTED = (
    "gateway_upstream_healthy",
    "gateway_upstream_breaker_state",
    "gateway_retries_total",
    "gateway_retries_refused_total",
)

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None and os.environ.get("CI") != "true",
    reason="needs Debian's prometheus package (make test installs it)",
)


def promtool(*args: str, cwd: Path = ROOT) -> None:
    result = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def gateway_metric_names() -> set[str]:
    """The names of the series a gateway can export: its app's registry, built but not served."""
    registry = CollectorRegistry()
    config = parse_config("version: 1\nmodels:\n  - {name: m, upstreams: ['http://127.0.0.1:9'], accepts: [text]}\n")
    create_app(config, registry=registry, watch=False)
    return {f.name + suffix for f in registry.collect() for suffix in SUFFIXES[f.type]}


def dashboard_panels() -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = json.loads(DASHBOARD.read_text())["panels"]
    return panels


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]


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


def test_every_gateway_metric_named_is_one_the_gateway_exports() -> None:
    # tests/backends/test_dashboard.py checks every name against both running exporters; this
    # one runs without the encoder extra
    exported = gateway_metric_names()
    named = {m for q in dashboard_queries() + alert_queries() for m in METRIC.findall(q) if m.startswith("gateway_")}
    unknown = sorted(named - exported)
    assert named and not unknown, f"queries name metrics the gateway does not export: {unknown}"


def test_the_replica_pools_are_on_the_dashboard_and_alerted() -> None:
    assert set(POOL_METRICS) <= gateway_metric_names()
    panels = dashboard_panels()
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Upstream health")
    end = next((i for i, p in enumerate(panels) if i > start and p["type"] == "row"), len(panels))
    on_row = {m for p in panels[start + 1 : end] for t in p["targets"] for m in METRIC.findall(t["expr"])}
    missing = [m for m in POOL_METRICS if m not in on_row]
    assert not missing, f"not on the Upstream health row: {missing}"
    alerted = {m for q in alert_queries() for m in METRIC.findall(q)}
    missing = [m for m in POOL_ALERTED if m not in alerted]
    assert not missing, f"no alert watches: {missing}"


def test_the_dashboard_layout_is_sound() -> None:
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    taken: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in taken, f"{p['title']!r} overlaps {taken[cell]!r}"
            taken[cell] = p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"]), p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
