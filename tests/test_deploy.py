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

from gateway.config import parse_config
from gateway.server.app import create_app

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "modality-gateway.json"
METRIC = re.compile(r"\b((?:gateway|vision_encoder)_[a-z_]+)")
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
# The replica pools' metrics (gateway.upstream.replicas, gateway.upstream.retries, gateway.upstream.health): each on the
# dashboard's "Upstream health" row; the alerted ones also in alerts.yml.
POOL_METRICS = (
    "gateway_upstream_healthy",
    "gateway_upstream_breaker_state",
    "gateway_upstream_in_flight",
    "gateway_upstream_ejections_total",
    "gateway_retries_total",
    "gateway_retries_refused_total",
    "gateway_health_checks_total",
)
POOL_ALERTED = (
    "gateway_upstream_healthy",
    "gateway_upstream_breaker_state",
    "gateway_retries_total",
    "gateway_retries_refused_total",
    "gateway_health_checks_total",
)
# Per-model concurrency (gateway.upstream.concurrency): on the "Concurrency limits" row, shedding alerted.
CONCURRENCY_METRICS = ("gateway_queue_depth", "gateway_model_in_flight", "gateway_model_slots", "gateway_shed_total")
CONCURRENCY_ALERTED = ("gateway_shed_total",)
# Priority classes (x-priority) in the models' queues: on the "Priority queues" row (shedding is alerted above).
PRIORITY_METRICS = ("gateway_queue_wait_seconds_bucket", "gateway_queue_wait_seconds_count", "gateway_queue_depth",
                    "gateway_shed_total")  # fmt: skip
# Which routing.yaml each instance runs: on the "Traffic" row, beside the reloads.
CONFIG_METRICS = ("gateway_config_info", "gateway_config_generation", "gateway_config_reloads_total")
# API keys (gateway.admission.auth): requests, refusals for a key and by a key's limits on the "Access (API
# keys)" row; the refusals alerted.
ACCESS_METRICS = ("gateway_requests_total", "gateway_auth_failures_total", "gateway_rate_limited_total")
ACCESS_ALERTED = ("gateway_auth_failures_total", "gateway_rate_limited_total")
# (the row's title, what must be on it, what alerts.yml must watch)
ROWS = (
    ("Upstream health", POOL_METRICS, POOL_ALERTED),
    ("Concurrency limits (max_concurrency)", CONCURRENCY_METRICS, CONCURRENCY_ALERTED),
    ("Traffic", CONFIG_METRICS, ("gateway_config_reloads_total",)),
    ("Access (API keys)", ACCESS_METRICS, ACCESS_ALERTED),
    ("Tokens: what each key and model spent", ("gateway_tokens_total",), ()),
    ("Priority queues", PRIORITY_METRICS, ()),
    (
        "Media converted (video as frames, audio as transcripts, images described, files as text)",
        ("gateway_images_described_total", "gateway_image_describe_seconds_bucket", "gateway_files_extracted_total"),
        (),
    ),
    (
        "Realtime sessions",
        (
            "gateway_realtime_sessions_open",
            "gateway_realtime_sessions_opened_total",
            "gateway_realtime_sessions_total",
            "gateway_realtime_events_total",
            "gateway_realtime_bytes_total",
            "gateway_realtime_events_refused_total",
            "gateway_audio_seconds_total",
        ),
        (),
    ),
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


@pytest.mark.parametrize(("row", "metrics", "alerted"), ROWS, ids=[r[0] for r in ROWS])
def test_each_feature_is_on_its_dashboard_row_and_alerted(
    row: str, metrics: tuple[str, ...], alerted: tuple[str, ...]
) -> None:
    assert set(metrics) <= gateway_metric_names()
    panels = dashboard_panels()
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == row)
    end = next((i for i, p in enumerate(panels) if i > start and p["type"] == "row"), len(panels))
    on_row = {m for p in panels[start + 1 : end] for t in p["targets"] for m in METRIC.findall(t["expr"])}
    missing = [m for m in metrics if m not in on_row]
    assert not missing, f"not on the {row} row: {missing}"
    watched = {m for q in alert_queries() for m in METRIC.findall(q)}
    missing = [m for m in alerted if m not in watched]
    assert not missing, f"no alert watches: {missing}"


def test_every_alert_is_documented() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    readme = (DEPLOY / "README.md").read_text()
    missing = [r["alert"] for g in rules["groups"] for r in g["rules"] if f"`{r['alert']}`" not in readme]
    assert not missing, f"alerts not described in deploy/README.md: {missing}"


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
