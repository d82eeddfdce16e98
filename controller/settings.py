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
from controller.specconfig import (
    VLLM_METHODS,
    Proposer,
    SpecConfigError,
    check_vllm_schema,
    resolve_on_pool,
)

ENV_PREFIX = "SPECPILOT_"
TOKEN_ENV = "SPECPILOT_API_TOKEN"
PositiveSeconds = Annotated[float, Field(gt=0)]


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


class PoolSettings(_Strict):
    """A set of vLLM instances serving one model with one ``--speculative-config``."""

    model: str
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

    def proposer_list(self) -> tuple[Proposer, ...]:
        return tuple(spec.as_proposer(name) for name, spec in sorted(self.proposers.items()))


class FleetSettings(_Strict):
    pools: dict[str, PoolSettings] = Field(min_length=1)

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
    """SQLAlchemy URL; None: SQLite file ``specpilot.db`` in the data directory."""
    observation_retention_s: PositiveSeconds = 24 * 3600.0
    """Raw per-request observations older than this are rolled up, then deleted."""
    rollup_period_s: PositiveSeconds = 3600.0
    write_buffer_max: int = Field(default=10_000, ge=1)
    """Records held in memory while the database is unreachable; oldest observations go first."""
    snapshot_interval_s: float = Field(default=0.0, ge=0)
    """How often the learned policy state is saved; 0: every loop interval, so a crash
    loses at most one interval of learning. Always saved on shutdown."""


class ApiSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    token: SecretStr | None = None
    """Read-write bearer token; none configured means every write is refused."""
    read_only_tokens: list[SecretStr] = Field(default_factory=list)


class PolicySettings(_Strict):
    name: str = "bandit"
    min_dwell_s: float = Field(default=60.0, ge=0)
    """Guard rail: a context's arm changes at most once per this many seconds."""
    measure_after_s: float = Field(default=60.0, ge=0)
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
    max_slowdown: float | None = Field(default=0.25, ge=0)
    """Roll back if the new instance's median canary latency exceeds the old one's by
    more than this fraction (0.25: 25 % slower); null: do not compare."""


class LaunchSettings(_Strict):
    """How one managed pool's vLLM is started: a ``command`` (run by specpilot's
    ``CommandLauncher``) or a ``launcher`` factory, exactly one of them."""

    command: list[str] | None = Field(default=None, min_length=1)
    """The serving command without ``--host``, ``--port`` or ``--speculative-config``
    (``[vllm, serve, /models/llama, --served-model-name, llama]``)."""
    served_model: str | None = None
    """The model name the server answers to; None: the pool's ``model``."""
    host: str = "127.0.0.1"
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
    switch_grace_s: float = Field(default=1.0, ge=0)
    """After the switch, the old instance is drained only after this many seconds."""
    drain_timeout_s: PositiveSeconds = 300.0
    """The old instance is stopped after this long even if requests remain."""
    drain_poll_s: PositiveSeconds = 0.5
    canary: ManagedCanarySettings = ManagedCanarySettings()


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


BUILTIN_CLASSIFIER = "builtin"


class GatewaySettings(_Strict):
    """The OpenAI-compatible gateway ``specpilot serve`` runs beside the API (same
    process, same event loop), feeding every request's measurements to the loop."""

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
    wiring: WiringSettings = WiringSettings()
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
    """Settings that cannot be used; ``problems`` has one line per error, naming the key."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _key(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def format_errors(error: ValidationError) -> list[str]:
    """One ``key.path: problem`` line per error. A cross-field validator names the key it
    is about with a leading ``@sub.key: `` (relative to where it runs)."""
    lines = []
    for item in error.errors():
        key, message = _key(item["loc"]), item["msg"].removeprefix("Value error, ")
        if message.startswith("@"):
            sub, _, message = message[1:].partition(": ")
            key = sub if key == "(top level)" else f"{key}.{sub}"
        lines.append(f"{key}: {message}")
    return lines


def load_settings(path: Path | str, environ: Mapping[str, str] | None = None) -> Settings:
    """Read, merge with the environment and validate; raise ``SettingsError`` if unusable."""
    environ = os.environ if environ is None else environ
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise SettingsError([f"{path}: cannot read: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise SettingsError([f"{path}: not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise SettingsError([f"{path}: the top level must be a mapping of keys"])
    if environ.get(TOKEN_ENV):
        data.setdefault("api", {})
        if isinstance(data["api"], dict):
            data["api"]["token"] = environ[TOKEN_ENV]
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise SettingsError(format_errors(exc)) from None


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
    if settings.serves_gateway:
        gateway = settings.gateway
        lines.append(
            f"gateway: {gateway.host}:{gateway.port}, classifier "
            f"{gateway.classifier or 'none (default class ' + default_class(settings) + ')'}"
        )
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
    if wanted.managed is not None:
        names.append(f"managed ({', '.join(sorted(wanted.managed.pools))}, {wanted.managed.mode})")
    return names


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" in rest and ":" in rest.split("@", 1)[0]:
        user = rest.split("@", 1)[0].split(":", 1)[0]
        return f"{scheme}{sep}{user}:***@{rest.split('@', 1)[1]}"
    return url
