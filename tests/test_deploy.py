"""deploy/'s Kubernetes manifests: what the API server, Prometheus and specpilot would take.

- Every object of the core API loads into the official ``kubernetes`` client's typed
  model (pydantic from version 37: strict types, required fields, no extra keys), and a
  walk over the same document refuses any key that is not one of the model's JSON names
  (the models also take their Python names, ``image_pull_policy``, which the API server
  would drop).
- The Prometheus Operator's kinds, which the client has no model of, are checked against
  the subset of their CRD schema written below, their metadata as ``V1ObjectMeta``, and
  the rules by ``promtool check rules``.
- The generated manifests are what ``python -m deploy.render`` makes of ``dashboards/``.
- The specpilot settings a workload mounts pass ``specpilot config check`` with the
  environment the workload gives them, and agree with its ports and volumes.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import kubernetes.client
import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from controller.cli import main as specpilot
from controller.settings import ENV_PREFIX, Settings, load_settings
from deploy import render
from tests.helpers.prometheus import promtool

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCS = ROOT / "docs" / "deploy.md"
MODELS = kubernetes.client.models


@dataclass(frozen=True)
class Manifest:
    path: Path
    index: int
    doc: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}#{self.index}"

    @property
    def kind(self) -> str:
        return str(self.doc["kind"])

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.doc["metadata"].get("labels") or {})


def manifests() -> list[Manifest]:
    found = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for index, doc in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            assert isinstance(doc, dict), f"{path}#{index}: not an object"
            found.append(Manifest(path, index, doc))
    return found


def of_kind(*kinds: str) -> list[Manifest]:
    return [m for m in manifests() if m.kind in kinds]


# -- the client's typed models ---------------------------------------------------------


def unknown_fields(value: Any, type_name: str, path: str) -> Iterator[str]:
    """Each key of ``value`` that is not a JSON field name of the model ``type_name``
    describes, recursively (``List[...]``, ``Dict[str, ...]``, nested models)."""
    if type_name.startswith("List[") and isinstance(value, list):
        for i, item in enumerate(value):
            yield from unknown_fields(item, type_name[5:-1], f"{path}[{i}]")
        return
    if type_name.startswith("Dict[") and isinstance(value, dict):
        inner = type_name[5:-1].split(", ", 1)[1]
        for key, item in value.items():
            yield from unknown_fields(item, inner, f"{path}.{key}")
        return
    model = getattr(MODELS, type_name, None)
    if model is None or not isinstance(value, dict):
        return  # a primitive (the model's own validation checks its type)
    by_json_name = {json_name: attr for attr, json_name in model.attribute_map.items()}
    for key, item in value.items():
        if key not in by_json_name:
            yield f"{path}.{key}: not a field of {type_name}"
        elif item is not None:
            yield from unknown_fields(item, model.openapi_types[by_json_name[key]], f"{path}.{key}")


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def model_name(api_version: str, kind: str) -> str:
    """The client's model of a core kind, after checking that its API group and version
    serve that kind (``apps/v1`` has StatefulSets, ``v1`` does not)."""
    group, _, version = api_version.rpartition("/")
    api_class = "".join(part.capitalize() for part in (group.split(".")[0] or "core", version))
    api = getattr(kubernetes.client, f"{api_class}Api", None)
    assert api is not None, f"no API {api_version!r} in the kubernetes client"
    assert hasattr(api, f"create_namespaced_{_snake(kind)}"), f"{api_version} serves no {kind}"
    return f"{version.capitalize()}{kind}"


def typed_problems(doc: dict[str, Any]) -> list[str]:
    """Why the client's typed model (with the JSON names only) refuses ``doc``."""
    name = model_name(doc["apiVersion"], doc["kind"])
    problems = list(unknown_fields(doc, name, doc["kind"]))
    try:
        getattr(MODELS, name).model_validate(doc)
    except ValueError as exc:  # pydantic's ValidationError
        problems.append(str(exc))
    return problems


# -- the Prometheus Operator's kinds: the part of their CRD schema (v1) deploy/ uses -----

# The CRDs' own pattern for a Prometheus duration.
Duration = Annotated[
    str,
    Field(
        pattern=r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
        r"(([0-9]+)s)?(([0-9]+)ms)?)$"
    ),
]


class _Crd(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Endpoint(_Crd):
    port: str
    path: str | None = None
    interval: Duration | None = None
    scrapeTimeout: Duration | None = None
    scheme: Literal["http", "https"] | None = None
    honorLabels: bool | None = None


class NamespaceSelector(_Crd):
    any: bool | None = None
    matchNames: list[str] | None = None


class ServiceMonitorSpec(_Crd):
    selector: dict[str, Any]  # a LabelSelector: walked as V1LabelSelector
    endpoints: list[Endpoint] = Field(min_length=1)
    namespaceSelector: NamespaceSelector | None = None
    jobLabel: str | None = None


class Rule(_Crd):
    record: str | None = None
    alert: str | None = None
    expr: str | int
    for_: Duration | None = Field(default=None, alias="for")
    keep_firing_for: Duration | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class RuleGroup(_Crd):
    name: str = Field(min_length=1)
    interval: Duration | None = None
    limit: int | None = None
    rules: list[Rule]


class PrometheusRuleSpec(_Crd):
    groups: list[RuleGroup]


class CustomResource(_Crd):
    apiVersion: Literal["monitoring.coreos.com/v1"]
    kind: Literal["ServiceMonitor", "PrometheusRule"]
    metadata: dict[str, Any]  # walked as V1ObjectMeta
    spec: dict[str, Any]


CRD_SPECS: dict[str, type[_Crd]] = {
    "ServiceMonitor": ServiceMonitorSpec,
    "PrometheusRule": PrometheusRuleSpec,
}


def custom_resource_problems(doc: dict[str, Any]) -> list[str]:
    try:
        resource = CustomResource.model_validate(doc)
        CRD_SPECS[resource.kind].model_validate(resource.spec)
    except ValueError as exc:
        return [str(exc)]
    problems = list(unknown_fields(doc["metadata"], "V1ObjectMeta", "metadata"))
    try:
        MODELS.V1ObjectMeta.model_validate(doc["metadata"])
    except ValueError as exc:
        problems.append(str(exc))
    if resource.kind == "ServiceMonitor":
        selector = doc["spec"]["selector"]
        problems += unknown_fields(selector, "V1LabelSelector", "spec.selector")
        try:
            MODELS.V1LabelSelector.model_validate(selector)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def problems_of(doc: dict[str, Any]) -> list[str]:
    if str(doc.get("apiVersion", "")).startswith("monitoring.coreos.com/"):
        return custom_resource_problems(doc)
    return typed_problems(doc)


def test_every_manifest_is_a_valid_object_of_its_kind() -> None:
    found = manifests()
    kinds = {m.kind for m in found}
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap", "ServiceMonitor"} <= kinds
    assert {"PrometheusRule", "PodDisruptionBudget"} <= kinds
    problems = {m.where: p for m in found if (p := problems_of(m.doc))}
    assert problems == {}


def test_the_checks_refuse_what_the_api_server_would_not_take() -> None:
    """What each check is for: a misspelled field, a Python name, a string for a number,
    a missing required field, a rule field the CRD does not have."""
    (workload,) = (m.doc for m in of_kind("StatefulSet"))

    def container(doc: dict[str, Any]) -> dict[str, Any]:
        found: dict[str, Any] = doc["spec"]["template"]["spec"]["containers"][0]
        return found

    misspelled = copy.deepcopy(workload)
    container(misspelled)["readinesProbe"] = container(misspelled).pop("readinessProbe")
    python_name = copy.deepcopy(workload)
    container(python_name)["image_pull_policy"] = "Always"
    string_port = copy.deepcopy(workload)
    container(string_port)["ports"][0]["containerPort"] = "8000"
    nameless = copy.deepcopy(workload)
    del container(nameless)["name"]
    for broken, says in (
        (misspelled, "readinesProbe: not a field of V1Container"),
        (python_name, "image_pull_policy: not a field of V1Container"),
        (string_port, "containerPort"),
        (nameless, "name"),
    ):
        problems = problems_of(broken)
        assert any(says in problem for problem in problems), problems

    (rule,) = (m.doc for m in of_kind("PrometheusRule"))
    extra = copy.deepcopy(rule)
    extra["spec"]["groups"][0]["rules"][0]["severity"] = "warning"
    assert any("severity" in problem for problem in problems_of(extra))
    (monitor, *_) = (m.doc for m in of_kind("ServiceMonitor"))
    bad_interval = copy.deepcopy(monitor)
    bad_interval["spec"]["endpoints"][0]["interval"] = "15 seconds"
    assert any("interval" in problem for problem in problems_of(bad_interval))
    assert any("wrong" in p for p in problems_of({**monitor, "metadata": {"wrong": 1}}))
    with pytest.raises(AssertionError, match="serves no StatefulSet"):
        problems_of({**workload, "apiVersion": "v1"})


# -- generated from dashboards/ -----------------------------------------------------------


def test_generated_manifests_are_what_the_generator_writes() -> None:
    files = render.rendered()
    assert render.stale(files) == [], "run: python -m deploy.render"
    assert render.main(["--check"]) == 0


def test_prometheus_rule_holds_the_rules_file_and_dashboards_configmap_every_dashboard() -> None:
    (rule,) = of_kind("PrometheusRule")
    source = yaml.safe_load((render.DASHBOARDS / "alerts.yaml").read_text(encoding="utf-8"))
    assert rule.doc["spec"]["groups"] == source["groups"]

    (dashboards,) = (m for m in of_kind("ConfigMap") if m.labels.get("grafana_dashboard") == "1")
    expected = {p.name: p.read_text(encoding="utf-8") for p in render.DASHBOARDS.glob("*.json")}
    assert expected and dashboards.doc["data"] == expected
    for text in dashboards.doc["data"].values():
        assert json.loads(text)["uid"]  # the sidecar imports each key as one dashboard


def test_stale_names_a_manifest_whose_source_changed(tmp_path: Path) -> None:
    changed = tmp_path / "alerts.yaml"
    text = (render.DASHBOARDS / "alerts.yaml").read_text(encoding="utf-8")
    changed.write_text(text.replace("for: 10m", "for: 11m", 1), encoding="utf-8")
    (rule_path, _), (dashboards_path, _) = render.rendered().items()
    files = {
        rule_path: render.prometheus_rule(changed),
        dashboards_path: render.rendered()[dashboards_path],
    }
    assert render.stale(files) == [rule_path]


@pytest.mark.prometheus
def test_prometheus_rule_passes_promtool(tmp_path: Path) -> None:
    (rule,) = of_kind("PrometheusRule")
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(rule.doc["spec"]), encoding="utf-8")
    result = subprocess.run(
        [promtool(), "check", "rules", str(rules_file)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# -- the settings a workload runs ---------------------------------------------------------

SECRET_VALUES = {
    "api-token": "token-from-the-secret",
    "store-url": "postgresql+psycopg://specpilot:pw@postgres:5432/specpilot",
}


@dataclass(frozen=True)
class Served:
    """A container running ``specpilot serve --config FILE`` and the settings it gets."""

    workload: Manifest
    container: dict[str, Any]
    settings_text: str
    environment: dict[str, str]

    def port(self, name: str) -> int:
        (port,) = (p["containerPort"] for p in self.container["ports"] if p["name"] == name)
        return int(port)


def pod_spec(workload: Manifest) -> dict[str, Any]:
    spec: dict[str, Any] = workload.doc["spec"]["template"]["spec"]
    return spec


def served() -> list[Served]:
    config_maps = {m.name: m for m in of_kind("ConfigMap")}
    found = []
    for workload in of_kind("StatefulSet", "Deployment"):
        spec = pod_spec(workload)
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec["containers"]:
            argv = [*container.get("command", []), *container.get("args", [])]
            assert argv[:2] == ["specpilot", "serve"], f"{workload.where}: {argv}"
            settings_file = Path(argv[argv.index("--config") + 1])
            (mount,) = (
                m for m in container["volumeMounts"] if Path(m["mountPath"]) == settings_file.parent
            )
            config_map = config_maps[volumes[mount["name"]]["configMap"]["name"]]
            environment = {}
            for variable in container.get("env", []):
                source = variable.get("valueFrom", {}).get("secretKeyRef")
                value = SECRET_VALUES[source["key"]] if source else variable["value"]
                environment[variable["name"]] = value
            text = config_map.doc["data"][settings_file.name]
            found.append(Served(workload, container, text, environment))
    return found


def test_every_workload_is_found_running_specpilot() -> None:
    assert sorted(s.workload.kind for s in served()) == ["Deployment", "StatefulSet"]


@pytest.mark.parametrize("runs", served(), ids=lambda s: s.workload.where)
def test_mounted_settings_pass_config_check_with_the_workloads_environment(
    runs: Served,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in runs.environment.items():
        monkeypatch.setenv(name, value)
    settings_file = tmp_path / "specpilot.yaml"
    settings_file.write_text(runs.settings_text, encoding="utf-8")

    code = specpilot(["config", "check", "--json", str(settings_file)])
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == []
    assert code == 0

    # The Secret's values reach the settings by the names serve reads.
    settings = load_settings(settings_file)
    assert settings.api.token is not None
    assert settings.api.token.get_secret_value() == SECRET_VALUES["api-token"]
    assert settings.store_url == SECRET_VALUES["store-url"]
    check_against_pod(runs, settings)


def check_against_pod(runs: Served, settings: Settings) -> None:
    """The ports the settings listen on are the container's, reachable from the pod's
    network, and the data directory is a volume."""
    assert settings.api.host == "0.0.0.0" and settings.api.port == runs.port("api")
    assert settings.serves_gateway
    assert settings.gateway.host == "0.0.0.0" and settings.gateway.port == runs.port("http")
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        assert runs.container[probe]["httpGet"] == {"path": path, "port": "api"}
    mounts = {Path(m["mountPath"]) for m in runs.container["volumeMounts"]}
    assert settings.data_dir in mounts


def test_per_pod_settings_manage_the_pods_own_vllm_in_place() -> None:
    (runs,) = (s for s in served() if s.workload.kind == "StatefulSet")
    data = yaml.safe_load(runs.settings_text)
    managed = data["actuators"]["managed"]
    assert managed["mode"] == "in_place"
    assert all(pool["host"] == "127.0.0.1" for pool in managed["pools"].values())
    assert "scrape" in data["collect"]
    assert runs.workload.doc["spec"]["replicas"] >= 2  # replicas share the store


def test_central_settings_route_with_two_replicas() -> None:
    (runs,) = (s for s in served() if s.workload.kind == "Deployment")
    assert yaml.safe_load(runs.settings_text)["actuators"]["mode"] == "routing"
    assert runs.workload.doc["spec"]["replicas"] == 2


# -- the objects refer to each other ---------------------------------------------------------


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_services_and_monitors_reach_named_ports() -> None:
    workloads = of_kind("StatefulSet", "Deployment")
    services = of_kind("Service")
    for service in services:
        selector = service.doc["spec"]["selector"]
        pods = [
            w
            for w in workloads
            if selects(selector, w.doc["spec"]["template"]["metadata"]["labels"])
        ]
        assert pods, f"{service.where} selects no pod"
        for port in service.doc["spec"]["ports"]:
            for pod in pods:
                names = {p["name"] for c in pod_spec(pod)["containers"] for p in c["ports"]}
                assert port["targetPort"] in names, f"{service.where}: {port}"
    for workload in workloads:
        assert selects(
            workload.doc["spec"]["selector"]["matchLabels"],
            workload.doc["spec"]["template"]["metadata"]["labels"],
        )
        if workload.kind == "StatefulSet":
            assert workload.doc["spec"]["serviceName"] in {s.name for s in services}
    scraped = 0
    for monitor in of_kind("ServiceMonitor"):
        selector = monitor.doc["spec"]["selector"]["matchLabels"]
        for service in (s for s in services if selects(selector, s.labels)):
            names = {p["name"] for p in service.doc["spec"]["ports"]}
            for endpoint in monitor.doc["spec"]["endpoints"]:
                assert endpoint["port"] in names, f"{monitor.where} → {service.where}"
                scraped += 1
    assert scraped >= 2  # specpilot's API in both topologies
    for budget in of_kind("PodDisruptionBudget"):
        selector = budget.doc["spec"]["selector"]["matchLabels"]
        assert any(
            selects(selector, w.doc["spec"]["template"]["metadata"]["labels"]) for w in workloads
        )


def test_docs_create_the_secret_the_workloads_read() -> None:
    referenced = set()
    for workload in of_kind("StatefulSet", "Deployment"):
        for container in pod_spec(workload)["containers"]:
            for variable in container.get("env", []):
                source = variable.get("valueFrom", {}).get("secretKeyRef")
                if source:
                    referenced.add((source["name"], source["key"]))
    assert referenced == {("specpilot", key) for key in SECRET_VALUES}
    docs = DOCS.read_text(encoding="utf-8")
    assert "create secret generic specpilot " in docs
    for _, key in referenced:
        assert f"--from-literal={key}=" in docs
