"""A request's class and model as the policy keys them (``RequestKeys``): the header,
else ``metadata.workload_class``, else the classifier, always one of the configured
classes; a model no pool serves refused 404. And end to end: a flood of made-up values
through the gateway ``serve`` builds, against replayed vLLM responses, leaves the policy's
contexts and saved state as they were."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from collectors.observations import RequestObservation
from controller.contexts import Context
from controller.frontdoor import gateway_from
from controller.gateway import RequestKeys, UnknownModel
from controller.gateway.classify import ConstantClassifier
from controller.gateway.table import SampledRouting
from controller.ports import Routed
from controller.settings import Settings
from controller.wiring import bandit_policy
from policies.bandit import SpecPilotPolicy
from tests.gateway.conftest import LoopThread, RunningGateway
from tests.gateway.test_gateway_fakes import start_replay

MODEL = "tiny-llama"  # what the recorded responses name
CLASSES = ("code", "chat", "creative")


def test_the_header_then_metadata_then_the_classifier_name_the_class() -> None:
    asked: list[Mapping[str, Any]] = []

    def classifier(headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
        asked.append(body)
        return "creative"

    keys = RequestKeys(CLASSES, "chat", classifier)
    meta = {"metadata": {"workload_class": "code"}}
    assert keys.workload_class("code", {}) == "code"
    assert keys.workload_class(" CODE ", {}) == "code"  # trimmed, case-insensitive
    assert keys.workload_class("creative", meta) == "creative"  # the header wins
    assert keys.workload_class(None, meta) == "code"
    assert keys.workload_class("  ", meta) == "code"  # an empty header names nothing
    assert asked == []
    assert keys.workload_class(None, {"prompt": "x"}) == "creative"
    assert len(asked) == 1


@pytest.mark.parametrize(
    "header, body",
    [
        ("poetry", {}),  # a class the settings do not list
        ("x" * 10_000, {}),
        (None, {"metadata": {"workload_class": "poetry"}}),
    ],
)
def test_a_named_class_outside_the_settings_is_the_default_class(
    header: str | None, body: dict[str, Any]
) -> None:
    assert RequestKeys(CLASSES, "chat").workload_class(header, body) == "chat"


def test_a_constant_classifier_names_a_configured_class_or_the_default() -> None:
    unlabelled: dict[str, Any] = {"prompt": "x"}
    assert (
        RequestKeys(CLASSES, "chat", ConstantClassifier(" Code ")).workload_class(None, unlabelled)
        == "code"
    )
    assert (
        RequestKeys(CLASSES, "chat", ConstantClassifier("poetry")).workload_class(None, unlabelled)
        == "chat"
    )
    # Without settings, a constant that is no label is the default class too.
    assert (
        RequestKeys(classifier=ConstantClassifier("Bad Label!")).workload_class(None, unlabelled)
        == "default"
    )


@pytest.mark.parametrize(
    "metadata",
    [["code"], "code", 7, {"workload_class": 7}, {"workload_class": ["code"]}, {"other": 1}],
)
def test_malformed_metadata_names_nothing_and_logs_nothing(
    metadata: Any, caplog: pytest.LogCaptureFixture
) -> None:
    keys = RequestKeys(CLASSES, "chat", lambda headers, body: "creative")
    with caplog.at_level(logging.DEBUG):
        assert keys.workload_class(None, {"metadata": metadata}) == "creative"
        # Without a classifier it is the configured default, not "default".
        assert RequestKeys(CLASSES, "chat").workload_class(None, {"metadata": metadata}) == "chat"
    assert caplog.records == []


def test_a_failing_classifier_gives_the_configured_default_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
        raise RuntimeError("classifier bug")

    def malformed(headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
        raise ValueError("'messages' must be a list")  # as policies.classifier raises

    keys = RequestKeys(CLASSES, "chat", broken)
    with caplog.at_level(logging.DEBUG):
        for _ in range(100):
            assert keys.workload_class(None, {"prompt": "x"}) == "chat"
        assert RequestKeys(CLASSES, "creative", malformed)({}, {"messages": 3}) == "creative"
    assert len(caplog.records) == 1
    assert caplog.records[0].exc_info is not None
    assert "'chat'" in caplog.records[0].getMessage()


def test_a_classifier_predicting_an_unlisted_class_gives_the_default() -> None:
    keys = RequestKeys(CLASSES, "code", lambda headers, body: "rag")
    assert keys({}, {"prompt": "x"}) == "code"
    assert keys({"X-Workload-Class": "Chat"}, {}) == "chat"


def test_models_the_pools_do_not_serve_are_unknown() -> None:
    keys = RequestKeys(CLASSES, models=["llama"])
    assert keys.model({"model": "llama"}) == "llama"
    assert keys.model({}) is None  # the default model
    assert keys.model({"model": 3}) is None  # the upstream answers that one
    with pytest.raises(UnknownModel, match="`mistral`"):
        keys.model({"model": "mistral"})
    assert RequestKeys().model({"model": "anything"}) == "anything"


def test_without_settings_a_label_like_name_is_taken_as_it_is() -> None:
    keys = RequestKeys()
    assert keys.workload_class("Code", {}) == "code"
    assert keys.workload_class("not a label!", {}) == "default"
    with pytest.raises(ValueError, match="default class"):
        RequestKeys(CLASSES, "poetry")


# --- end to end -----------------------------------------------------------------------


def routing_settings(urls: Mapping[str, str], data_dir: Path) -> Settings:
    """Routing mode over two pools (off and n-gram γ=4) of one model, as ``serve`` reads it."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    return Settings.model_validate(
        {
            "data_dir": data_dir,
            "classes": list(CLASSES),
            "actuators": {"mode": "routing"},
            "gateway": {"default_class": "chat"},
            "fleet": {
                "pools": {
                    "plain": {"model": MODEL, "instances": [urls["off"]]},
                    "fast": {
                        "model": MODEL,
                        "instances": [urls["ngram"]],
                        "speculative_config": ngram,
                        "proposers": {"ngram": {"method": "ngram", "gamma": [4, 4]}},
                    },
                }
            },
        }
    )


def keys_in_state(state: Mapping[str, Any]) -> set[tuple[str, str]]:
    """Every (model, class) the policy's saved state holds anything for."""
    found: set[tuple[str, str]] = set()
    for part, field in (
        ("learning", "acceptance"),
        ("learning", "detectors"),
        ("exploration", "class_requests"),
        ("exploration", "credits"),
    ):
        found |= {(key[0], key[1]) for key, _ in state[part][field]}
    found |= {(key[0], key[1]) for key, _ in state["commitment"]}
    return found


def test_made_up_classes_and_models_leave_the_policy_as_it_was(
    loop_thread: LoopThread, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    upstreams = {arm: start_replay(loop_thread) for arm in ("off", "ngram")}
    settings = routing_settings({arm: url for arm, (_, url) in upstreams.items()}, tmp_path)
    (model,) = settings.models
    control = bandit_policy(settings, topology="per_arm")
    policy: SpecPilotPolicy = control.policy
    gateway = gateway_from(settings)
    routing = gateway.routing
    assert isinstance(routing, SampledRouting)
    running = RunningGateway(gateway)
    observed = running.observations
    seen: set[Context] = set()

    def routed(model: str | None, cls: str, bucket: str, arm: str, reason: str) -> None:
        # What a worker reports per routed request, counted as the loop counts it.
        context = Context(model or "", cls, bucket)
        seen.add(context)
        control.routed(Routed(context, arm, reason, time.time()))

    def sink(observation: RequestObservation) -> None:
        observed.append(observation)
        policy.observe(observation)

    routing.on_routed = routed

    running.gateway.sink = sink
    url = f"{running.base_url}/v1/completions"
    body: dict[str, Any] = {"model": model, "prompt": "def f(x):", "stream": True}
    try:
        with httpx.Client(timeout=30.0) as client:

            def send(extra: Mapping[str, Any], **headers: str) -> httpx.Response:
                return client.post(url, json={**body, **extra}, headers=headers)

            for _ in range(30):  # every class, and no class named
                for name in CLASSES:
                    assert send({}, **{"X-Workload-Class": name}).is_success
                assert send({}).is_success
            running.wait_observations(120)
            warm = policy.state_dict()
            warm_size = len(json.dumps(warm))

            with caplog.at_level(logging.INFO):
                for i in range(600):
                    assert send({}, **{"X-Workload-Class": f"tenant-{i}"}).is_success
                    assert send({"metadata": {"workload_class": f"team {i}"}}).is_success
                    refused = send({"model": f"model-{i}"})
                    assert refused.status_code == 404
                    assert refused.json()["error"]["type"] == "NotFoundError"
                for metadata in (["code"], "code", 7, {"workload_class": 7}):
                    assert send({"metadata": metadata}).is_success
            running.wait_observations(120 + 1204)
    finally:
        running.stop()
    # The made-up models never left the gateway.
    assert sum(replay.requests for replay, _ in upstreams.values()) == 120 + 1204

    state = policy.state_dict()
    classes = {name for _, name in keys_in_state(state)}
    assert {m for m, _ in keys_in_state(state)} == {model}
    assert classes <= set(CLASSES) and classes == {n for _, n in keys_in_state(warm)}
    assert {o.workload_class for o in observed} == set(CLASSES)
    assert {o.model for o in observed} == {model}
    assert {(c.model, c.workload_class) for c in seen} <= {(model, c) for c in CLASSES}
    # Counts grow by digits, nothing grows by entries: 1,800 made-up values later the
    # saved state is the size it was (2,000 header values used to make it 365x larger).
    assert len(json.dumps(state)) < 1.1 * warm_size
    assert not [r for r in caplog.records if r.exc_info]
