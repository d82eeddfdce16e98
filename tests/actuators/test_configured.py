"""Actuators as a settings file configures them (what `specpilot serve` runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.actuators.configured import actuators_from
from controller.actuators.file import FileActuator
from controller.actuators.k8s import DeploymentTarget, KubernetesActuator
from controller.actuators.pacing import Paced
from controller.actuators.webhook import WebhookActuator
from controller.settings import SettingsError, load_settings

BASE = """
data_dir: {data}
policy: {{min_dwell_s: 120}}
fleet:
  pools:
    chat:
      model: m
      instances: ["http://127.0.0.1:9"]
      proposers: {{ngram: {{method: ngram, gamma: [1, 4]}}}}
"""


def settings_file(tmp_path: Path, actuators: str) -> Path:
    path = tmp_path / "specpilot.yaml"
    path.write_text(BASE.format(data=tmp_path / "data") + actuators)
    return path


def test_default_is_the_file_actuator_alone(tmp_path: Path) -> None:
    (only,) = actuators_from(load_settings(settings_file(tmp_path, "")))
    assert isinstance(only, FileActuator)
    assert only.directory == tmp_path / "data" / "speculative-configs"


def test_webhook_and_kubernetes_are_paced_by_the_dwell_time(tmp_path: Path) -> None:
    text = """
actuators:
  file: false
  webhook: {url: "http://127.0.0.1:8099/hook", headers: {Authorization: "Bearer x"}, attempts: 3}
  kubernetes:
    deployments: {chat: {namespace: llm, deployment: vllm-chat, container: vllm}}
    patch_type: strategic-merge
"""
    webhook, kubernetes = actuators_from(load_settings(settings_file(tmp_path, text)))
    assert isinstance(webhook, Paced) and isinstance(kubernetes, Paced)
    assert webhook.min_interval_s == kubernetes.min_interval_s == 120
    assert isinstance(webhook.inner, WebhookActuator)
    assert webhook.inner.url == "http://127.0.0.1:8099/hook"
    assert webhook.inner.retry.attempts == 3
    assert webhook.inner.headers == {"Authorization": "Bearer x"}
    assert isinstance(kubernetes.inner, KubernetesActuator)
    assert kubernetes.inner.targets == {"chat": DeploymentTarget("llm", "vllm-chat", "vllm")}
    assert kubernetes.inner.patch_type == "strategic-merge"


def test_bad_actuator_settings_name_the_key(tmp_path: Path) -> None:
    text = """
actuators:
  kubernetes: {deployments: {chat: {deployment: d, container: c}}, patch_type: merge}
  webhook: {url: "not a url"}
"""
    with pytest.raises(SettingsError) as raised:
        load_settings(settings_file(tmp_path, text))
    problems = "\n".join(raised.value.problems)
    assert "actuators.kubernetes.patch_type" in problems
    assert "actuators.webhook.url" in problems
