"""specpilot's settings: one YAML file plus ``SPECPILOT_*`` environment overrides.

Environment variables win over the file; nested keys use ``__``
(``SPECPILOT_STORE__URL``, ``SPECPILOT_FLEET__POOLS__CHAT__MODEL``), and
``SPECPILOT_API_TOKEN`` sets the read-write API token. Everything is validated when
loaded: ``load_settings`` raises ``SettingsError`` with one line per problem, each
naming the key (``fleet.pools.chat.proposers.ngram.gamma: ...``). Times are seconds.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import (
    AfterValidator,
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from controller.contexts import bucket_labels
from controller.exactness import DEFAULT_INTERVAL_S as EXACTNESS_INTERVAL_S
from controller.exactness import DEFAULT_MAX_TOKENS as EXACTNESS_MAX_TOKENS
from controller.exactness import DEFAULT_PROMPTS as EXACTNESS_PROMPTS
from controller.gateway.classify import BUILTIN_CLASSIFIER
from controller.gateway.server import GatewayLimits
from controller.gateway.upstream import UpstreamTimeouts
from controller.specconfig import (
    MAX_SPECULATIVE_TOKENS,
    VLLM_METHODS,
    Proposer,
    SpecConfigError,
    check_vllm_schema,
    resolve_on_pool,
)
from controller.urls import instance_url_problem, redact_url

ENV_PREFIX = "SPECPILOT_"
TOKEN_ENV = "SPECPILOT_API_TOKEN"
# Durations are finite: YAML's .inf parses as a float, and an infinite interval is a
# loop that never runs again while everything says it is fine.
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
STORE_BACKENDS = ("sqlite", "postgresql")
"""The databases the store's migrations and queries are written and tested for."""


def _http_url(value: str) -> str:
    _URL.validate_python(value)  # raises with the reason; the text itself is kept as is
    return value


_URL: TypeAdapter[AnyHttpUrl] = TypeAdapter(AnyHttpUrl)
InstanceUrl = Annotated[str, AfterValidator(_http_url)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProposerSettings(_Strict):
    """One way a pool can draft. ``tuning`` holds the other vLLM keys it runs with."""

    method: str
    model: str | None = None
    gamma: tuple[int, int] = (1, 5)
    """Inclusive range of γ (num_speculative_tokens) the policy may choose."""
    tuning: dict[str, Any] = Field(default_factory=dict)

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        if method not in VLLM_METHODS:
            raise ValueError(
                f"unknown method {method!r} (known: {', '.join(sorted(VLLM_METHODS))})"
            )
        return method

    @field_validator("gamma")
    @classmethod
    def _gamma_range(cls, gamma: tuple[int, int]) -> tuple[int, int]:
        if not 1 <= gamma[0] <= gamma[1]:
            raise ValueError(f"need 1 <= min <= max, got {list(gamma)}")
        if gamma[1] > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"max {gamma[1]} is more than vLLM verifies per step ({MAX_SPECULATIVE_TOKENS})"
            )
        return gamma

    @model_validator(mode="after")
    def _valid_for_vllm(self) -> Self:
        overlap = set(self.tuning) & {"method", "model", "num_speculative_tokens"}
        if overlap:
            raise ValueError(f"tuning cannot set {sorted(overlap)}: they are fields here")
        try:
            check_vllm_schema(self.as_proposer("_").config(self.gamma[1]))
        except SpecConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    def as_proposer(self, name: str) -> Proposer:
        return Proposer(
            name=name,
            method=self.method,
            gamma_min=self.gamma[0],
            gamma_max=self.gamma[1],
            model=self.model,
            tuning=tuple(sorted(self.tuning.items())),
        )


def _name(kind: str, name: str) -> str:
    """A class or pool name: it is matched as written (a header's value is stripped)."""
    if not name or name != name.strip():
        raise ValueError(f"{kind} name {name!r} must be non-empty without surrounding spaces")
    return name


class PoolSettings(_Strict):
    """A set of vLLM instances serving one model with one ``--speculative-config``."""

    model: str = Field(min_length=1)
    instances: list[InstanceUrl] = Field(default_factory=list)
    """Base URLs of the vLLM servers, kept as written (they name the instances). At
    least one, except for a managed pool (``actuators.managed``), whose instances are
    the ones specpilot starts."""
    speculative_config: dict[str, Any] = Field(default_factory=lambda: {"method": "off"})
    """The config the instances run now (``{"method": "off"}``: no speculation)."""
    proposers: dict[str, ProposerSettings] = Field(default_factory=dict)
    classes: list[str] | None = None
    """Workload classes this pool serves, the first being the one whose decisions set its
    config (one config per pool; routing by class is the gateway's job). None: all."""
    max_num_seqs: int = Field(default=256, ge=1)
    """vLLM's batch-size cap, the upper end of the open concurrency bucket."""

    @field_validator("proposers")
    @classmethod
    def _proposer_names(cls, proposers: dict[str, ProposerSettings]) -> dict[str, Any]:
        for name in proposers:
            if not name or ":" in name or name == "off":
                raise ValueError(f"invalid proposer name {name!r} (no ':', not 'off')")
        return proposers

    @field_validator("classes")
    @classmethod
    def _class_names(cls, classes: list[str] | None) -> list[str] | None:
        for name in classes or ():
            _name("class", name)
        if classes is not None and len(set(classes)) != len(classes):
            raise ValueError(f"classes must be distinct: {classes}")
        return classes

    def proposer_list(self) -> tuple[Proposer, ...]:
        return tuple(spec.as_proposer(name) for name, spec in sorted(self.proposers.items()))


class FleetSettings(_Strict):
    pools: dict[str, PoolSettings] = Field(min_length=1)

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, pools: dict[str, PoolSettings]) -> dict[str, PoolSettings]:
        for name in pools:
            _name("pool", name)
        return pools

    @model_validator(mode="after")
    def _running_configs_runnable(self) -> Self:
        for name, pool in self.pools.items():
            try:
                resolve_on_pool(pool.speculative_config, name, pool.proposer_list(), pinnable=False)
            except SpecConfigError as exc:
                raise ValueError(f"@pools.{name}.speculative_config: {exc}") from None
        return self


class StoreSettings(_Strict):
    url: str | None = None
    """SQLAlchemy URL, ``sqlite:///PATH`` or ``postgresql+psycopg://...``; None: SQLite
    file ``specpilot.db`` in the data directory."""
    observation_retention_s: PositiveSeconds = 24 * 3600.0
    """Raw per-request observations older than this are rolled up, then deleted."""
    rollup_period_s: PositiveSeconds = 3600.0
    write_buffer_max: int = Field(default=10_000, ge=1)
    """Records held in memory while the database is unreachable; oldest observations go first."""
    snapshot_interval_s: Seconds = 0.0
    """How often the learned policy state is saved; 0: every loop interval, so a crash
    loses at most one interval of learning. Always saved on shutdown."""

    @field_validator("url")
    @classmethod
    def _supported(cls, url: str | None) -> str | None:
        if url is not None:
            _check_store_url(url)
        return url


def _check_store_url(url: str) -> None:
    """A database the store supports, with its driver installed (``serve`` would fail on
    either at start)."""
    from sqlalchemy.engine import make_url  # loads only when a URL is configured
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ValueError(f"not a database URL: {redact_url(url)!r}") from None
    backend = parsed.get_backend_name()
    if backend not in STORE_BACKENDS:
        raise ValueError(
            f"unsupported database {backend!r} (supported: {', '.join(STORE_BACKENDS)}; "
            "e.g. postgresql+psycopg://USER@HOST/DB)"
        )
    try:
        parsed.get_dialect().import_dbapi()
    except (ImportError, NoSuchModuleError) as exc:
        raise ValueError(
            f"driver {parsed.drivername!r} is not installed ({exc}); "
            "PostgreSQL is postgresql+psycopg:// (psycopg 3)"
        ) from None


class ApiSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    token: SecretStr | None = None
    """Read-write bearer token; none configured means every write is refused."""
    read_only_tokens: list[SecretStr] = Field(default_factory=list)


class PolicySettings(_Strict):
    name: str = "bandit"
    min_dwell_s: Seconds = 60.0
    """Guard rail: a context's arm changes at most once per this many seconds."""
    measure_after_s: Seconds = 60.0
    """Time under a new arm before its speed-up is measured against the previous one."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Passed to the policy as is (exploration, priors, ...)."""


class WiringSettings(_Strict):
    """Where the policy and the collectors come from: ``"package.module:factory"``, a
    callable taking the ``Settings``. None: the built-ins of ``controller.builtin``."""

    policy: str | None = None
    collector: str | None = None

    @field_validator("policy", "collector")
    @classmethod
    def _import_path(cls, value: str | None) -> str | None:
        return _import_path(value)


def _import_path(value: str | None) -> str | None:
    if value is not None:
        module, sep, attr = value.partition(":")
        if not sep or not module or not attr.isidentifier():
            raise ValueError(f"expected 'package.module:factory', got {value!r}")
    return value


class LeaderSettings(_Strict):
    check_interval_s: PositiveSeconds = 1.0
    """How often a follower tries to become leader and the leader checks its lock."""


class WebhookSettings(_Strict):
    """POST each changed pool's config here (JSON, ``Idempotency-Key`` header)."""

    url: InstanceUrl
    headers: dict[str, str] = Field(default_factory=dict)
    attempts: int = Field(default=5, ge=1)
    timeout_s: PositiveSeconds = 10.0


class AlertingSettings(_Strict):
    """Where specpilot's own alerts (``/v1/alerts``: failed pushes, overrides that cannot
    run, ...) are sent besides the store (``controller.notify``)."""

    alertmanager_url: InstanceUrl | None = None
    """Alertmanager's base URL: alerts go to its v2 API (``/api/v2/alerts``), re-sent
    while firing, with ``endsAt`` once resolved."""
    webhook_url: InstanceUrl | None = None
    """A generic webhook: one POST when an alert fires and one when it resolves, in
    Alertmanager's webhook format."""
    webhook_headers: dict[str, str] = Field(default_factory=dict)
    """Sent with every webhook request (e.g. an ``Authorization`` header)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Added to every alert's labels (e.g. ``cluster``, ``team``) for routing."""
    resend_interval_s: PositiveSeconds = 60.0
    """How often firing alerts are sent to Alertmanager again."""
    resolve_after_s: PositiveSeconds = 900.0
    """An alert specpilot has not raised again for this long is sent as resolved (its
    conditions, such as a failed push, are raised again each iteration they hold)."""
    instance_down_after_s: PositiveSeconds | None = None
    """``SpecpilotInstanceDown`` fires once a pool instance has failed every probe (or
    served another model) for this long (``controller.instances``); None: three loop
    intervals."""
    attempts: int = Field(default=3, ge=1)
    """Tries per delivery, the first included (back-off with jitter in between)."""
    timeout_s: PositiveSeconds = 5.0
    """Per attempt."""


class DeploymentSettings(_Strict):
    namespace: str = "default"
    deployment: str
    container: str


class KubernetesSettings(_Strict):
    """Patch each pool's Deployment so its container runs the new ``--speculative-config``."""

    deployments: dict[str, DeploymentSettings] = Field(min_length=1)
    """Pool name → the Deployment that runs it."""
    patch_type: Literal["json", "strategic-merge"] = "json"


DEFAULT_CANARY_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
LAUNCHER_FLAGS = ("--host", "--port")
"""Flags a launch adds itself (a free port on the configured host)."""


class ManagedCanarySettings(_Strict):
    """Completions a new managed instance must answer before it takes traffic (the
    defaults are ``controller.actuators.managed.CanarySettings``'s)."""

    requests: int = Field(default=3, ge=1)
    prompt: str = Field(default=DEFAULT_CANARY_PROMPT, min_length=1)
    max_tokens: int = Field(default=16, ge=1)
    timeout_s: PositiveSeconds = 60.0
    max_slowdown: float | None = Field(default=0.25, ge=0, allow_inf_nan=False)
    """Roll back if the new instance's median canary latency exceeds the old one's by
    more than this fraction (0.25: 25 % slower); null: do not compare."""
    exactness: bool = True
    """The exactness canary (``controller.exactness``): greedy output of a speculating
    instance must match the pool's no-speculation output token for token, after every
    push (a mismatch rolls the push back) and every ``interval_s``; a mismatch raises
    the critical alert ``ExactnessBroken``."""
    exactness_prompts: tuple[str, ...] = Field(default=EXACTNESS_PROMPTS, min_length=1)
    exactness_max_tokens: int = Field(default=EXACTNESS_MAX_TOKENS, ge=1, le=4096)
    interval_s: PositiveSeconds | None = EXACTNESS_INTERVAL_S
    """Seconds between exactness checks of each running speculating instance; null:
    only after pushes."""

    @field_validator("exactness_prompts")
    @classmethod
    def _prompts_not_blank(cls, prompts: tuple[str, ...]) -> tuple[str, ...]:
        if any(not p.strip() for p in prompts):
            raise ValueError("every exactness prompt needs text")
        return prompts


class LaunchSettings(_Strict):
    """How one managed pool's vLLM is started: a ``command`` (run by specpilot's
    ``CommandLauncher``) or a ``launcher`` factory, exactly one of them."""

    command: list[str] | None = Field(default=None, min_length=1)
    """The serving command without ``--host``, ``--port`` or ``--speculative-config``
    (``[vllm, serve, /models/llama, --served-model-name, llama]``)."""
    served_model: str | None = None
    """The model name the server answers to; None: the pool's ``model``."""
    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=1, le=65535)
    """The port vLLM listens on; None: a free one at each launch. A pod's Service
    targets a fixed port, so the per-pod topology sets it (``mode: in_place`` only: the
    old instance has let go of the port before the new one binds it)."""
    environment: dict[str, str] = Field(default_factory=dict)
    """Added to specpilot's environment for the process (``CUDA_VISIBLE_DEVICES``, ...)."""
    log_dir: Path | None = None
    """Where each instance's output goes; None: ``<data_dir>/vllm-logs``."""
    launcher: str | None = None
    """``"package.module:factory"``, called with ``(settings, pool name)``, returning a
    ``controller.actuators.managed.Launcher``: for launchers other than a command."""

    @field_validator("command")
    @classmethod
    def _no_launcher_flags(cls, command: list[str] | None) -> list[str] | None:
        for flag in LAUNCHER_FLAGS:
            if command and any(arg == flag or arg.startswith(f"{flag}=") for arg in command):
                raise ValueError(f"leave out {flag}: each launch picks it (host: the 'host' key)")
        return command

    @field_validator("launcher")
    @classmethod
    def _launcher_path(cls, value: str | None) -> str | None:
        return _import_path(value)

    @model_validator(mode="after")
    def _one_way_to_start(self) -> Self:
        if (self.command is None) == (self.launcher is None):
            raise ValueError("give exactly one of 'command' and 'launcher'")
        return self


class PodSettings(_Strict):
    """The per-pod sidecar topology: this replica runs in a vLLM pod and supervises that
    pod's one vLLM of ``pool``; the replicas of a pool share the store, the leader
    decides, and every replica restarts its own vLLM, ``max_unavailable`` at a time."""

    pool: str | None = None
    """Which of ``actuators.managed.pools`` this pod runs; None: the only one there."""
    replica: str | None = None
    """This replica's name in the restart leases (the pod's name, from the downward
    API); None: the host name, which is the pod's name in Kubernetes."""

    @field_validator("replica")
    @classmethod
    def _replica_name(cls, replica: str | None) -> str | None:
        return None if replica is None else _name("replica", replica)


class ManagedActuatorSettings(_Strict):
    """Pools whose vLLM processes specpilot starts, canaries, switches, drains and stops
    (``controller.actuators.managed``); each pool is moved at most once per
    ``policy.min_dwell_s``. Defaults are ``controller.actuators.managed.ManagedSettings``'s."""

    pools: dict[str, LaunchSettings] = Field(min_length=1)
    """Pool name (one of ``fleet.pools``) → how its vLLM is started."""
    mode: Literal["blue_green", "in_place"] = "blue_green"
    """``blue_green``: the new instance runs beside the old one until it has proven
    itself; ``in_place``: only one fits (memory, GPU), so the old one stops first."""
    start_timeout_s: PositiveSeconds = 300.0
    switch_grace_s: Seconds = 1.0
    """After the switch, the old instance is drained only after this many seconds."""
    drain_timeout_s: PositiveSeconds = 300.0
    """The old instance is stopped after this long even if requests remain."""
    drain_poll_s: PositiveSeconds = 0.5
    canary: ManagedCanarySettings = ManagedCanarySettings()
    pod: PodSettings | None = None
    """Set: the per-pod topology (``controller.actuators.rolling``); None: this one
    process starts every pool's vLLM."""
    max_unavailable: int = Field(default=1, ge=1)
    """Per-pod topology: replicas of one pool that may restart (drain, stop, start,
    canary) at once, each holding a lease in the store."""
    lease_ttl_s: PositiveSeconds = 30.0
    """Per-pod topology: a restart lease not renewed for this long (its replica died)
    is free again; a restarting replica renews it every third of that."""

    @model_validator(mode="after")
    def _pod_runnable(self) -> Self:
        fixed = sorted(name for name, spec in self.pools.items() if spec.port is not None)
        if fixed and self.mode != "in_place":
            raise ValueError(
                f"@pools.{fixed[0]}.port: a fixed port needs mode: in_place "
                "(blue/green runs two instances of the pool at once)"
            )
        pod = self.pod
        if pod is None:
            return self
        if pod.pool is None and len(self.pools) != 1:
            raise ValueError(
                f"@pod.pool: name the pool this pod runs (one of {sorted(self.pools)})"
            )
        if pod.pool is not None and pod.pool not in self.pools:
            raise ValueError(f"@pod.pool: {pod.pool!r} is not one of {sorted(self.pools)}")
        return self

    @property
    def pod_pool(self) -> str | None:
        """The pool whose vLLM this pod runs (per-pod topology), else None."""
        if self.pod is None:
            return None
        return self.pod.pool if self.pod.pool is not None else next(iter(self.pools))

    @property
    def replica(self) -> str:
        """This replica's name in the restart leases."""
        if self.pod is not None and self.pod.replica is not None:
            return self.pod.replica
        return socket.gethostname()


class ActuatorSettings(_Strict):
    mode: Literal["push", "routing"] = "push"
    """How decisions reach the fleet. ``push``: each pool's effective config goes to the
    actuators below (file, webhook, Kubernetes, managed). ``routing``: every pool keeps
    the config it runs and the gateway (served by ``specpilot serve``) sends each
    request to the pool that runs its context's arm; nothing is pushed."""
    file: bool = True
    """Write each pool's effective config to ``<file_dir>/<pool>.json`` (atomically)."""
    file_dir: Path | None = None
    """Where each pool's ``<pool>.json`` goes; None: ``<data_dir>/speculative-configs``."""
    webhook: WebhookSettings | None = None
    kubernetes: KubernetesSettings | None = None
    target_models: dict[str, str] = Field(default_factory=dict)
    """Pool → its target checkpoint (directory or HF id in the local cache): a draft
    model is pushed to that pool only if its tokenizer and chat template match."""
    managed: ManagedActuatorSettings | None = None
    confirm_within_s: PositiveSeconds = 300.0
    """How long a pushed config may take to show in what vLLM reports (the γ of its
    per-position series, or no spec-decode series for off) before the push counts as
    not applied (``SpecpilotPushNotApplied``). It covers the orchestrator's restart of
    vLLM: a file or webhook hands the config over and knows nothing more."""

    @model_validator(mode="after")
    def _routing_pushes_nothing(self) -> Self:
        if self.mode != "routing":
            return self
        pushers = [key for key in ("webhook", "kubernetes", "managed") if getattr(self, key)]
        if "file" in self.model_fields_set and self.file:
            pushers.insert(0, "file")
        if pushers:
            raise ValueError(
                f"@{pushers[0]}: routing mode pushes no config (pools keep theirs); "
                "remove it or use mode: push"
            )
        return self


SOURCES = ("scrape", "prometheus", "gateway")


class ScrapeSettings(_Strict):
    """``collect: scrape``: every pool instance's ``/metrics``, once per loop interval."""

    timeout_s: PositiveSeconds = 5.0
    """Whole-request budget per scrape, body included."""
    stale_after_s: PositiveSeconds | None = None
    """An instance with no successful scrape for this long is stale (``/v1/fleet``
    says so); None: three loop intervals."""
    max_page_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Larger pages are refused; a real vLLM page is well under 1 MiB."""


class PrometheusSourceSettings(_Strict):
    """``collect: prometheus``: the same figures by PromQL from the Prometheus that
    already scrapes the fleet, so that 500 workers are not scraped twice."""

    url: InstanceUrl
    """Its base URL, e.g. ``http://prometheus:9090``."""
    selector: str = ""
    """PromQL label matchers without braces that pick the fleet's series
    (``job="vllm"``); empty: every series of vLLM's metric names."""
    instance_label: str = "instance"
    """The label whose value (``host:port``) matches a pool instance's URL."""
    timeout_s: PositiveSeconds = 10.0


class CollectSettings(_Strict):
    """Where the policy's evidence comes from. Written as one name (``collect:
    scrape``), a list (``collect: [gateway, scrape]``) or this mapping."""

    sources: tuple[Literal["scrape", "prometheus", "gateway"], ...] | None = None
    """None: ``gateway`` where the gateway is served, else ``scrape``."""
    scrape: ScrapeSettings = ScrapeSettings()
    prometheus: PrometheusSourceSettings | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"sources": [value]}
        if isinstance(value, list):
            names: list[Any] = []
            out: dict[str, Any] = {}
            for item in value:
                if isinstance(item, dict) and len(item) == 1:
                    ((name, options),) = item.items()
                    names.append(name)
                    out[name] = options
                else:
                    names.append(item)
            return {**out, "sources": names}
        if isinstance(value, dict) and "sources" not in value and "prometheus" in value:
            return {**value, "sources": ["prometheus"]}
        return value

    @model_validator(mode="after")
    def _sources(self) -> Self:
        if self.sources is not None:
            if len(set(self.sources)) != len(self.sources) or not self.sources:
                raise ValueError("@sources: name each source once, at least one")
            if "prometheus" in self.sources and self.prometheus is None:
                raise ValueError("@prometheus.url: collect: prometheus needs the server's URL")
            if "scrape" in self.sources and "prometheus" in self.sources:
                raise ValueError(
                    "@sources: scrape and prometheus read the same figures; choose one"
                )
        return self


_LIMITS = GatewayLimits()
_TIMEOUTS = UpstreamTimeouts()


class GatewayLimitSettings(_Strict):
    """What one client may take of the gateway (``controller.gateway.server.GatewayLimits``,
    whose defaults these are)."""

    keep_alive_s: PositiveSeconds = _LIMITS.keep_alive_s
    """An idle client connection is closed after this."""
    header_timeout_s: PositiveSeconds = _LIMITS.header_timeout_s
    """A request's headers must arrive within this of its first byte: else 408."""
    body_timeout_s: PositiveSeconds = _LIMITS.body_timeout_s
    """Its body within this of its headers: else 408."""
    max_url_bytes: int = Field(default=_LIMITS.max_url_bytes, ge=64)
    """Longer request targets get 414."""
    max_header_bytes: int = Field(default=_LIMITS.max_header_bytes, ge=1024)
    """Larger header blocks get 431."""
    max_body_bytes: int = Field(default=_LIMITS.max_body_bytes, ge=1024)
    """Larger bodies get 413 (before they are read when ``content-length`` says so)."""
    max_connections: int = Field(default=_LIMITS.max_connections, ge=1)
    """Client connections at once; a new one past it gets 503 and is closed."""

    def limits(self) -> GatewayLimits:
        return GatewayLimits(**self.model_dump())


class UpstreamTimeoutSettings(_Strict):
    """How long the gateway waits on a vLLM instance (``controller.gateway.upstream.
    UpstreamTimeouts``, whose defaults these are). Each one passed fails the attempt:
    before the client saw a byte it is retried on another instance, after it the response
    ends unfinished; either way it counts toward ejecting the instance."""

    connect_s: PositiveSeconds = _TIMEOUTS.connect_s
    first_byte_s: PositiveSeconds = _TIMEOUTS.first_byte_s
    """From the request sent to the response's first byte: a non-streaming completion
    sends nothing until it is fully generated."""
    between_chunks_s: PositiveSeconds = _TIMEOUTS.between_chunks_s
    """Between two reads of a response."""

    def timeouts(self) -> UpstreamTimeouts:
        return UpstreamTimeouts(**self.model_dump())


class GatewaySettings(_Strict):
    """The OpenAI-compatible gateway ``specpilot serve`` runs beside the API, in worker
    processes of its own (``controller.gateway.workers``), feeding every request's
    measurements to the loop."""

    enabled: bool | None = None
    """None: served in routing mode only. In push mode ``true`` serves it in front of
    managed pools (every pool must be one): each request goes to the pool serving its
    class, and a pool's traffic follows its new instance."""
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    classifier: str | None = None
    """Classifies requests without an ``X-Workload-Class`` header: a model file from
    ``specpilot classify train``, or ``builtin`` (the shipped model). None: every such
    request is in ``default_class``."""
    default_class: str | None = None
    """Class of an unclassified request (and of a predicted class the settings do not
    list); None: the first of ``classes``."""
    workers: int | None = Field(default=None, ge=1, le=256)
    """Gateway worker processes, all serving ``port``; None: one per core this process
    may run on."""
    limits: GatewayLimitSettings = GatewayLimitSettings()
    upstream_timeouts: UpstreamTimeoutSettings = UpstreamTimeoutSettings()


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True
    )

    data_dir: Path = Path("specpilot-data")
    fleet: FleetSettings
    store: StoreSettings = StoreSettings()
    api: ApiSettings = ApiSettings()
    scrape_interval_s: PositiveSeconds = 15.0
    policy: PolicySettings = PolicySettings()
    leader: LeaderSettings = LeaderSettings()
    actuators: ActuatorSettings = ActuatorSettings()
    gateway: GatewaySettings = GatewaySettings()
    alerting: AlertingSettings = AlertingSettings()
    wiring: WiringSettings = WiringSettings()
    collect: CollectSettings = CollectSettings()
    buckets: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    """Inclusive lower edges of the concurrency buckets, starting at 1."""
    classes: list[str] = Field(default_factory=lambda: ["code", "chat", "rag", "creative"])

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file arrives as init values; the environment must win over it.
        return env_settings, init_settings

    @field_validator("buckets")
    @classmethod
    def _edges(cls, edges: list[int]) -> list[int]:
        if not edges or edges[0] != 1:
            raise ValueError("bucket edges must start at 1")
        if any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(f"bucket edges must increase strictly: {edges}")
        return edges

    @field_validator("classes")
    @classmethod
    def _classes(cls, classes: list[str]) -> list[str]:
        if not classes or len(set(classes)) != len(classes) or "*" in classes:
            raise ValueError("need one or more distinct class names ('*' is reserved)")
        for name in classes:
            _name("class", name)
        return classes

    @model_validator(mode="after")
    def _pool_classes_known(self) -> Self:
        for name, pool in self.fleet.pools.items():
            unknown = set(pool.classes or ()) - set(self.classes)
            if unknown:
                raise ValueError(f"@fleet.pools.{name}.classes: unknown classes {sorted(unknown)}")
        return self

    @model_validator(mode="after")
    def _modes_runnable(self) -> Self:
        managed = self.actuators.managed
        started = set(managed.pools) if managed is not None else set()
        unknown = sorted(started - set(self.fleet.pools))
        if unknown:
            raise ValueError(f"@actuators.managed.pools: unknown pools {unknown}")
        for name, pool in sorted(self.fleet.pools.items()):
            if name in started and pool.instances:
                raise ValueError(
                    f"@fleet.pools.{name}.instances: a managed pool runs the instances "
                    "specpilot starts; leave it out"
                )
            if name not in started and not pool.instances:
                raise ValueError(
                    f"@fleet.pools.{name}.instances: List should have at least 1 item "
                    "(or start the pool with actuators.managed)"
                )
        if managed is not None and managed.pod is not None:
            _check_per_pod(self)
        gateway = self.gateway
        if self.actuators.mode == "routing":
            if gateway.enabled is False:
                raise ValueError("@gateway.enabled: routing mode routes through the gateway")
            if self.wiring.policy is not None:
                raise ValueError(
                    "@wiring.policy: routing mode asks specpilot's bandit per request (leave unset)"
                )
            _check_routable(self.fleet)
        unseen = sorted(set(self.fleet.pools) - started)
        if self.actuators.mode == "push" and gateway.enabled and unseen:
            raise ValueError(
                "@gateway.enabled: in push mode the gateway can serve managed pools only "
                f"(it must know what config serves each request), not {unseen}"
            )
        if self.serves_gateway and self.wiring.collector is not None:
            raise ValueError(
                "@wiring.collector: the gateway is the observation source when it is served"
            )
        sources = self.collect.sources
        if sources is not None:
            if "gateway" in sources and not self.serves_gateway:
                raise ValueError(
                    "@collect.sources: gateway: the gateway is not served "
                    "(routing mode, or gateway.enabled: true)"
                )
            if self.serves_gateway and "gateway" not in sources:
                raise ValueError(
                    "@collect.sources: the gateway is served; list gateway too, or what it "
                    "relays would teach the policy nothing"
                )
        if self.serves_gateway:
            _check_gateway_reaches(self.fleet)
            _check_ports(self.api, gateway)
        if gateway.default_class is not None and gateway.default_class not in self.classes:
            raise ValueError(f"@gateway.default_class: {gateway.default_class!r} is not in classes")
        if gateway.classifier is not None and gateway.classifier != BUILTIN_CLASSIFIER:
            try:
                _check_classifier(Path(gateway.classifier), self.classes)
            except ValueError as exc:
                raise ValueError(f"@gateway.classifier: {exc}") from None
        return self

    @property
    def serves_gateway(self) -> bool:
        """Whether ``specpilot serve`` runs the gateway (always in routing mode)."""
        enabled = self.gateway.enabled
        return self.actuators.mode == "routing" if enabled is None else enabled

    @property
    def sources(self) -> tuple[str, ...]:
        """The observation sources in force (``collect.sources`` or its default)."""
        if self.collect.sources is not None:
            return tuple(self.collect.sources)
        return ("gateway",) if self.serves_gateway else ("scrape",)

    @property
    def store_url(self) -> str:
        return self.store.url or f"sqlite:///{(self.data_dir / 'specpilot.db').resolve()}"

    @property
    def actuator_dir(self) -> Path:
        return self.actuators.file_dir or self.data_dir / "speculative-configs"

    @property
    def bucket_labels(self) -> tuple[str, ...]:
        return bucket_labels(self.buckets)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(sorted({pool.model for pool in self.fleet.pools.values()}))


def _check_per_pod(settings: Settings) -> None:
    """Per-pod topology: each replica sees only its own pod's vLLM, so every pool runs
    in pods (no instance list every replica would scrape alike) and the evidence is
    what each replica scrapes or relays itself, handed to the leader."""
    static = sorted(name for name, pool in settings.fleet.pools.items() if pool.instances)
    if static:
        raise ValueError(
            f"@fleet.pools.{static[0]}.instances: in the per-pod topology every pool's "
            "vLLM runs beside a replica (actuators.managed.pools)"
        )
    if "prometheus" in settings.sources:
        raise ValueError(
            "@collect.sources: prometheus: per-pod replicas scrape their own vLLM on "
            "localhost (collect: scrape)"
        )


def _check_gateway_reaches(fleet: FleetSettings) -> None:
    """Every instance URL is one the gateway's upstream client can send requests to."""
    for name, pool in sorted(fleet.pools.items()):
        for index, url in enumerate(pool.instances):
            problem = instance_url_problem(url)
            if problem is not None:
                raise ValueError(
                    f"@fleet.pools.{name}.instances.{index}: {redact_url(url)}: {problem}"
                )


_ANY_HOST = frozenset({"", "0.0.0.0", "::"})
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def _check_ports(api: ApiSettings, gateway: GatewaySettings) -> None:
    """The API and the gateway cannot listen on one port of one address."""
    if api.port == 0 or api.port != gateway.port:
        return
    hosts = {api.host, gateway.host}
    if len(hosts) == 1 or hosts & _ANY_HOST or hosts <= _LOOPBACK:
        raise ValueError(
            f"@gateway.port: {gateway.port} is api.port too (on {api.host} and "
            f"{gateway.host}); give them different ports"
        )


def _check_routable(fleet: FleetSettings) -> None:
    """Routing mode: each pool is one arm, one pool per arm, and one runs without speculation."""
    by_arm: dict[str, str] = {}
    for name, pool in sorted(fleet.pools.items()):
        arm = resolve_on_pool(pool.speculative_config, name, pool.proposer_list(), pinnable=False)
        if arm in by_arm:
            raise ValueError(
                f"@fleet.pools.{name}.speculative_config: routing mode needs one pool per "
                f"config, and pool {by_arm[arm]!r} runs {arm} too"
            )
        by_arm[arm] = name
    if "off" not in by_arm:
        raise ValueError(
            "@fleet.pools: routing mode needs a pool without speculation "
            '(speculative_config: {method: "off"})'
        )


def _check_classifier(path: Path, classes: list[str]) -> None:
    """The model file parses and predicts only classes the settings list (no training)."""
    from policies.classifier import loads_recipe  # scikit-learn loads only when configured

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    recipe = loads_recipe(text, str(path))
    predicted = {example.workload_class for example in recipe.examples}
    unknown = sorted(predicted - set(classes))
    if unknown:
        raise ValueError(f"{path} predicts classes not in classes: {unknown}")


class SettingsError(Exception):
    """Settings that cannot be used; ``problems`` has one line per error, naming the key;
    ``errors`` the same as (key, problem) pairs, key None for the file as a whole."""

    def __init__(
        self, problems: list[str], errors: list[tuple[str | None, str]] | None = None
    ) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems
        self.errors: list[tuple[str | None, str]] = (
            errors if errors is not None else [(None, line) for line in problems]
        )


def _key(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def keyed_errors(error: ValidationError) -> list[tuple[str, str]]:
    """One (``key.path``, problem) per error. A cross-field validator names the key it is
    about with a leading ``@sub.key: `` (relative to where it runs)."""
    items = []
    for item in error.errors():
        key, message = _key(item["loc"]), item["msg"].removeprefix("Value error, ")
        if message.startswith("@"):
            sub, _, message = message[1:].partition(": ")
            key = sub if key == "(top level)" else f"{key}.{sub}"
        items.append((key, message))
    return items


def format_errors(error: ValidationError) -> list[str]:
    """One ``key.path: problem`` line per error (:func:`keyed_errors`)."""
    return [f"{key}: {message}" for key, message in keyed_errors(error)]


def load_settings(path: Path | str, environ: Mapping[str, str] | None = None) -> Settings:
    """Read, merge with the environment and validate; raise ``SettingsError`` if unusable."""
    environ = os.environ if environ is None else environ
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text) or {}
    except OSError as exc:
        raise SettingsError([f"{path}: cannot read: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise SettingsError(
            [f"{path}: not a text file (not UTF-8 at byte {exc.start}): a YAML file is text"]
        ) from None
    except yaml.YAMLError as exc:
        raise SettingsError([f"{path}: not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise SettingsError([f"{path}: the top level must be a mapping of keys"])
    twice = duplicate_keys(text)
    if twice:
        raise SettingsError([f"{key}: {problem}" for key, problem in twice], list(twice))
    odd = sorted(repr(key) for key in data if not isinstance(key, str))
    if odd:
        raise SettingsError([f"(top level): keys must be names, got {', '.join(odd)}"])
    apply_token_env(data, environ)
    try:
        return Settings(**data)
    except ValidationError as exc:
        keyed: list[tuple[str | None, str]] = list(keyed_errors(exc))
        raise SettingsError(format_errors(exc), keyed) from None


def duplicate_keys(text: str) -> list[tuple[str, str]]:
    """Every key a YAML mapping gives twice, as (``key.path``, problem): PyYAML keeps the
    last silently, so a pool written twice would lose the first without a word. Keys
    compare as YAML reads them (``1`` and ``"1"`` differ); merge keys (``<<``) are
    overrides by design and not counted. ``text`` must already parse."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    reader = yaml.SafeLoader("")
    found: list[tuple[str, str]] = []
    seen: set[int] = set()

    def walk(node: yaml.Node | None, path: tuple[str, ...]) -> None:
        if node is None or id(node) in seen:  # an alias points at a node walked already
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                walk(item, (*path, str(index)))
        if not isinstance(node, yaml.MappingNode):
            return
        lines: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                walk(value_node, path)
                continue
            key = reader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            dotted = ".".join((*path, str(key))) or "(top level)"
            if key in lines:
                found.append(
                    (
                        dotted,
                        f"given twice (lines {lines[key]} and {line}); give it once "
                        "(YAML would keep the last and drop the first silently)",
                    )
                )
            else:
                lines[key] = line
            walk(value_node, (*path, str(key)))

    walk(root, ())
    return found


def apply_token_env(data: dict[str, Any], environ: Mapping[str, str]) -> None:
    """``SPECPILOT_API_TOKEN``, when set, as ``api.token`` of settings data (it wins over
    the file). Whatever builds settings from data does this: ``load_settings``, ``demo``."""
    if environ.get(TOKEN_ENV):
        data.setdefault("api", {})
        if isinstance(data["api"], dict):
            data["api"]["token"] = environ[TOKEN_ENV]


def summary(settings: Settings) -> list[str]:
    """What the settings describe, one line each, without secrets."""
    lines = [f"data dir: {settings.data_dir}", f"store: {_redact(settings.store_url)}"]
    for name, pool in sorted(settings.fleet.pools.items()):
        proposers = ", ".join(
            f"{p.name} ({p.method}, γ {p.gamma_min}-{p.gamma_max})" for p in pool.proposer_list()
        )
        managed = settings.actuators.managed
        started = managed is not None and name in managed.pools
        instances = "managed instance" if started else f"{len(pool.instances)} instance(s)"
        lines.append(
            f"pool {name}: model {pool.model}, {instances}, "
            f"running {pool.speculative_config.get('method')}, proposers: {proposers or 'none'}"
        )
    lines.append(f"actuators: {', '.join(actuator_names(settings)) or 'none'}")
    lines.append(f"evidence from: {', '.join(settings.sources)}")
    if settings.serves_gateway:
        gateway = settings.gateway
        lines.append(
            f"gateway: {gateway.host}:{gateway.port}, classifier "
            f"{gateway.classifier or 'none (default class ' + default_class(settings) + ')'}"
        )
    alerting = settings.alerting
    receivers = [f"alertmanager {alerting.alertmanager_url}"] if alerting.alertmanager_url else []
    receivers += ["webhook"] if alerting.webhook_url else []  # its URL may hold a secret
    lines.append(f"alerts to: {', '.join(receivers) or 'the store only (GET /v1/alerts)'}")
    lines.append(f"classes: {', '.join(settings.classes)}")
    lines.append(f"buckets: {', '.join(settings.bucket_labels)}")
    lines.append(f"scrape interval: {settings.scrape_interval_s:g} s")
    lines.append(
        f"api: {settings.api.host}:{settings.api.port}, read-write token "
        f"{'set' if settings.api.token else 'NOT set (writes refused)'}, "
        f"{len(settings.api.read_only_tokens)} read-only token(s)"
    )
    return lines


def default_class(settings: Settings) -> str:
    return settings.gateway.default_class or settings.classes[0]


def actuator_names(settings: Settings) -> list[str]:
    """How decisions reach the fleet, as ``summary`` and the logs say it."""
    wanted = settings.actuators
    if wanted.mode == "routing":
        return ["routing (gateway)"]
    names = [f"file ({settings.actuator_dir})"] if wanted.file else []
    names += [n for n in ("webhook", "kubernetes") if getattr(wanted, n) is not None]
    managed = wanted.managed
    if managed is not None and managed.pod_pool is not None:
        names.append(
            f"managed (this pod's {managed.pod_pool} vLLM as replica {managed.replica}, "
            f"{managed.mode}, at most {managed.max_unavailable} of the pool restarting)"
        )
    elif managed is not None:
        names.append(f"managed ({', '.join(sorted(managed.pools))}, {managed.mode})")
    return names


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" in rest and ":" in rest.split("@", 1)[0]:
        user = rest.split("@", 1)[0].split(":", 1)[0]
        return f"{scheme}{sep}{user}:***@{rest.split('@', 1)[1]}"
    return url
