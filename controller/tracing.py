"""specpilot's own OpenTelemetry traces, configured by the standard ``OTEL_*`` variables.

Off unless the environment asks for traces: ``OTEL_TRACES_EXPORTER`` (``otlp`` or
``console``; ``none`` is off) or an OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) turns them on; ``OTEL_SDK_DISABLED=true`` turns
them off whatever else is set. Off means no tracer at all: the gateway and the loop hold
``None`` and skip every span call, so an untraced gateway runs the code it ran before.

On, the SDK reads the rest itself: ``OTEL_SERVICE_NAME`` (default here ``specpilot``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER[_ARG]``, ``OTEL_BSP_*`` (the batch
processor) and the OTLP exporter's ``OTEL_EXPORTER_OTLP[_TRACES]_{ENDPOINT, HEADERS,
TIMEOUT, COMPRESSION, CERTIFICATE}``. The exporter speaks OTLP over HTTP with protobuf
(``http/protobuf``); ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` is not shipped and is logged
and served as ``http/protobuf`` (point it at the collector's HTTP port, 4318).

Spans (names and attributes are documented in controller/README.md): one per gateway
inference request (``{gen_ai.operation.name} {gen_ai.request.model}``, GenAI semantic
conventions plus ``specpilot.*``), one per loop iteration (``specpilot.loop.tick``) and
one per push (``specpilot.push``, a child per actuator). The provider is built per
``Runtime`` and never registered globally (as metrics take a registry, traces take a
tracer).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

INSTRUMENTATION = "specpilot"
DEFAULT_SERVICE_NAME = "specpilot"
_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


class TracingConfigError(ValueError):
    """The ``OTEL_*`` variables ask for something specpilot cannot export."""


def traces_exporter(environ: Mapping[str, str]) -> str | None:
    """The exporter the environment asks for (``otlp``, ``console``), None for none."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [
        n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()
    ]
    if not names:
        return "otlp" if any(environ.get(k, "").strip() for k in _ENDPOINTS) else None
    if names == ["none"]:
        return None
    unknown = [n for n in names if n not in ("otlp", "console")]
    if unknown or len(names) > 1:
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER={environ['OTEL_TRACES_EXPORTER']!r}: "
            "specpilot exports one of otlp, console or none"
        )
    return names[0]


@dataclass
class Tracing:
    """The tracer the service's parts share, and the provider to flush at shutdown."""

    provider: TracerProvider
    tracer: Tracer

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Tracing | None:
        """Tracing as the ``OTEL_*`` variables configure it; None when they ask for none."""
        env = os.environ if environ is None else environ
        try:
            name = traces_exporter(env)
        except TracingConfigError as exc:
            log.error("no traces: %s", exc)  # the service runs; its traces are missing
            return None
        if name is None:
            return None
        exporter: SpanExporter
        if name == "console":
            exporter = ConsoleSpanExporter()
        else:
            protocol = (
                env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf"
            )
            if protocol.strip() != "http/protobuf":
                log.warning(
                    "OTLP protocol %r is not shipped with specpilot: exporting http/protobuf",
                    protocol,
                )
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # endpoint, headers, timeout: from the OTEL_* env
        service = env.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME
        provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider, provider.get_tracer(INSTRUMENTATION))

    def shutdown(self) -> None:
        """Export what is buffered and stop (``Runtime.stop``)."""
        self.provider.shutdown()
