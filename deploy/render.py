"""Write the Kubernetes objects that are generated from ``dashboards/``.

``dashboards/alerts.yaml`` and ``dashboards/*.json`` are the one source of the rules and
dashboards; the operator's cluster takes them as a ``PrometheusRule`` (Prometheus
Operator) and a ConfigMap the Grafana sidecar picks up (label ``grafana_dashboard``).

    python -m deploy.render          # write deploy/monitoring/prometheusrule.yaml and
                                     # deploy/monitoring/grafana-dashboards.yaml
    python -m deploy.render --check  # exit 1 naming each file that differs from its source

``tests/test_deploy.py`` runs the check, so a changed rule or panel fails CI until the
manifests are written again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
MONITORING = ROOT / "deploy" / "monitoring"
LABELS = {"app.kubernetes.io/name": "specpilot"}


def _header(source: str) -> str:
    return (
        f"# Generated from {source} by `python -m deploy.render`: edit the source and run\n"
        "# it again (tests/test_deploy.py fails while the two differ).\n"
    )


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL, dashboard JSON) as literal blocks, readable in review."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _str)


def _dump(document: dict[str, Any]) -> str:
    return yaml.dump(document, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)


def prometheus_rule(alerts: Path) -> str:
    """The rules file as a ``PrometheusRule``: its ``groups`` are the file's, unchanged."""
    rules = yaml.safe_load(alerts.read_text(encoding="utf-8"))
    document = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "specpilot", "labels": dict(LABELS)},
        "spec": {"groups": rules["groups"]},
    }
    return _header(f"dashboards/{alerts.name}") + _dump(document)


def dashboards_configmap(dashboards: list[Path]) -> str:
    """Every dashboard JSON as one key of a ConfigMap, byte for byte."""
    document = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "specpilot-dashboards",
            "labels": {**LABELS, "grafana_dashboard": "1"},
        },
        "data": {path.name: path.read_text(encoding="utf-8") for path in dashboards},
    }
    return _header("dashboards/*.json") + _dump(document)


def rendered(dashboards_dir: Path = DASHBOARDS) -> dict[Path, str]:
    """Each generated manifest's path and the text it must hold."""
    return {
        MONITORING / "prometheusrule.yaml": prometheus_rule(dashboards_dir / "alerts.yaml"),
        MONITORING / "grafana-dashboards.yaml": dashboards_configmap(
            sorted(dashboards_dir.glob("*.json"))
        ),
    }


def stale(files: dict[Path, str]) -> list[Path]:
    """The files whose text on disk is not what they should hold (missing included)."""
    return [
        path
        for path, text in files.items()
        if not path.is_file() or path.read_text(encoding="utf-8") != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.render", description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file is out of date"
    )
    args = parser.parse_args(argv)
    files = rendered()
    if args.check:
        out_of_date = stale(files)
        for path in out_of_date:
            print(f"{path.relative_to(ROOT)}: out of date; run python -m deploy.render")
        return 1 if out_of_date else 0
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
