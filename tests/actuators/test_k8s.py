"""The Kubernetes patch on realistic Deployments (as the API serves them, camelCase)."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest

from controller.actuators.k8s import (
    DeploymentTarget,
    KubernetesActuator,
    PatchError,
    json_patch,
    strategic_merge_patch,
    with_speculative_config,
)
from controller.fleet import PoolConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
NGRAM_JSON = '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}'


def deployment(containers: list[dict[str, Any]]) -> dict[str, Any]:
    """A vLLM Deployment roughly as `kubectl get deploy -o json` shows it."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "llama-chat",
            "namespace": "inference",
            "labels": {"app": "llama-chat"},
            "resourceVersion": "48213",
            "generation": 7,
        },
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "llama-chat"}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}},
            "template": {
                "metadata": {"labels": {"app": "llama-chat"}},
                "spec": {
                    "containers": containers,
                    "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
                },
            },
        },
        "status": {"readyReplicas": 2, "replicas": 2},
    }


LOG_SIDECAR = {"name": "fluent-bit", "image": "fluent/fluent-bit:3.0", "args": ["-c", "/f.conf"]}


def vllm_container(**fields: Any) -> dict[str, Any]:
    return {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.32.0",
        "ports": [{"containerPort": 8000, "name": "http"}],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
        **fields,
    }


SERVE_ARGS = [
    "--model",
    "meta-llama/Llama-3.1-8B-Instruct",
    "--speculative-config",
    '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", '
    '"num_speculative_tokens": 3}',
    "--per-request-spec-decode-metrics",
    "detailed",
    "--max-num-seqs",
    "128",
]


def apply_json_patch(document: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """A small RFC 6902 interpreter for the ops we emit (test, replace, add)."""
    result = copy.deepcopy(document)
    for op in ops:
        *parents, last = op["path"].strip("/").split("/")
        node: Any = result
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "test":
            assert node.get(last) == op["value"], "test op failed"
        elif op["op"] == "replace":
            assert last in node
            node[last] = op["value"]
        elif op["op"] == "add":
            node[last] = op["value"]
        else:
            raise AssertionError(op)
    return result


def test_replaces_the_argument_in_args_keeping_everything_else() -> None:
    doc = deployment([LOG_SIDECAR, vllm_container(args=SERVE_ARGS)])
    ops = json_patch(doc, "vllm", NGRAM)
    path = "/spec/template/spec/containers/1/args"
    assert ops[0] == {"op": "test", "path": path, "value": SERVE_ARGS}
    expected = [*SERVE_ARGS[:2], "--speculative-config", NGRAM_JSON, *SERVE_ARGS[4:]]
    assert ops[1] == {"op": "replace", "path": path, "value": expected}
    patched = apply_json_patch(doc, ops)
    assert patched["spec"]["template"]["spec"]["containers"][0] == LOG_SIDECAR
    assert json_patch(patched, "vllm", NGRAM) == []  # already there: no patch, no rollout

    smp = strategic_merge_patch(doc, "vllm", NGRAM)
    assert smp == {
        "spec": {"template": {"spec": {"containers": [{"name": "vllm", "args": expected}]}}}
    }
    assert strategic_merge_patch(patched, "vllm", NGRAM) == {}


def test_equals_form_in_the_command_of_a_python_module_launch() -> None:
    command = [
        "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model=/models/llama",
        '--speculative-config={"method":"ngram","num_speculative_tokens":2}',
        "--port=8000",
    ]
    doc = deployment([vllm_container(command=command)])
    ops = json_patch(doc, "vllm", NGRAM)
    assert ops[1]["path"] == "/spec/template/spec/containers/0/command"
    assert ops[1]["value"] == [*command[:4], "--speculative-config", NGRAM_JSON, "--port=8000"]


def test_adds_the_argument_when_there_is_none() -> None:
    doc = deployment([vllm_container(command=["vllm", "serve", "/models/llama"])])
    assert json_patch(doc, "vllm", NGRAM) == [
        {
            "op": "add",
            "path": "/spec/template/spec/containers/0/args",
            "value": ["--speculative-config", NGRAM_JSON],
        }
    ]
    with_args = deployment([vllm_container(args=["--port", "8000"])])
    assert json_patch(with_args, "vllm", NGRAM)[1]["value"] == [
        "--port",
        "8000",
        "--speculative-config",
        NGRAM_JSON,
    ]


def test_off_removes_it_and_the_per_request_spec_metrics_flag() -> None:
    doc = deployment([vllm_container(args=SERVE_ARGS)])
    ops = json_patch(doc, "vllm", None)
    assert ops[1]["value"] == [
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--max-num-seqs",
        "128",
    ]
    assert json_patch(deployment([vllm_container(args=["--port", "8000"])]), "vllm", None) == []


def test_duplicates_and_underscore_spelling_collapse_to_one() -> None:
    argv = ["--speculative_config", "{}", "--x", "--speculative-config={}", "--y"]
    assert with_speculative_config(argv, NGRAM) == [
        "--speculative-config",
        NGRAM_JSON,
        "--x",
        "--y",
    ]
    # The JSON value is one argument however it is spaced.
    parsed = with_speculative_config([], NGRAM)
    assert json.loads(parsed[1]) == NGRAM


@pytest.mark.parametrize(
    ("containers", "message"),
    [
        ([LOG_SIDECAR], "no container 'vllm'"),
        (
            [vllm_container(command=["/bin/sh", "-c", "vllm serve m --speculative-config x"])],
            "shell",
        ),
    ],
)
def test_refuses_what_it_cannot_patch_safely(
    containers: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(PatchError, match=message):
        json_patch(deployment(containers), "vllm", NGRAM)


class FakeAppsApi:
    """Stands in for ``kubernetes.client.AppsV1Api``: the two calls the actuator makes."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.patches: list[tuple[str, str, Any]] = []

    def read_namespaced_deployment(self, name: str, namespace: str) -> dict[str, Any]:
        assert (name, namespace) == ("llama-chat", "inference")
        return self.doc

    def patch_namespaced_deployment(self, name: str, namespace: str, body: Any) -> None:
        self.patches.append((name, namespace, body))
        self.doc = apply_json_patch(self.doc, body) if isinstance(body, list) else self.doc


def test_actuator_patches_only_when_the_config_changes() -> None:
    api = FakeAppsApi(deployment([vllm_container(args=SERVE_ARGS)]))
    actuator = KubernetesActuator(
        {"chat": DeploymentTarget("inference", "llama-chat", "vllm")}, apps_api=api
    )
    asyncio.run(actuator.apply([PoolConfig("chat", NGRAM, ())]))
    asyncio.run(actuator.apply([PoolConfig("chat", NGRAM, ())]))
    assert len(api.patches) == 1 and isinstance(api.patches[0][2], list)

    smp = KubernetesActuator(
        {"chat": DeploymentTarget("inference", "llama-chat", "vllm")},
        patch_type="strategic-merge",
        apps_api=api,
    )
    asyncio.run(smp.apply([PoolConfig("chat", None, ())]))
    assert isinstance(api.patches[-1][2], dict)

    with pytest.raises(PatchError, match="no Deployment configured"):
        asyncio.run(actuator.apply([PoolConfig("code", NGRAM, ())]))
