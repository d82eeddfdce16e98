"""Settings of how decisions reach the fleet: routing mode (the gateway in ``serve``),
the managed actuator, the gateway's classifier; good configs, bad ones naming the key,
and the objects ``serve`` builds from them."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.actuators.configured import OnlyPools, actuators_from, launcher_from
from controller.actuators.file import FileActuator
from controller.actuators.launcher import CommandLauncher
from controller.actuators.managed import CanarySettings, ManagedActuator, ManagedSettings
from controller.actuators.pacing import Paced
from controller.actuators.rolling import RollingRestarts
from controller.builtin import policy_from
from controller.cli import main
from controller.fleet import PoolConfig
from controller.frontdoor import classifier_from, gateway_from
from controller.gateway.classify import ModelClassifier
from controller.gateway.routing import StaticRoutingTable
from controller.gateway.table import SampledRouting
from controller.settings import (
    ManagedCanarySettings,
    Settings,
    SettingsError,
    load_settings,
)
from controller.store.db import Store
from controller.wiring import BanditControlPolicy
from tests.actuators.fakes import FakeClock, FakeLauncher

EXAMPLES = Path(__file__).resolve().parents[2] / "controller" / "examples"


def routing() -> dict[str, Any]:
    return {
        "actuators": {"mode": "routing"},
        "fleet": {
            "pools": {
                "plain": {"model": "m", "instances": ["http://127.0.0.1:9001"]},
                "fast": {
                    "model": "m",
                    "instances": ["http://127.0.0.1:9002"],
                    "proposers": {"ngram": {"method": "ngram", "gamma": [4, 4]}},
                    "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
                },
            }
        },
    }


def managed() -> dict[str, Any]:
    return {
        "actuators": {
            "file": False,
            "managed": {
                "mode": "in_place",
                "start_timeout_s": 600,
                "canary": {"requests": 2, "max_slowdown": None},
                "pools": {
                    "code": {
                        "command": ["vllm", "serve", "/models/llama"],
                        "served_model": "llama",
                        "environment": {"CUDA_VISIBLE_DEVICES": "0"},
                    }
                },
            },
        },
        "fleet": {
            "pools": {
                "code": {
                    "model": "llama",
                    "proposers": {"ngram": {"method": "ngram", "gamma": [1, 4]}},
                },
                "static": {"model": "llama", "instances": ["http://127.0.0.1:9003"]},
            }
        },
    }


def per_pod() -> dict[str, Any]:
    """The per-pod topology: every pool's vLLM beside a replica, this pod's is ``code``."""
    data = managed()
    data["fleet"]["pools"]["static"].pop("instances")
    pools = data["actuators"]["managed"]["pools"]
    pools["code"].update(host="0.0.0.0", port=8000)
    pools["static"] = {"command": ["vllm", "serve", "/models/llama"], "port": 8000}
    data["actuators"]["managed"].update(pod={"pool": "code", "replica": "pod-a"})
    data["store"] = {"url": "postgresql+psycopg://specpilot@127.0.0.1:5432/specpilot"}
    return data


def load(tmp_path: Path, data: dict[str, Any]) -> Settings:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "data"), **data}))
    return load_settings(path, environ={})


def problems(tmp_path: Path, data: dict[str, Any]) -> list[str]:
    with pytest.raises(SettingsError) as error:
        load(tmp_path, data)
    return error.value.problems


@pytest.mark.parametrize(
    "name", ["specpilot-routing.yaml", "specpilot-managed.yaml", "specpilot-pod.yaml"]
)
def test_examples_are_valid(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    load_settings(EXAMPLES / name, environ={})
    assert main(["config", "check", str(EXAMPLES / name)]) == 0
    out = capsys.readouterr().out
    assert "actuators: " in out


def test_existing_configs_keep_their_meaning(tmp_path: Path) -> None:
    settings = load_settings(EXAMPLES / "specpilot.yaml", environ={})
    assert settings.actuators.mode == "push" and settings.actuators.managed is None
    assert not settings.serves_gateway
    assert [type(a) for a in actuators_from(settings)] == [FileActuator]
    data = routing()
    del data["actuators"]
    policy = policy_from(load(tmp_path, data))
    assert isinstance(policy, BanditControlPolicy)
    assert policy.policy.config.topology == "shared"


def test_routing_mode_serves_the_gateway_with_a_per_arm_bandit(tmp_path: Path) -> None:
    settings = load(tmp_path, routing())
    assert settings.serves_gateway
    assert actuators_from(settings) == []  # nothing is pushed; decisions are still recorded
    policy = policy_from(settings)
    assert isinstance(policy, BanditControlPolicy)
    assert policy.policy.config.topology == "per_arm"
    gateway = gateway_from(settings)
    assert isinstance(gateway.routing, SampledRouting)
    assert gateway.routing.pool_by_arm == {"off": "plain", "ngram:4": "fast"}
    assert gateway.buckets.lower_edges == tuple(settings.buckets)
    assert gateway.keys.classifier is None and gateway.keys.classes == set(settings.classes)
    assert gateway.keys.default_class == settings.classes[0]
    assert gateway.keys.models == set(settings.models)


def test_push_mode_gateway_routes_by_class(tmp_path: Path) -> None:
    data = managed()
    data["classes"] = ["code", "chat"]
    data["fleet"]["pools"]["code"]["classes"] = ["code"]
    data["fleet"]["pools"]["static"]["classes"] = ["chat", "code"]
    data["gateway"] = {"enabled": True, "default_class": "chat"}
    found = problems(tmp_path, data)
    assert found == [
        "gateway.enabled: in push mode the gateway can serve managed pools only "
        "(it must know what config serves each request), not ['static']"
    ]
    del data["fleet"]["pools"]["static"]["instances"]
    data["actuators"]["managed"]["pools"]["static"] = {"command": ["vllm", "serve", "x"]}
    settings = load(tmp_path, data)
    gateway = gateway_from(settings)
    routing = gateway.routing
    assert isinstance(routing, StaticRoutingTable)
    assert routing.pool_for(None, "code", "1") == "code"  # its primary class
    assert routing.pool_for("llama", "chat", "1") == "static"
    assert routing.pool_for(None, "poetry", "1") == "code"  # the default pool
    assert gateway.fleet.default_pool == "code"  # the first: none has an instance yet
    assert gateway.fleet.pools["code"].instances == ()
    gateway.fleet.set_instances("code", ("http://127.0.0.1:8123",), "ngram:2")
    pool, instance = gateway.fleet.pick("code")
    assert (pool.arm, instance.base_url) == ("ngram:2", "http://127.0.0.1:8123")
    assert gateway.keys({}, {}) == "chat"


Edit = Callable[[dict[str, Any]], object]


@pytest.mark.parametrize(
    ("base", "edit", "key"),
    [
        (routing, lambda d: d["actuators"].update(mode="pull"), "actuators.mode: Input should be"),
        (
            routing,
            lambda d: d["fleet"]["pools"].pop("plain"),
            "fleet.pools: routing mode needs a pool without speculation",
        ),
        (
            routing,
            lambda d: d["fleet"]["pools"]["plain"].update(
                proposers={"ngram": {"method": "ngram", "gamma": [4, 4]}},
                speculative_config={"method": "ngram", "num_speculative_tokens": 4},
            ),
            "fleet.pools.plain.speculative_config: routing mode needs one pool per config",
        ),
        (
            routing,
            lambda d: d["actuators"].update(webhook={"url": "http://127.0.0.1:1/h"}),
            "actuators.webhook: routing mode pushes no config",
        ),
        (routing, lambda d: d["actuators"].update(file=True), "actuators.file: routing mode"),
        (
            routing,
            lambda d: d.update(gateway={"enabled": False}),
            "gateway.enabled: routing mode routes through the gateway",
        ),
        (
            routing,
            lambda d: d.update(wiring={"policy": "controller.builtin:hold_policy"}),
            "wiring.policy: routing mode asks specpilot's bandit",
        ),
        (
            routing,
            lambda d: d.update(wiring={"collector": "a.b:c"}),
            "wiring.collector: the gateway is the observation source",
        ),
        (routing, lambda d: d.update(gateway={"port": 70000}), "gateway.port: Input should be"),
        (
            routing,
            lambda d: d.update(gateway={"default_class": "poetry"}),
            "gateway.default_class: 'poetry' is not in classes",
        ),
        (routing, lambda d: d.update(gateway={"classifier": "/nope.json"}), "gateway.classifier:"),
        (
            managed,
            lambda d: d["actuators"]["managed"]["pools"]["code"].pop("command"),
            "actuators.managed.pools.code: give exactly one of 'command' and",
        ),
        (
            managed,
            lambda d: d["actuators"]["managed"]["pools"]["code"].update(launcher="x.y:z"),
            "actuators.managed.pools.code: give exactly one",
        ),
        (
            managed,
            lambda d: d["actuators"]["managed"]["pools"]["code"]["command"].append("--port=8000"),
            "actuators.managed.pools.code.command: leave out --port",
        ),
        (
            managed,
            lambda d: d["actuators"]["managed"]["pools"].update(ghost={"command": ["vllm"]}),
            "actuators.managed.pools: unknown pools ['ghost']",
        ),
        (
            managed,
            lambda d: d["fleet"]["pools"]["code"].update(instances=["http://127.0.0.1:9"]),
            "fleet.pools.code.instances: a managed pool runs the instances specpilot starts",
        ),
        (
            managed,
            lambda d: d["fleet"]["pools"]["static"].pop("instances"),
            "fleet.pools.static.instances: List should have at least 1 item",
        ),
        (
            managed,
            lambda d: d["actuators"]["managed"].update(mode="rolling"),
            "actuators.managed.mode: Input should be 'blue_green' or 'in_place'",
        ),
        (
            managed,
            lambda d: d["actuators"]["managed"]["canary"].update(requests=0),
            "actuators.managed.canary.requests: Input should be greater than or equal to 1",
        ),
        (
            managed,
            lambda d: d["actuators"]["managed"].update(pools={}),
            "actuators.managed.pools: Dictionary should have at least 1 item",
        ),
        (
            per_pod,
            lambda d: d["actuators"]["managed"].update(mode="blue_green"),
            "actuators.managed.pools.code.port: a fixed port needs mode: in_place",
        ),
        (
            per_pod,
            lambda d: d["actuators"]["managed"]["pod"].pop("pool"),
            "actuators.managed.pod.pool: name the pool this pod runs",
        ),
        (
            per_pod,
            lambda d: d["actuators"]["managed"]["pod"].update(pool="ghost"),
            "actuators.managed.pod.pool: 'ghost' is not one of",
        ),
        (
            per_pod,
            lambda d: d["actuators"]["managed"]["pod"].update(replica=" a"),
            "actuators.managed.pod.replica: replica name ' a' must be non-empty",
        ),
        (
            per_pod,
            lambda d: d["actuators"]["managed"].update(max_unavailable=0),
            "actuators.managed.max_unavailable: Input should be greater than or equal to 1",
        ),
        (
            per_pod,
            lambda d: (
                d["actuators"]["managed"]["pools"].pop("static"),
                d["fleet"]["pools"]["static"].update(instances=["http://127.0.0.1:9003"]),
            ),
            "fleet.pools.static.instances: in the per-pod topology every pool's vLLM",
        ),
        (
            per_pod,
            lambda d: d.update(collect={"prometheus": {"url": "http://127.0.0.1:9090"}}),
            "collect.sources: prometheus: per-pod replicas scrape their own vLLM",
        ),
    ],
)
def test_bad_mode_settings_name_the_key(
    tmp_path: Path, base: Callable[[], dict[str, Any]], edit: Edit, key: str
) -> None:
    data = base()
    edit(data)
    found = problems(tmp_path, data)
    assert any(line.startswith(key) for line in found), found


def test_config_check_refuses_routing_without_an_off_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = routing()
    data["fleet"]["pools"].pop("plain")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["config", "check", str(path)]) == 2
    assert capsys.readouterr().err.startswith(
        "error: fleet.pools: routing mode needs a pool without speculation"
    )


def test_managed_settings_build_a_paced_managed_actuator(tmp_path: Path) -> None:
    settings = load(tmp_path, managed())
    (paced,) = actuators_from(settings)  # file: false
    assert isinstance(paced, Paced) and paced.min_interval_s == settings.policy.min_dwell_s
    only = paced.inner
    assert isinstance(only, OnlyPools) and only.pools == {"code"}
    actuator = only.inner
    assert isinstance(actuator, ManagedActuator)
    assert actuator.settings == ManagedSettings(
        mode="in_place",
        start_timeout_s=600,
        canary=CanarySettings(requests=2, max_slowdown=None),
    )
    launcher = launcher_from(settings, "code", settings.actuators.managed.pools["code"])  # type: ignore[union-attr]
    assert isinstance(launcher, CommandLauncher)
    assert launcher.served_model == "llama"
    assert launcher.environment == {"CUDA_VISIBLE_DEVICES": "0"}
    assert launcher.log_dir == tmp_path / "data" / "vllm-logs"
    assert launcher.argv({"method": "ngram", "num_speculative_tokens": 3}, 8123) == [
        "vllm", "serve", "/models/llama",
        "--speculative-config", '{"method":"ngram","num_speculative_tokens":3}',
        "--host", "127.0.0.1", "--port", "8123",
    ]  # fmt: skip


def test_per_pod_settings_build_this_pods_rolling_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One settings file for every pod; the environment says which pod this is."""
    monkeypatch.setenv("SPECPILOT_ACTUATORS__MANAGED__POD__REPLICA", "pod-b")
    path = tmp_path / "s.yaml"
    data = per_pod()
    data["actuators"]["managed"]["pod"] = {}
    data["actuators"]["managed"]["pools"].pop("static")
    data["fleet"]["pools"].pop("static")
    path.write_text(yaml.safe_dump(data))
    settings = load_settings(path, environ={})
    managed = settings.actuators.managed
    assert managed is not None and (managed.pod_pool, managed.replica) == ("code", "pod-b")
    store = Store.open(f"sqlite:///{tmp_path / 'specpilot.db'}")
    try:
        (paced,) = actuators_from(settings, leases=store)
    finally:
        store.close()
    rolling = paced.inner.inner  # type: ignore[attr-defined]
    assert isinstance(rolling, RollingRestarts)
    assert (rolling.pool, rolling.replica, rolling.max_unavailable) == ("code", "pod-b", 1)
    assert rolling.ttl_s == 30.0
    launcher = rolling.inner.launcher.launchers["code"]  # type: ignore[attr-defined]
    assert isinstance(launcher, CommandLauncher) and launcher.port == 8000
    assert launcher.argv(None, 8000)[-4:] == ["--host", "0.0.0.0", "--port", "8000"]
    with pytest.raises(ValueError, match="restart leases"):
        actuators_from(settings)


def test_settings_defaults_are_the_managed_actuators(tmp_path: Path) -> None:
    canary = ManagedCanarySettings().model_dump()
    assert canary == dataclasses.asdict(CanarySettings())
    data = managed()
    data["actuators"]["managed"] = {"pools": data["actuators"]["managed"]["pools"]}
    (paced,) = actuators_from(load(tmp_path, data))
    assert paced.inner.inner.settings == ManagedSettings()  # type: ignore[attr-defined]


def test_managed_pools_only_and_the_switch_hears_the_config(tmp_path: Path) -> None:
    """Built from settings with the unit tests' fake launcher: only the managed pool is
    started, and the traffic switch hears its URL with the config it runs."""
    data = managed()
    data["actuators"]["managed"]["pools"]["code"] = {"launcher": "tests.actuators.fakes:x"}
    data["actuators"]["managed"]["switch_grace_s"] = 0
    settings = load(tmp_path, data)
    fake = FakeLauncher(FakeClock())
    switches: list[tuple[str, tuple[str, ...], Any]] = []
    pools = settings.actuators.managed.pools  # type: ignore[union-attr]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            "controller.actuators.configured.load_factory", lambda path: lambda s, p: fake
        )
        (built,) = actuators_from(settings, on_switch=lambda *args: switches.append(args))
    assert isinstance(built, Paced)
    paced = built
    assert set(pools) == {"code"}
    actuator = paced.inner.inner  # type: ignore[attr-defined]
    actuator.transport, actuator.in_flight, actuator.timer = (
        fake.transport(),
        fake.in_flight,
        fake.clock,
    )
    ngram = {"method": "ngram", "num_speculative_tokens": 2}

    async def run() -> None:
        await paced.apply([PoolConfig("code", ngram, ()), PoolConfig("static", None, ())])
        assert fake.events[0] == "launch ngram" and len(fake.instances) == 1
        assert switches == [("code", ("http://i1",), ngram)]
        await paced.aclose()  # serve's shutdown: the instance it started is stopped

    asyncio.run(run())
    assert fake.instances["i1"].stopped


def test_classifier_file_is_checked_and_plugged(tmp_path: Path) -> None:
    from policies.classifier import ClassifierRecipe, LabelledPrompt, dumps_recipe

    examples = [
        LabelledPrompt("def add(a, b):\n    return a + b", "code", None),
        LabelledPrompt("import os\nfor x in range(3):\n    print(x)", "code", None),
        LabelledPrompt("How are you today? Tell me about your weekend.", "chat", None),
        LabelledPrompt("What is a good name for a cat?", "chat", None),
    ]
    model = tmp_path / "classifier.json"
    model.write_text(dumps_recipe(ClassifierRecipe(tuple(examples), 1)))
    data = routing()
    data["classes"] = ["code", "chat"]
    data["gateway"] = {"classifier": str(model)}
    settings = load(tmp_path, data)
    classifier = classifier_from(settings)
    assert isinstance(classifier.classifier, ModelClassifier)
    assert classifier({}, {"prompt": "def mul(a, b):\n    return a * b"}) == "code"
    assert classifier({}, {"prompt": "x", "metadata": {"workload_class": "chat"}}) == "chat"
    assert classifier({}, {"prompt": "x", "metadata": {"workload_class": "poetry"}}) == "code"

    data["classes"] = ["code", "rag"]
    found = problems(tmp_path, data)
    assert found == [f"gateway.classifier: {model} predicts classes not in classes: ['chat']"]
