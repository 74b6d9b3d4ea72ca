"""The Grafana dashboard and the alert rules read series that exist: every metric name their
expressions use is one `kvledger serve` or `kvledger collect` exposes (read from the real
registries, not a list of our own), and the dashboard is provisioning-ready JSON. No Grafana server
can be installed here (not in Debian or PyPI), so its structure is checked, not its rendering."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
DASH = ROOT / "telemetry" / "grafana" / "kvledger-dashboard.json"
RULES = ROOT / "telemetry" / "prometheus" / "kvledger-alerts.yml"
PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "max", "min", "count", "or", "vector", "on",
                "unless", "and", "le", "absent", "min_over_time", "without", "up"}


@pytest.fixture(scope="module")
def exposed(tmp_path_factory) -> set[str]:
    from engine.server.metrics import ServerMetrics
    from telemetry.receivers.health import CollectHealth, registry
    from telemetry.store import SegmentWriter
    m = ServerMetrics(lambda t: t, "hardened", {"read_check": True})
    writer = SegmentWriter(tmp_path_factory.mktemp("store") / "s")
    try:
        text = generate_latest(m.registry).decode() + generate_latest(registry(CollectHealth(writer, {}))).decode()
    finally:
        writer.close()
    names = {"up"}
    for fam in text_string_to_metric_families(text):
        names |= {fam.name + s for s in ("", "_total", "_bucket", "_count", "_sum")}
    return names


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}", "", expr)                    # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)                   # range selectors
    expr = re.sub(r"(by|on|without) \([^)]*\)", "", expr)    # grouping labels
    return {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if w not in PROMQL_WORDS and not w.startswith("$")}


def test_the_dashboard_is_provisioning_ready_and_reads_only_series_that_exist(exposed):
    d = json.loads(DASH.read_text())
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36 and d["time"]["from"].startswith("now-")
    assert {v["name"] for v in d["templating"]["list"]} >= {"datasource", "instance"}
    panels = [p for p in d["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["type"] in ("stat", "timeseries") and p["targets"] and p["datasource"]["uid"] == "${datasource}"
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        for t in p["targets"]:
            unknown = metric_names(t["expr"]) - exposed
            assert not unknown, f"panel {p['title']!r} reads {unknown}, which neither serve nor collect exposes"
    titles = " ".join(p["title"] for p in panels)
    for want in ("Time to first token", "Tokens per second", "KV cache usage", "Foreign KV reads", "Guard checks",
                 "Spans not exported", "KV event batches lost", "Store writer"):
        assert want in titles, want
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert any("Telemetry health" in r for r in rows)


def test_every_alert_reads_only_series_that_exist(exposed):
    for g in yaml.safe_load(RULES.read_text())["groups"]:
        for r in g["rules"]:
            unknown = metric_names(r["expr"]) - exposed
            assert not unknown, f"{r['alert']} reads {unknown}, which neither serve nor collect exposes"
