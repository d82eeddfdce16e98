"""Fake vLLM instances for the managed actuator's unit tests: each answers canary
completions over an ``httpx.MockTransport`` with a scripted status and latency (on a
fake clock the transport advances), and records when it was stopped."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from controller.actuators.managed import Instance, SpecConfig


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeInstance:
    host: str
    config: SpecConfig
    events: list[str]
    status: int = 200
    latency_s: float = 0.1
    in_flight: list[int] = field(default_factory=list)
    """What the drain probe reads, one value per reading (then 0)."""
    diverge_at: int | None = None
    """Greedy requests (``return_token_ids``): the output token at this position differs
    from what every other fake answers (None: the same as all)."""
    token_ids: bool = True
    """False: answer greedy requests without ``token_ids`` (an older vLLM)."""
    stopped: bool = False

    @property
    def base_url(self) -> str:
        return f"http://{self.host}"

    @property
    def served_model(self) -> str:
        return "tiny"

    async def stop(self) -> None:
        self.stopped = True
        self.events.append(f"stop {self.host}")


@dataclass
class FakeLauncher:
    """Launches ``FakeInstance``s named ``i1``, ``i2``, …; ``fail_start`` maps a config's
    method to the error its start raises, ``behaviour`` to instance attributes."""

    clock: FakeClock
    fail_start: Mapping[str, str] = field(default_factory=dict)
    behaviour: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    instances: dict[str, FakeInstance] = field(default_factory=dict)

    async def launch(self, pool: str, config: SpecConfig, timeout_s: float) -> Instance:
        method = config["method"] if config else "off"
        self.events.append(f"launch {method}")
        if method in self.fail_start:
            raise RuntimeError(self.fail_start[method])
        host = f"i{len(self.instances) + 1}"
        instance = FakeInstance(host, config, self.events, **self.behaviour.get(method, {}))
        self.instances[host] = instance
        return instance

    def transport(self) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            instance = self.instances[request.url.host]
            greedy = b"return_token_ids" in request.content
            if not greedy:
                self.events.append(f"canary {instance.host}")
                self.clock.now += instance.latency_s
            if instance.status != 200:
                return httpx.Response(instance.status, text="engine dead")
            body = json.loads(request.content)
            assert body["model"] == "tiny" and body["max_tokens"] >= 1
            if body.get("return_token_ids"):
                self.events.append(f"exact {instance.host}")
                assert body["temperature"] == 0.0 and body["ignore_eos"] is True
                return httpx.Response(200, json=greedy_answer(instance, body))
            usage = {"completion_tokens": body["max_tokens"]}
            return httpx.Response(200, json={"choices": [{"text": " x"}], "usage": usage})

        return httpx.MockTransport(handle)

    async def in_flight(self, instance: Instance) -> int:
        fake = self.instances[instance.base_url.removeprefix("http://")]
        return fake.in_flight.pop(0) if fake.in_flight else 0


def greedy_answer(instance: FakeInstance, body: dict[str, Any]) -> dict[str, Any]:
    """The same ids for the same prompt on every fake, but at ``diverge_at``."""
    seed = sum(body["prompt"].encode()) % 1000
    ids = [seed + i for i in range(body["max_tokens"])]
    if instance.diverge_at is not None and instance.diverge_at < len(ids):
        ids[instance.diverge_at] += 1
    choice: dict[str, Any] = {"text": " x"}
    if instance.token_ids:
        choice["token_ids"] = ids
    return {"choices": [choice], "usage": {"completion_tokens": len(ids)}}
