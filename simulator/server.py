"""The simulator's server mode: simulated vLLM instances behind vLLM 0.32's protocols.

Each instance (:class:`simulator.instance.SimInstance`, one GPU, one engine) gets its
own HTTP server on a free loopback port, all in one process and one event loop, so a
whole fleet costs no GPU and little CPU. An instance answers like
``vllm serve --enable-per-request-metrics --per-request-spec-decode-metrics detailed``:

- ``GET /health``, ``GET /v1/models``;
- ``POST /v1/completions`` and ``POST /v1/chat/completions``, non-streaming or SSE
  (``stream``; with ``stream_options.include_usage`` the final usage chunk carries
  ``metrics``), bodies shaped as the recorded ones in ``tests/fixtures/vllm-0.32``;
- ``GET /metrics``: see :mod:`simulator.vllm_metrics`.

What a request is about is simulated, not read from its text: its workload class comes
from the ``X-Workload-Class`` header or ``metadata.workload_class``, else a cheap
keyword guess, else the scenario's class mix; its length is the class's (capped by
``max_tokens``; absent ``max_tokens`` means the natural length, where a real
``/v1/completions`` would default to 16); its text is filler. A client that hangs up
does not abort its request (the engine has no removal): it runs to its end, using
batch capacity, as an unaborted request would.

Not vLLM, for the simulator's operators and the managed-restart actuator:
``GET /sim/info`` (pool, config, start time) and ``POST /sim/restart``
(``{"speculative_config": <vLLM JSON or null>, "downtime_s": s}``; without
``speculative_config`` the config is kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from simulator.instance import (
    Aborted,
    ConfigError,
    FinishedRequest,
    InstanceDown,
    SimInstance,
    SpecConfig,
    StepOutput,
    Ticket,
    guess_class,
)
from simulator.scenario import Scenario

T = TypeVar("T")

SYSTEM_FINGERPRINT = "vllm-0.32.0-specpilot-sim"
WORKLOAD_CLASS_HEADER = "X-Workload-Class"
CHARS_PER_TOKEN = 4
"""Prompt tokens are estimated from characters; the simulator has no tokenizer."""
CHAT_TEMPLATE_TOKENS = 8
"""Tokens a chat template adds per message (role markers), roughly."""
_FILLER = (" the", " model", " returns", " a", " value", " for", " each", " token", ".",
           "\n", " def", " f", "(", "x", ")", ":", " {", "}", " and", " then")  # fmt: skip


def _dumps(document: Mapping[str, Any]) -> str:
    return json.dumps(document, separators=(",", ":"))


def _error(
    status: int, message: str, kind: str = "BadRequestError", param: str | None = None
) -> JSONResponse:
    """vLLM's OpenAI-style error body."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _too_long(prompt_tokens: int, max_model_len: int) -> JSONResponse:
    """What vLLM 0.32 answers a prompt longer than its context (``renderers/params.py``),
    before the request reaches the engine."""
    return _error(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt contains {prompt_tokens} input tokens, which exceeds this limit even "
        "without any output tokens. Please reduce the length of the input prompt.",
        param="input_tokens",
    )


def filler_text(request_id: int, start: int, count: int) -> str:
    """Stand-in text of output tokens ``start .. start+count-1`` of a request."""
    return "".join(
        _FILLER[(request_id * 7 + i) % len(_FILLER)] for i in range(start, start + count)
    )


def response_metrics(finished: FinishedRequest) -> dict[str, Any]:
    """The ``metrics`` object vLLM adds to a response, from the engine's figures.

    ``mean_itl_ms`` is vLLM's: generation time over (output tokens − 1), a per-token
    mean, whereas the inter-token-latency histogram is per engine step.
    """
    observation = finished.observation
    tokens = observation.output_tokens or 0
    ttft_ms = finished.ttft_s * 1000.0
    generation_ms = finished.generation_s * 1000.0
    total_s = finished.ttft_s + finished.generation_s
    spec: dict[str, Any] | None = None
    stats = observation.spec
    if stats is not None and finished.arm.proposer is not None:
        gamma = finished.arm.gamma
        steps = stats.num_drafts or 0
        accepted = stats.num_accepted_tokens or 0
        draft_tokens = stats.num_draft_tokens or 0
        histogram = np.bincount(np.array(finished.per_step_accepted, dtype=np.int64),
                                minlength=gamma + 1)  # fmt: skip
        spec = {
            "mean_acceptance_length": 1.0 + accepted / steps if steps else 0.0,
            "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "acceptance_histogram": [int(c) for c in histogram],
            "num_spec_steps": steps,
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": draft_tokens,
            "num_spec_tokens": gamma,
            "per_step_accepted": list(finished.per_step_accepted),
            "per_step_drafted": [gamma] * steps,
        }
    return {
        "time_to_first_token_ms": ttft_ms,
        "generation_time_ms": generation_ms,
        "queue_time_ms": finished.queue_s * 1000.0,
        "mean_itl_ms": generation_ms / (tokens - 1) if tokens > 1 else 0.0,
        "tokens_per_second": tokens / total_s if total_s > 0 else 0.0,
        "speculative_decoding": spec,
    }


def _usage(finished: FinishedRequest, *, detailed: bool) -> dict[str, Any]:
    output = finished.observation.output_tokens or 0
    usage: dict[str, Any] = {
        "prompt_tokens": finished.prompt_tokens,
        "total_tokens": finished.prompt_tokens + output,
        "completion_tokens": output,
    }
    if detailed:
        usage |= {"prompt_tokens_details": None, "completion_tokens_details": None}
    return usage


@dataclass(frozen=True, slots=True)
class _Call:
    """One OpenAI-style call as the simulator reads it."""

    chat: bool
    prompt: str
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    workload_class: str | None


def _read_call(body: Mapping[str, Any], chat: bool, header_class: str | None) -> _Call:
    """Validate a request body; raises ValueError with a client-facing message."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        parts = [m.get("content") for m in messages if isinstance(m, Mapping)]
        prompt = "\n".join(p for p in parts if isinstance(p, str))
        prompt_tokens = len(prompt) // CHARS_PER_TOKEN + CHAT_TEMPLATE_TOKENS * len(messages)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if not isinstance(raw, str):
            raise ValueError("'prompt' must be a string (batched prompts are not simulated)")
        prompt = raw
        prompt_tokens = max(1, -(-len(prompt) // CHARS_PER_TOKEN))
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError("'max_tokens' must be a positive integer")
    if body.get("n", 1) != 1:
        raise ValueError("only n = 1 is simulated")
    options = body.get("stream_options")
    metadata = body.get("metadata")
    declared = header_class
    if declared is None and isinstance(metadata, Mapping):
        value = metadata.get("workload_class")
        declared = value if isinstance(value, str) else None
    return _Call(
        chat=chat,
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        include_usage=isinstance(options, Mapping) and bool(options.get("include_usage")),
        workload_class=declared,
    )


def _pick_class(instance: SimInstance, call: _Call) -> str:
    classes = list(instance.scenario.classes)
    if call.workload_class in instance.scenario.classes:
        return call.workload_class
    return guess_class(call.prompt, classes) or instance.drawer.pick_class()


class _Exchange:
    """Builds the response documents of one call (ids, shapes) as vLLM 0.32 does."""

    def __init__(self, instance: SimInstance, call: _Call, ticket: Ticket) -> None:
        self.call = call
        self.ticket = ticket
        self.model = instance.model_name
        self.id = ("chatcmpl-" if call.chat else "cmpl-") + secrets.token_hex(8)
        self.created = int(time.time())
        self.object = "chat.completion" if call.chat else "text_completion"

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = self.object + (".chunk" if chunk and self.call.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def body(self, finished: FinishedRequest) -> dict[str, Any]:
        text = filler_text(self.ticket.request.request_id, 0, self.ticket.request.output_tokens)
        choice: dict[str, Any]
        if self.call.chat:
            message = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                       "audio": None, "function_call": None, "reasoning": None}  # fmt: skip
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": finished.finish_reason, "stop_reason": None,
                      "token_ids": None, "routed_experts": None}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finished.finish_reason, "stop_reason": None,
                      "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                      "routed_experts": None}  # fmt: skip
        document = self._head(chunk=False) | {
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": _usage(finished, detailed=True),
        }
        if self.call.chat:
            document |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        return document | {
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": response_metrics(finished),
        }

    def role_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}  # fmt: skip
        return self._head(chunk=True) | {
            "choices": [choice],
            "prompt_token_ids": None,
            "prompt_text": None,
        }

    def text_chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.call.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                      "finish_reason": finish_reason}  # fmt: skip
            if finish_reason is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = None
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None, "prompt_token_ids": None, "token_ids": None}  # fmt: skip
        return self._head(chunk=True) | {"choices": [choice]}

    def usage_chunk(self, finished: FinishedRequest) -> dict[str, Any]:
        return self._head(chunk=True) | {
            "choices": [],
            "usage": _usage(finished, detailed=False),
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "metrics": response_metrics(finished),
        }

    async def events(self) -> AsyncIterator[StepOutput | FinishedRequest]:
        """The ticket's events until it finishes; raises RuntimeError if aborted."""
        while True:
            event = await self.ticket.events.get()
            if isinstance(event, Aborted):
                raise RuntimeError(event.reason)
            yield event
            if isinstance(event, FinishedRequest):
                return

    async def sse(self) -> AsyncIterator[str]:
        """The SSE stream: one chunk per engine step, the usage chunk, ``[DONE]``."""
        request = self.ticket.request
        sent = 0
        if self.call.chat:
            yield f"data: {_dumps(self.role_chunk())}\n\n"
        try:
            async for event in self.events():
                if isinstance(event, StepOutput):
                    text = filler_text(request.request_id, sent, event.tokens)
                    sent += event.tokens
                    last = sent >= request.output_tokens
                    reason = self.ticket.finish_reason if last else None
                    yield f"data: {_dumps(self.text_chunk(text, reason))}\n\n"
                elif self.call.include_usage:
                    yield f"data: {_dumps(self.usage_chunk(event))}\n\n"
        except RuntimeError:
            return  # the instance restarted: the connection just ends, as with a real one
        yield "data: [DONE]\n\n"


def build_app(instance: SimInstance, *, pool: str = "", name: str = "") -> FastAPI:
    """The HTTP face of one simulated instance."""
    app = FastAPI(title=f"specpilot simulated vLLM {name}".strip(), docs_url=None, redoc_url=None)

    restarting: set[asyncio.Task[None]] = set()

    def down() -> JSONResponse:
        return _error(503, "the simulated instance is restarting", "ServiceUnavailableError")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200) if instance.is_up else down()

    @app.get("/v1/models")
    async def models() -> Response:
        if not instance.is_up:
            return down()
        card = {"id": instance.model_name, "object": "model",
                "created": int(instance.started_at), "owned_by": "vllm",
                "root": instance.model_name, "parent": None,
                "max_model_len": instance.kv_cache_tokens, "permission": []}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics() -> Response:
        if not instance.is_up:
            return down()  # a restarting vLLM has no /metrics either
        return Response(generate_latest(instance.registry), media_type=CONTENT_TYPE_LATEST)

    async def serve(request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != instance.model_name:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        try:
            call = _read_call(body, chat, request.headers.get(WORKLOAD_CLASS_HEADER))
        except ValueError as exc:
            return _error(400, str(exc))
        if call.prompt_tokens > instance.kv_cache_tokens:
            return _too_long(call.prompt_tokens, instance.kv_cache_tokens)
        try:
            ticket = instance.submit(
                _pick_class(instance, call), call.prompt_tokens, call.max_tokens
            )
        except InstanceDown:
            return down()
        exchange = _Exchange(instance, call, ticket)
        if call.stream:
            return StreamingResponse(exchange.sse(), media_type="text/event-stream")
        try:
            async for event in exchange.events():
                if isinstance(event, FinishedRequest):
                    return JSONResponse(exchange.body(event))
        except RuntimeError as exc:
            return _error(500, f"request aborted: {exc}", "InternalServerError")
        raise AssertionError("events end with a finished request")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    @app.get("/sim/info")
    async def info() -> dict[str, Any]:
        return {
            "pool": pool,
            "instance": name,
            "config": str(instance.config),
            "speculative_config": instance.config.to_vllm(),
            "process_start_time_seconds": instance.started_at,
            "restarts": instance.restarts,
            "up": instance.is_up,
            "sim_time_s": instance.sim_now(),
            "speed": instance.speed,
        }

    @app.post("/sim/restart")
    async def restart(request: Request) -> Response:
        try:
            body = await request.json() if await request.body() else {}
            if not isinstance(body, dict):
                raise ConfigError("body must be a JSON object")
            config = None
            if "speculative_config" in body:
                config = SpecConfig.from_vllm(body["speculative_config"])
                config.check_against(instance.scenario)
            downtime = float(body.get("downtime_s", 0.0))
        except (ValueError, TypeError) as exc:
            return _error(400, str(exc))
        if downtime > 0:
            task = asyncio.get_running_loop().create_task(instance.restart(config, downtime))
            restarting.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(restarting.discard)
            return JSONResponse({"restarting": True, "config": str(config or instance.config)}, 202)
        await instance.restart(config)
        return JSONResponse({"restarting": False, "config": str(instance.config)})

    return app


# -- pools and fleets --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """Instances that run the same config: the unit a gateway routes to."""

    name: str
    config: SpecConfig
    instances: int = 1


def parse_pools(text: str) -> tuple[PoolSpec, ...]:
    """``NAME=CONFIG[*COUNT]`` separated by spaces or semicolons, CONFIG as in
    :meth:`SpecConfig.parse`, e.g. ``"plain=off*2; code=ngram:4; chat=eagle3:5@17-1024=0"``."""
    pools: list[PoolSpec] = []
    for part in text.replace(";", " ").split():
        name, sep, rest = part.partition("=")
        if not sep or not name:
            raise ConfigError(f"pool {part!r} is not NAME=CONFIG[*COUNT]")
        config_text, _, count = rest.rpartition("*") if "*" in rest else (rest, "", "1")
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"pool {name!r}: instance count {count!r} is not a positive integer")
        pools.append(PoolSpec(name, SpecConfig.parse(config_text), int(count)))
    if not pools:
        raise ConfigError("no pools given")
    if len({p.name for p in pools}) != len(pools):
        raise ConfigError("pool names must be distinct")
    return tuple(pools)


def default_pools(scenario: Scenario) -> tuple[PoolSpec, ...]:
    """One ``off`` instance and one per proposer at its middle γ: every proposer of the
    scenario is on show, with a γ that is neither timid nor reckless."""
    pools = [PoolSpec("off", SpecConfig(None))]
    for proposer, spec in scenario.proposers.items():
        gammas = sorted(spec.gammas)
        pools.append(PoolSpec(proposer, SpecConfig(proposer, gammas[(len(gammas) - 1) // 2])))
    return tuple(pools)


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    name: str
    pool: str
    url: str


class SimFleet:
    """Simulated instances of several pools, each on its own loopback port, one loop.

    Every instance is a GPU of its own (its own engine and batch): instances of a pool
    share nothing but the scenario and its clock. Use :class:`FleetThread` from
    synchronous code; ``start``/``stop`` from within a running event loop.
    """

    def __init__(
        self,
        scenario: Scenario,
        pools: Sequence[PoolSpec],
        *,
        speed: float = 1.0,
        host: str = "127.0.0.1",
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = 0.01,
        max_num_seqs: int = 256,
    ) -> None:
        for pool in pools:
            pool.config.check_against(scenario)
        self.scenario = scenario
        self.pools = tuple(pools)
        self.speed = speed
        self.host = host
        self._clock = clock
        self._tick_s = tick_s
        self._max_num_seqs = max_num_seqs
        self.instances: dict[str, SimInstance] = {}
        self.info: dict[str, InstanceInfo] = {}
        self._servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def start(self) -> None:
        epoch = self._clock()
        seeds = np.random.SeedSequence(self.scenario.seed).spawn(
            sum(p.instances for p in self.pools)
        )
        index = 0
        for pool in self.pools:
            for i in range(pool.instances):
                name = f"{pool.name}-{i}"
                instance = SimInstance(
                    self.scenario,
                    pool.config,
                    rng=np.random.default_rng(seeds[index]),
                    epoch=epoch,
                    speed=self.speed,
                    clock=self._clock,
                    tick_s=self._tick_s,
                    max_num_seqs=self._max_num_seqs,
                )
                index += 1
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((self.host, 0))
                port = sock.getsockname()[1]
                config = uvicorn.Config(
                    build_app(instance, pool=pool.name, name=name),
                    log_level="warning",
                    access_log=False,
                    lifespan="off",
                )
                server = uvicorn.Server(config)
                task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
                instance.start()
                self.instances[name] = instance
                self.info[name] = InstanceInfo(name, pool.name, f"http://{self.host}:{port}")
                self._servers.append((server, task))
        while not all(server.started for server, _ in self._servers):
            if any(task.done() for _, task in self._servers):
                raise RuntimeError("a simulated instance's HTTP server failed to start")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        for server, _ in self._servers:
            server.should_exit = True
        for instance in self.instances.values():
            await instance.stop()
        for _, task in self._servers:
            with contextlib.suppress(Exception):
                await task
        self._servers.clear()

    async def restart(
        self, name: str, config: SpecConfig | None = None, downtime_s: float = 0.0
    ) -> None:
        await self.instances[name].restart(config, downtime_s)

    def urls(self, pool: str | None = None) -> list[str]:
        return [i.url for i in self.info.values() if pool is None or i.pool == pool]


class FleetThread:
    """A :class:`SimFleet` served from a background thread's event loop.

    For synchronous callers (the CLI, tests): ``with FleetThread(...) as fleet:`` starts
    every instance and returns once all listen; leaving the block stops them.
    """

    def __init__(self, scenario: Scenario, pools: Sequence[PoolSpec], **options: Any) -> None:
        self.fleet = SimFleet(scenario, pools, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="specpilot-sim-fleet")  # fmt: skip

    def __enter__(self) -> FleetThread:
        self._thread.start()
        try:
            self.call(self.fleet.start())
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run a coroutine in the fleet's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def restart(self, name: str, config: SpecConfig | None = None, downtime_s: float = 0.0) -> None:
        self.call(self.fleet.restart(name, config, downtime_s))

    @property
    def info(self) -> dict[str, InstanceInfo]:
        return self.fleet.info

    def urls(self, pool: str | None = None) -> list[str]:
        return self.fleet.urls(pool)

    def close(self) -> None:
        if self._thread.is_alive():
            self.call(self.fleet.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()


def describe(fleet: SimFleet) -> list[dict[str, str]]:
    """Each instance's name, pool, config and URL (what the CLI prints)."""
    return [
        {"name": name, "pool": info.pool, "config": str(fleet.instances[name].config),
         "url": info.url}
        for name, info in fleet.info.items()
    ]  # fmt: skip
