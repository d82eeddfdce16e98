"""specpilot's own traces, exported over OTLP/HTTP to a receiver on loopback that decodes
what arrives (protobuf ``ExportTraceServiceRequest``): a span per gateway request with
GenAI and ``specpilot.*`` attributes, per loop iteration and per push; none unless the
``OTEL_*`` variables ask for them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from controller.actuators.managed import CanarySettings, ManagedActuator, ManagedSettings
from controller.gateway.app import Gateway
from controller.gateway.classify import RequestKeys
from controller.gateway.routing import Fleet, Pool
from controller.runtime import assemble
from controller.service import build_service
from controller.tracing import Tracing, TracingConfigError, traces_exporter
from tests.actuators.fakes import FakeClock, FakeLauncher
from tests.controller.conftest import make_settings
from tests.controller.fakes import QueueSource, ScriptedPolicy
from tests.gateway.conftest import LoopThread, RunningGateway
from tests.gateway.test_gateway_fakes import STREAM_BODY, start_replay


class OtlpReceiver:
    """Accepts ``POST /v1/traces`` (OTLP/HTTP protobuf) and keeps the decoded spans."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.resources: list[dict[str, Any]] = []
        self.content_types: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.content_types.append(self.headers["content-type"])
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    receiver.resources.append(attributes(resource_spans.resource.attributes))
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def named(self, prefix: str) -> list[Span]:
        return [s for s in self.spans if s.name.startswith(prefix)]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in pairs}


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "specpilot-test")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    yield receiver
    receiver.stop()


@pytest.fixture
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_TRACES_EXPORTER",
        "OTEL_SDK_DISABLED",
    ):
        monkeypatch.delenv(name, raising=False)


def test_which_exporter_the_environment_asks_for() -> None:
    assert traces_exporter({}) is None
    assert traces_exporter({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == "otlp"
    assert traces_exporter({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/x"}) == "otlp"
    assert traces_exporter({"OTEL_TRACES_EXPORTER": "console"}) == "console"
    endpoint_but_none = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_TRACES_EXPORTER": "none"}
    assert traces_exporter(endpoint_but_none) is None
    disabled = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_SDK_DISABLED": "true"}
    assert traces_exporter(disabled) is None
    with pytest.raises(TracingConfigError, match="zipkin"):
        traces_exporter({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_an_exporter_specpilot_lacks_is_logged_and_traces_stay_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert Tracing.from_env({"OTEL_TRACES_EXPORTER": "otlp,zipkin"}) is None
    assert "no traces: OTEL_TRACES_EXPORTER='otlp,zipkin'" in caplog.text


def test_assemble_traces_only_when_the_environment_asks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_otel_env: None
) -> None:
    runtime = assemble(make_settings(tmp_path / "off"))
    try:
        assert runtime.tracing is None and runtime.service.loop.tracer is None
    finally:
        runtime.close()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    runtime = assemble(make_settings(tmp_path / "on"))
    try:
        assert runtime.tracing is not None
        assert runtime.service.loop.tracer is runtime.tracing.tracer
    finally:
        runtime.close()
    assert runtime.tracing is None  # shut down (flushed) by close


def test_a_gateway_request_is_a_genai_span(
    receiver: OtlpReceiver,
    loop_thread: LoopThread,
    run_gateway: Callable[[Gateway], RunningGateway],
) -> None:
    tracing = Tracing.from_env()
    assert tracing is not None
    try:
        _, url = start_replay(loop_thread)
        fleet = Fleet([Pool("ngram", "ngram:4", [url])], clock=FakeClock())
        keys = RequestKeys(["code", "chat"], models=["tiny-llama"])
        gateway = run_gateway(Gateway(fleet, classifier=keys, tracer=tracing.tracer))
        body = {**STREAM_BODY, "max_tokens": 12, "temperature": 0.0}
        with httpx.Client(timeout=30.0) as client:
            response = client.post(
                f"{gateway.base_url}/v1/completions",
                json=body,
                headers={"x-workload-class": "code"},
            )
            assert response.status_code == 200
            missing = client.post(f"{gateway.base_url}/v1/completions", json={"model": "nope"})
            assert missing.status_code == 404
        (observation,) = gateway.wait_observations(1)
    finally:
        tracing.shutdown()  # flushes the batch processor

    assert receiver.content_types[0] == "application/x-protobuf"
    assert receiver.resources[0]["service.name"] == "specpilot-test"
    served, refused = receiver.spans
    assert served.name == "text_completion tiny-llama" and served.kind == Span.SPAN_KIND_SERVER
    got = attributes(served.attributes)
    assert got["gen_ai.operation.name"] == "text_completion"
    assert got["gen_ai.request.model"] == "tiny-llama"
    assert got["gen_ai.request.max_tokens"] == 12
    assert got["gen_ai.request.temperature"] == 0.0
    assert got["gen_ai.usage.input_tokens"] == observation.prompt_tokens
    assert got["gen_ai.usage.output_tokens"] == observation.output_tokens
    assert observation.output_tokens is not None and observation.output_tokens > 1
    assert got["gen_ai.server.time_per_output_token"] == pytest.approx(observation.tpot_s)
    assert got["gen_ai.server.time_to_first_token"] == pytest.approx(observation.ttft_s)
    assert observation.spec is not None
    assert got["specpilot.spec_decode.acceptance_rate"] == pytest.approx(
        observation.spec.acceptance_rate
    )
    assert got["specpilot.arm"] == "ngram:4" and got["specpilot.pool"] == "ngram"
    assert got["specpilot.workload_class"] == "code" and got["specpilot.stream"] is True
    # The span places the request where the observation does: the count that set its bucket.
    assert (got["specpilot.concurrency"], got["specpilot.bucket"]) == (observation.concurrency, "1")
    assert got["http.response.status_code"] == 200 and got["server.port"] == int(url[-5:])
    assert served.status.code != served.status.STATUS_CODE_ERROR

    assert refused.status.code == refused.status.STATUS_CODE_ERROR
    refused_attributes = attributes(refused.attributes)
    assert refused_attributes["http.response.status_code"] == 404
    assert refused_attributes["error.type"] == "NotFoundError"


def test_loop_ticks_and_pushes_are_spans(tmp_path: Path, receiver: OtlpReceiver) -> None:
    tracing = Tracing.from_env()
    assert tracing is not None
    settings = make_settings(tmp_path)
    launcher = FakeLauncher(FakeClock(), behaviour={"ngram": {"diverge_at": 4}})
    managed = ManagedActuator(
        launcher,
        settings=ManagedSettings(
            switch_grace_s=0.0, canary=CanarySettings(requests=1, max_slowdown=None)
        ),
        in_flight=launcher.in_flight,
        timer=launcher.clock,
        transport=launcher.transport(),
    )
    policy = ScriptedPolicy(settings.buckets)
    service = build_service(settings, policy, QueueSource(), actuators=[managed])
    service.loop.tracer = tracing.tracer
    try:

        async def scenario() -> None:
            await service.loop.start()
            await service.loop.tick()  # pushes off: the reference
            for context in service.fleet.contexts:
                if context.workload_class == "code":
                    policy.script[context] = "ngram:3"
            await service.loop.tick()  # pushes n-gram: not exact, rolled back

        asyncio.run(scenario())
    finally:
        service.close()
    tracing.shutdown()

    ticks = receiver.named("specpilot.loop.tick")
    assert len(ticks) == 2
    assert all(attributes(t.attributes)["specpilot.leader"] is True for t in ticks)
    assert attributes(ticks[1].attributes)["specpilot.decisions"] >= 1
    pushes = receiver.named("specpilot.push")
    assert [attributes(p.attributes)["specpilot.pools"] for p in pushes] == [["p"], ["p"]]
    assert '"method":"ngram"' in attributes(pushes[1].attributes)["specpilot.configs"][0]
    assert [attributes(p.attributes)["specpilot.failed"] for p in pushes] == [False, True]
    for push, tick in zip(pushes, ticks, strict=True):
        assert push.parent_span_id == tick.span_id and push.trace_id == tick.trace_id
    acts = receiver.named("specpilot.actuate managed")
    assert [a.parent_span_id for a in acts] == [p.span_id for p in pushes]
    outcomes = [
        attributes(e.attributes)["specpilot.exactness.outcome"]
        for a in acts
        for e in a.events
        if e.name == "specpilot.exactness"
    ]
    assert outcomes == ["reference", "broken"]
    assert acts[1].status.code == acts[1].status.STATUS_CODE_ERROR
    assert any(e.name == "exception" for e in acts[1].events)
