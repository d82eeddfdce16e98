"""Set a Deployment container's ``--speculative-config`` argument in Kubernetes.

Each pool maps to one container of one Deployment (``DeploymentTarget``). The patch is
built from the Deployment as it is now:

- an existing ``--speculative-config X`` / ``--speculative-config=X`` (or vLLM's
  underscore spelling) is replaced in place, wherever it sits (``args`` or ``command``,
  e.g. ``python -m vllm.entrypoints.openai.api_server --speculative-config ...``);
  duplicates are removed so the container never starts with two;
- with no such argument, one is appended to ``args`` (Kubernetes appends ``args`` to the
  image's or the container's command);
- ``None`` (no speculation) removes the argument, and ``--per-request-spec-decode-metrics``
  with it, because vLLM refuses to start with per-request spec metrics and no
  speculation.

A container that runs a shell script (``sh -c "vllm serve ..."``) is refused: its
arguments live inside one string that only its author can edit safely.

Two patch forms: a JSON patch (RFC 6902) that first ``test``s the list it replaces, so
an edit made between reading and patching makes the patch fail instead of being
overwritten; or a strategic-merge patch (containers merge by name, the argument list is
replaced whole). An unchanged Deployment gets no patch at all: every patch rolls pods.

``KubernetesActuator`` applies them with the ``kubernetes`` client (the optional extra
``specpilot[kubernetes]``), imported only when no API object is passed in.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Literal

from controller.actuators.preflight import Preflight
from controller.fleet import PoolConfig

SpecConfig = Mapping[str, Any] | None
FLAG = "--speculative-config"
FLAG_SPELLINGS: tuple[str, ...] = (FLAG, "--speculative_config")
PER_REQUEST_FLAG_SPELLINGS: tuple[str, ...] = (
    "--per-request-spec-decode-metrics",
    "--per_request_spec_decode_metrics",
)
SHELLS: frozenset[str] = frozenset({"sh", "bash", "dash", "zsh", "ash"})
PatchType = Literal["json", "strategic-merge"]


class PatchError(ValueError):
    """The Deployment cannot be patched safely; the message says why."""


def render(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def _without(argv: Sequence[str], spellings: Sequence[str]) -> tuple[list[str], int | None]:
    """``argv`` without any ``FLAG VALUE`` / ``FLAG=VALUE`` of these spellings, and the
    index the first one stood at."""
    kept: list[str] = []
    first: int | None = None
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
            continue
        name = arg.split("=", 1)[0]
        if name in spellings:
            first = len(kept) if first is None else first
            skip_value = "=" not in arg
            continue
        kept.append(arg)
    return kept, first


def with_speculative_config(argv: Sequence[str], config: SpecConfig) -> list[str]:
    """``argv`` with the speculative config set (None: removed), other arguments kept in
    order. Appends the argument when ``argv`` has none."""
    kept, at = _without(argv, FLAG_SPELLINGS)
    if config is None:
        return _without(kept, PER_REQUEST_FLAG_SPELLINGS)[0]
    at = len(kept) if at is None else at
    return [*kept[:at], FLAG, render(config), *kept[at:]]


def _has_flag(argv: Sequence[str]) -> bool:
    return any(arg.split("=", 1)[0] in FLAG_SPELLINGS for arg in argv)


@dataclass(frozen=True, slots=True)
class ContainerEdit:
    """Which list of the container changes (``args`` or ``command``), where it is in the
    Deployment, and its value before and after."""

    index: int
    field: Literal["args", "command"]
    before: list[str] | None
    after: list[str]

    @property
    def path(self) -> str:
        return f"/spec/template/spec/containers/{self.index}/{self.field}"

    @property
    def changed(self) -> bool:
        return self.before != self.after


def container_edit(
    deployment: Mapping[str, Any], container: str, config: SpecConfig
) -> ContainerEdit:
    """The edit that makes ``container`` of ``deployment`` (its JSON form, camelCase as
    the API serves it) run with ``config``."""
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers")
    if not isinstance(containers, list):
        raise PatchError("the Deployment has no spec.template.spec.containers")
    names = [c.get("name") for c in containers]
    if container not in names:
        raise PatchError(f"no container {container!r} in the Deployment (it has {names})")
    index = names.index(container)
    command: list[str] = list(containers[index].get("command") or [])
    args: list[str] | None = containers[index].get("args")
    if command and PurePosixPath(command[0]).name in SHELLS:
        raise PatchError(
            f"container {container!r} runs a shell ({command[0]}): set "
            f"{FLAG} inside its script, or run vLLM without a shell"
        )
    if not _has_flag(args or []) and _has_flag(command):
        return ContainerEdit(index, "command", command, with_speculative_config(command, config))
    return ContainerEdit(index, "args", args, with_speculative_config(args or [], config))


def json_patch(
    deployment: Mapping[str, Any], container: str, config: SpecConfig
) -> list[dict[str, Any]]:
    """RFC 6902 operations; empty when the Deployment already runs ``config``."""
    edit = container_edit(deployment, container, config)
    if not edit.changed:
        return []
    if edit.before is None:
        return [{"op": "add", "path": edit.path, "value": edit.after}]
    return [
        {"op": "test", "path": edit.path, "value": edit.before},
        {"op": "replace", "path": edit.path, "value": edit.after},
    ]


def strategic_merge_patch(
    deployment: Mapping[str, Any], container: str, config: SpecConfig
) -> dict[str, Any]:
    """A strategic-merge patch; empty when the Deployment already runs ``config``."""
    edit = container_edit(deployment, container, config)
    if not edit.changed:
        return {}
    containers = [{"name": container, edit.field: edit.after}]
    return {"spec": {"template": {"spec": {"containers": containers}}}}


@dataclass(frozen=True, slots=True)
class DeploymentTarget:
    namespace: str
    deployment: str
    container: str


@dataclass
class KubernetesActuator:
    """Patch each pool's Deployment. ``apps_api`` is a ``kubernetes.client.AppsV1Api`` (or
    anything with its ``read_namespaced_deployment`` / ``patch_namespaced_deployment``);
    None: built on first use from the in-cluster service account, else the kubeconfig."""

    targets: Mapping[str, DeploymentTarget]
    patch_type: PatchType = "json"
    preflight: Preflight = field(default_factory=Preflight)
    apps_api: Any = None
    name: str = "kubernetes"

    async def apply(self, configs: Sequence[PoolConfig]) -> None:
        for config in configs:  # all refused before any is patched
            if config.pool not in self.targets:
                raise PatchError(f"pool {config.pool!r} has no Deployment configured")
            self.preflight.check(config)
        for config in configs:
            await asyncio.to_thread(self._patch, config)

    def _api(self) -> Any:
        if self.apps_api is None:
            try:
                from kubernetes import client, config  # optional extra
            except ImportError as exc:
                raise PatchError(
                    "the kubernetes actuator needs the kubernetes client: "
                    "pip install 'specpilot[kubernetes]'"
                ) from exc
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self.apps_api = client.AppsV1Api()
        return self.apps_api

    def _patch(self, config: PoolConfig) -> None:
        target, api = self.targets[config.pool], self._api()
        found = api.read_namespaced_deployment(target.deployment, target.namespace)
        deployment = found if isinstance(found, dict) else _as_json(api, found)
        build = json_patch if self.patch_type == "json" else strategic_merge_patch
        body = build(deployment, target.container, config.config)
        if body:
            # The client sends a list as a JSON patch and a dict as a strategic merge.
            api.patch_namespaced_deployment(target.deployment, target.namespace, body)


def _as_json(api: Any, model: Any) -> dict[str, Any]:
    """The API's JSON form (camelCase) of a client model object."""
    serialized: dict[str, Any] = api.api_client.sanitize_for_serialization(model)
    return serialized
