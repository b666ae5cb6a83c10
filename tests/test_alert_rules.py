"""deploy/prometheus-alerts.yml against the code and the docs: every rule is whole, every
metric it reads is one a role registers, with the labels it selects and groups by, and
docs/operations.md explains every alert. (No Prometheus runs here: the expressions' meaning
is checked by reading, their names and labels by this test.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_doc_references import _registries

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus-alerts.yml"
# labels Prometheus adds to every scraped series, and the histogram buckets' own
TARGET_LABELS = {"job", "instance"}
SEVERITIES = {"page", "ticket"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
PROMQL_WORDS = {"sum", "by", "without", "rate", "increase", "max", "min", "min_over_time", "absent", "or",
                "and", "unless", "histogram_quantile", "humanizePercentage"}


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def _metrics() -> dict[str, set[str]]:
    """Every metric a role registers, as Prometheus names its series, and its labels."""
    out: dict[str, set[str]] = {}
    for registry in _registries().values():
        for collector in registry._collector_to_names:  # type: ignore[attr-defined]
            name, labels = collector._name, set(collector._labelnames)
            if collector._type == "counter":
                out[name + "_total"] = labels
            elif collector._type == "histogram":
                for suffix in HISTOGRAM_SUFFIXES:
                    out[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
            else:
                out[name] = labels
    return out


def _references(expr: str) -> list[tuple[str, set[str]]]:
    """Each ``qos_...`` series the expression reads, with the labels it selects on."""
    refs = []
    for m in re.finditer(r"(qos_\w+)(\{([^}]*)\})?", expr):
        selected = {re.split(r"=~|!~|!=|=", x)[0].strip() for x in (m.group(3) or "").split(",") if x.strip()}
        refs.append((m.group(1), selected))
    return refs


def test_the_rules_file_is_whole() -> None:
    rules = _rules()
    assert len(rules) >= 10
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "an alert name twice"
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert r["labels"]["severity"] in SEVERITIES, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert "for" not in r or re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
        expr = r["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), r["alert"]
        assert _references(expr), f"{r['alert']} reads no qos metric"


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_every_metric_and_label_a_rule_reads_exists(rule: dict[str, Any]) -> None:
    metrics = _metrics()
    expr = rule["expr"]
    for name, selected in _references(expr):
        assert name in metrics, f"{rule['alert']}: no metric {name}"
        assert selected <= metrics[name] | TARGET_LABELS, \
            f"{rule['alert']}: {name} has labels {sorted(metrics[name])}, the rule selects {sorted(selected)}"
    # the labels grouped by must be on every metric summed (a label no series has groups nothing)
    read = {n for n, _ in _references(expr)}
    for m in re.finditer(r"\bby \(([^)]*)\)", expr):
        grouped = {x.strip() for x in m.group(1).split(",")}
        for name in read:
            assert grouped <= metrics[name] | TARGET_LABELS, f"{rule['alert']}: {name} has no {grouped}"
    # templates name labels the result keeps
    for text in rule["annotations"].values():
        for label in re.findall(r"\$labels\.(\w+)", text):
            assert any(label in metrics[n] | TARGET_LABELS for n in read), f"{rule['alert']}: {label}"
    words = set(re.findall(r"\b([a-z_A-Z]+)\s*\(", expr)) - {n for n, _ in _references(expr)}
    assert words <= PROMQL_WORDS, f"{rule['alert']}: unknown functions {sorted(words - PROMQL_WORDS)}"


def test_the_label_values_a_rule_matches_are_ones_the_code_writes() -> None:
    """A selector on a value the code never writes matches nothing, for ever: an outcome or
    an error code is checked against the code's own list."""
    from limiter.frontend import generation

    source = Path(generation.__file__).read_text()
    worker_doc = (ROOT / "docs" / "worker.md").read_text()
    for r in _rules():
        for value in re.findall(r'reason="(\w+)"', r["expr"]):
            assert f'code="{value}"' in source, f"{r['alert']}: no error code {value}"
        for value in re.findall(r'outcome="(\w+)"', r["expr"]):
            assert f"`{value}`" in worker_doc, f"{r['alert']}: no worker outcome {value}"


def test_every_alert_is_explained_in_the_operations_doc() -> None:
    """A row of its own in the alerts table (a mention in another's row explains nothing)."""
    text = (ROOT / "docs" / "operations.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (page|ticket) \|", text, re.M)}
    assert rows == {r["alert"]: r["labels"]["severity"] for r in _rules()}
