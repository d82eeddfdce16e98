"""specpilot's REST API, built by ``create_app`` (nothing is built at import time).

Reads are open; writes (overrides, freeze) need ``Authorization: Bearer <token>`` with
the read-write token: none sent → 401, a read-only token → 403, and with no read-write
token configured every write is refused (403), never open.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from controller.acceptance import ArmAcceptance
from controller.api.schemas import (
    AcceptanceEvidenceOut,
    AlertListOut,
    AlertOut,
    AlternativeOut,
    ContextPolicyOut,
    DecisionOut,
    DecisionPageOut,
    ErrorOut,
    EstimateOut,
    FleetOut,
    FrozenOut,
    GatewayWindowOut,
    HealthOut,
    InstanceOut,
    Interval,
    OverrideIn,
    OverrideList,
    OverrideOut,
    PolicyOut,
    PoolOut,
    ScopeBody,
    StatsOut,
    StatsRowOut,
)
from controller.contexts import WILDCARD
from controller.loop import FROZEN_KEY, RouteShare
from controller.ports import ArmEstimate
from controller.relayed import RelayedWindow
from controller.running import PushState
from controller.service import Service
from controller.settings import Settings
from controller.specconfig import OFF, SpecConfigError
from controller.store.db import StoreLost, is_unavailable
from controller.store.records import OverrideRecord, Scope
from controller.urls import redact_url

DOCS_ASSETS = "/docs-assets"
"""Where ``/docs`` and ``/redoc`` load Swagger UI and ReDoc from: files of the
``fastapi-offline`` package, served here, since a cluster may have no internet."""
MAX_ID = 2**63 - 1
NO_NUL = r"^[^\x00]*$"
"""PostgreSQL text cannot hold NUL; a filter with one would be a 500 instead of a 422."""
STORE_DOWN = "the store is unreachable; try again"
READ_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {"model": ErrorOut, "description": "the store is unreachable"},
}
WRITE_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut, "description": "no or unknown bearer token"},
    403: {"model": ErrorOut, "description": "read-only token, or writes disabled"},
    503: {"model": ErrorOut, "description": "the store is unreachable"},
}


def get_service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(get_service)]
bearer = HTTPBearer(auto_error=False, description="read-write token for writes")


def require_writer(
    service: ServiceDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    if credentials is None:
        raise HTTPException(401, "a bearer token is required", {"WWW-Authenticate": "Bearer"})
    sent = credentials.credentials.encode()
    api = service.settings.api
    if api.token is not None and hmac.compare_digest(sent, api.token.get_secret_value().encode()):
        return
    if any(hmac.compare_digest(sent, t.get_secret_value().encode()) for t in api.read_only_tokens):
        raise HTTPException(403, "this token is read-only")
    if api.token is None:
        raise HTTPException(403, "writes are disabled: no read-write token is configured")
    raise HTTPException(401, "unknown token", {"WWW-Authenticate": "Bearer"})


Writer = Annotated[None, Depends(require_writer)]


async def store_call(call: Callable[[], Any]) -> Any:
    """Run a store call off the event loop; an outage becomes 503, not 500."""
    try:
        return await run_in_threadpool(call)
    except Exception as exc:
        if is_unavailable(exc):
            raise HTTPException(503, STORE_DOWN) from exc
        raise


def _estimate(estimate: ArmEstimate, measured: ArmAcceptance) -> EstimateOut:
    def interval(pair: tuple[float, float] | None) -> Interval | None:
        return None if pair is None else Interval(low=pair[0], high=pair[1])

    seen = measured.acceptance
    return EstimateOut(
        arm=estimate.arm,
        acceptance=seen.ratio if seen is not None else None,
        acceptance_evidence=None
        if seen is None
        else AcceptanceEvidenceOut(
            accepted_tokens=seen.accepted,
            draft_tokens=seen.draft_tokens,
            since=seen.since,
            until=seen.until,
        ),
        drafted_nothing=measured.drafted_nothing,
        estimated_first_position_acceptance=estimate.first_position_acceptance,
        estimated_first_position_acceptance_interval=interval(
            estimate.first_position_acceptance_interval
        ),
        speedup=estimate.speedup,
        speedup_interval=interval(estimate.speedup_interval),
        observations=estimate.observations,
    )


def _override_out(service: Service, override: OverrideRecord) -> OverrideOut:
    contexts = [c for c in service.fleet.contexts if override.scope.matches(c)]
    try:
        arm: str | None = service.fleet.resolve_override(override.config, contexts)
    except SpecConfigError:
        arm = None
    return OverrideOut(
        id=override.id,
        scope=ScopeBody.model_validate(
            {
                "model": override.scope.model,
                "class": override.scope.workload_class,
                "bucket": override.scope.bucket,
            }
        ),
        config=override.config,
        arm=arm,
        reason=override.reason,
        created_at=override.created_at,
        expires_at=override.expires_at,
    )


def _gateway_window(window: RelayedWindow) -> GatewayWindowOut:
    return GatewayWindowOut(
        window_s=window.window_s,
        requests=window.requests,
        arm=window.arm,
        output_tokens=window.output_tokens,
        acceptance_rate=window.acceptance_rate,
        mean_acceptance_length=window.mean_acceptance_length,
        mean_tpot_s=window.tpot_s,
        mean_ttft_s=window.ttft_s,
        mean_e2e_s=window.e2e_s,
        last_request_at=window.last_request_at,
    )


def _pool_out(service: Service, name: str, instances: list[InstanceOut]) -> PoolOut:
    """One pool: what runs (as vLLM shows it) beside what was pushed."""
    pool, loop = service.fleet.pools[name], service.loop
    settings_config = dict(pool.speculative_config)
    effective = service.fleet.pool_config(name, loop.arms).config
    if service.fleet.routing:
        running = None if settings_config.get("method") == OFF else settings_config
        arm = loop.running.arm_of(name, running)
        view = None
        summary = f"runs {arm}"
    else:
        config = loop.running.running_config(name)
        running = dict(config) if config is not None else None
        view = loop.running.view(name)
        arm = view.running
        summary = f"runs {arm}"
        if view.pushed is not None and view.state is not PushState.CONFIRMED:
            summary = f"pushed {view.pushed}, running {arm} ({view.state})"
    return PoolOut(
        name=name,
        model=pool.model,
        classes=pool.classes or list(service.settings.classes),
        proposers=[p.name for p in pool.proposer_list()],
        settings_config=settings_config,
        running_config=running,
        running_arm=arm,
        effective_config=effective,
        pushed_arm=view.pushed if view else None,
        push_state=view.state.value if view and view.state else None,
        pushed_at=view.pushed_at if view else None,
        push_settled_at=view.settled_at if view else None,
        summary=summary,
        instances=instances,
    )


def build_router() -> APIRouter:
    v1 = APIRouter(prefix="/v1")

    @v1.get("/fleet", response_model=FleetOut, responses=READ_RESPONSES)
    async def fleet(service: ServiceDep) -> FleetOut:
        loop = service.loop
        windows = (
            await store_call(service.store.latest_window_stats) if loop.store_reachable else []
        )
        newest = {(w.pool, w.instance): w for w in windows}
        pools = []
        settings = service.settings
        stale_after = settings.collect.scrape.stale_after_s or 3 * settings.scrape_interval_s
        placed: dict[str, list[str]] = {}
        for placement in service.placements():
            placed.setdefault(placement.pool, []).append(placement.instance)
        if service.pod is not None:
            # Per-pod topology: the other pods' vLLMs, as their replicas last reported.
            for (name, instance), window in sorted(newest.items()):
                listed = placed.setdefault(name, [])
                if instance not in listed and service.clock() - window.ts <= stale_after:
                    listed.append(instance)
        scraped = bool({"scrape", "prometheus"} & set(settings.sources))
        unscraped = "not scraped yet" if scraped else "not scraped (collect: gateway)"
        now = service.clock()
        for name, pool in sorted(service.fleet.pools.items()):
            instances = []
            for url in placed.get(name, pool.instances):
                window = newest.get((name, url)) or newest.get((name, url.rstrip("/")))
                if window is not None and now - window.ts > stale_after:
                    age = now - window.ts
                    window = dataclasses.replace(
                        window, healthy=False, status=f"stale: newest window {age:.0f} s old"
                    )
                relayed = loop.relayed.window(name, redact_url(url.rstrip("/")), now)
                instances.append(
                    InstanceOut(
                        url=redact_url(url),
                        healthy=window.healthy if window else None,
                        last_window_at=window.ts if window else None,
                        acceptance_rate=window.acceptance_rate if window else None,
                        mean_acceptance_length=window.mean_acceptance_length if window else None,
                        arm=window.arm if window else None,
                        requests_running=window.requests_running if window else None,
                        status=window.status if window else unscraped,
                        gateway=_gateway_window(relayed) if relayed is not None else None,
                    )
                )
            pools.append(_pool_out(service, name, instances))
        return FleetOut(leader=loop.is_leader, frozen=loop.frozen, pools=pools)

    @v1.get("/policy", response_model=PolicyOut, response_model_by_alias=True)
    async def policy(service: ServiceDep) -> PolicyOut:
        """Per context: the arm it runs, the arm decided and by whom, and the policy's
        estimates as of the control loop's last iteration."""
        # Read from what the loop published, never asked of the policy: it may be busy
        # planning in the loop's worker thread, and the API must not wait for it.
        loop, now = service.loop, service.clock()
        book = loop.alerts.book
        pins: dict[Any, OverrideRecord] = {}
        for override in sorted(loop.overrides, key=lambda o: (o.scope.specificity, o.created_at)):
            if override.active(now):
                for context in service.fleet.contexts:
                    if override.scope.matches(context):
                        pins[context] = override
        contexts = []
        for context in service.fleet.contexts:
            arm = loop.running_arm(context)
            decided = loop.arms.get(context) or service.fleet.running_arm(context)
            estimates = [
                _estimate(e, book.of_arm(context.model, context.workload_class, e.arm))
                for e in loop.estimates.get(context, ())
            ]
            changed = loop.changed_at.get(context)
            share = loop.routes.get(context) if loop.is_leader and service.fleet.routing else None
            if share is None and loop.is_leader and service.fleet.routing:
                share = RouteShare()
            contexts.append(
                ContextPolicyOut(
                    model=context.model,
                    workload_class=context.workload_class,
                    bucket=context.bucket,
                    arm=arm,
                    decided_arm=decided,
                    actor=loop.actors.get(context, "policy"),
                    changed_at=changed if changed is not None and changed > 0 else None,
                    override_id=pins[context].id if context in pins else None,
                    estimate=next((e for e in estimates if e.arm == arm), None),
                    estimates=estimates,
                    routed_requests=share.requests if share is not None else None,
                    explored_share=share.explored if share is not None else None,
                    failover_share=share.failed_over if share is not None else None,
                )
            )
        return PolicyOut(frozen=loop.frozen, leader=loop.is_leader, contexts=contexts)

    @v1.get(
        "/stats", response_model=StatsOut, response_model_by_alias=True, responses=READ_RESPONSES
    )
    async def stats(
        service: ServiceDep,
        model: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
        workload_class: Annotated[
            str | None, Query(alias="class", max_length=200, pattern=NO_NUL)
        ] = None,
        window_s: Annotated[float, Query(gt=0, le=366 * 24 * 3600, allow_inf_nan=False)] = 3600,
    ) -> StatsOut:
        since = service.clock() - window_s
        rows = await store_call(
            lambda: service.store.stats(since, model=model, workload_class=workload_class)
        )
        return StatsOut(
            since=since,
            window_s=window_s,
            rows=[
                StatsRowOut(
                    model=r.context.model,
                    workload_class=r.context.workload_class,
                    bucket=r.context.bucket,
                    arm=r.arm,
                    requests=r.requests,
                    output_tokens=r.output_tokens,
                    acceptance_rate=r.acceptance_rate,
                    emitted_tokens_per_verify=r.mean_acceptance_length,
                    mean_tpot_s=r.mean_tpot_s,
                    mean_ttft_s=r.mean_ttft_s,
                )
                for r in rows
            ],
        )

    @v1.get(
        "/overrides",
        response_model=OverrideList,
        response_model_by_alias=True,
        responses=READ_RESPONSES,
    )
    async def list_overrides(service: ServiceDep) -> OverrideList:
        now = service.clock()
        overrides = await store_call(lambda: service.store.active_overrides(now))
        return OverrideList(overrides=[_override_out(service, o) for o in overrides])

    @v1.post(
        "/overrides",
        status_code=201,
        response_model=OverrideOut,
        response_model_by_alias=True,
        responses={**WRITE_RESPONSES, 422: {"description": "the fleet cannot run it"}},
    )
    async def create_override(service: ServiceDep, _: Writer, body: OverrideIn) -> OverrideOut:
        scope = Scope(body.scope.model, body.scope.workload_class, body.scope.bucket)
        for field, value, known in (
            ("model", scope.model, service.settings.models),
            ("class", scope.workload_class, service.settings.classes),
            ("bucket", scope.bucket, service.settings.bucket_labels),
        ):
            if value != WILDCARD and value not in known:
                raise HTTPException(
                    422, f"scope.{field}: unknown {field} {value!r} (known: {', '.join(known)})"
                )
        contexts = [c for c in service.fleet.contexts if scope.matches(c)]
        try:
            service.fleet.resolve_override(body.config, contexts)
        except SpecConfigError as exc:
            raise HTTPException(422, f"config: {exc}") from None
        now = service.clock()
        override = OverrideRecord(
            id=str(uuid.uuid4()),
            created_at=now,
            expires_at=now + body.ttl_s,
            scope=scope,
            config=dict(body.config),
            reason=body.reason,
        )
        await store_call(lambda: service.store.add_override(override))  # durable before 201
        service.loop.wake()
        return _override_out(service, override)

    @v1.delete(
        "/overrides/{override_id}",
        status_code=204,
        responses={**WRITE_RESPONSES, 404: {"model": ErrorOut, "description": "no such override"}},
    )
    async def delete_override(
        service: ServiceDep,
        _: Writer,
        override_id: Annotated[str, Path(max_length=36, pattern=NO_NUL)],
    ) -> Response:
        now = service.clock()
        if not await store_call(lambda: service.store.delete_override(override_id, now)):
            raise HTTPException(404, f"no active override {override_id!r}")
        service.loop.wake()
        return Response(status_code=204)

    async def set_frozen(service: Service, frozen: bool) -> FrozenOut:
        now = service.clock()
        await store_call(lambda: service.store.set_state(FROZEN_KEY, frozen, now))
        service.loop.set_frozen(frozen)
        service.loop.wake()
        return FrozenOut(frozen=frozen)

    @v1.post("/policy/freeze", response_model=FrozenOut, responses=WRITE_RESPONSES)
    async def freeze(service: ServiceDep, _: Writer) -> FrozenOut:
        return await set_frozen(service, True)

    @v1.post("/policy/unfreeze", response_model=FrozenOut, responses=WRITE_RESPONSES)
    async def unfreeze(service: ServiceDep, _: Writer) -> FrozenOut:
        return await set_frozen(service, False)

    @v1.get(
        "/decisions",
        response_model=DecisionPageOut,
        response_model_by_alias=True,
        responses=READ_RESPONSES,
    )
    async def decisions(
        service: ServiceDep,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        before: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None,
        model: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
        workload_class: Annotated[
            str | None, Query(alias="class", max_length=200, pattern=NO_NUL)
        ] = None,
        bucket: Annotated[str | None, Query(max_length=32, pattern=NO_NUL)] = None,
    ) -> DecisionPageOut:
        page = await store_call(
            lambda: service.store.decisions(
                limit=limit,
                before=before,
                model=model,
                workload_class=workload_class,
                bucket=bucket,
            )
        )
        return DecisionPageOut(
            decisions=[
                DecisionOut(
                    id=d.id or 0,
                    ts=d.ts,
                    model=d.context.model,
                    workload_class=d.context.workload_class,
                    bucket=d.context.bucket,
                    arm=d.arm,
                    previous_arm=d.previous_arm,
                    reason=d.reason,
                    detail=d.detail,
                    actor=d.actor,
                    predicted_speedup=d.predicted_speedup,
                    measured_speedup=d.measured_speedup,
                    alternatives=[
                        AlternativeOut(
                            arm=a.arm,
                            predicted_speedup=a.predicted_speedup,
                            interval=Interval(low=a.low, high=a.high),
                        )
                        for a in d.alternatives
                    ],
                )
                for d in page.decisions
            ],
            next_before=page.next_before,
        )

    @v1.get("/alerts", response_model=AlertListOut, responses=READ_RESPONSES)
    async def alerts(
        service: ServiceDep,
        limit: Annotated[int, Query(ge=1, le=500)] = 100,
        unresolved: bool = False,
    ) -> AlertListOut:
        """Alerts the service raised (acceptance drift, failed pushes and rollbacks…)."""
        found = await store_call(
            lambda: service.store.alerts(limit=limit, unresolved_only=unresolved)
        )
        return AlertListOut(
            alerts=[
                AlertOut(
                    id=a.id or 0,
                    ts=a.ts,
                    name=a.name,
                    severity=a.severity,
                    message=a.message,
                    context=a.context,
                    resolved_at=a.resolved_at,
                )
                for a in found
            ]
        )

    return v1


def instances_check(service: Service, down: Mapping[str, str]) -> str:
    """``/readyz``'s ``checks.instances``: ok, or each pool with no healthy instance."""
    instances = service.instances
    if instances is None or not instances.probed:
        if service.loop.last_tick_at is None:
            return "not probed yet"
        return "not probed here: the leader probes the fleet"
    if not down:
        return "ok"
    return "; ".join(f"pool {pool}: no healthy instance ({why})" for pool, why in down.items())


def create_waiting_app(reason: Callable[[], str]) -> FastAPI:
    """The API while the store cannot be reached at start and the gateway already serves
    (``specpilot serve``): alive and not ready. ``/healthz`` says ok, since a liveness
    probe must not restart a process whose data path works while its database is down;
    ``/readyz`` says 503 with ``reason()`` (why the store is unreachable); every other
    path 503 until the real API takes over the socket."""
    app = FastAPI(title="specpilot (waiting for its store)", version="1", openapi_url=None)

    @app.get("/healthz", response_model=HealthOut)
    async def healthz() -> HealthOut:
        return HealthOut(status="ok")

    @app.get("/readyz", response_model=HealthOut, responses={503: {"model": HealthOut}})
    async def readyz(response: Response) -> HealthOut:
        response.status_code = 503
        checks = {"store": f"unreachable: {reason()}", "loop": "not started"}
        return HealthOut(status="not ready", checks=checks)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def waiting(path: str) -> Response:
        body = ErrorOut(
            detail=f"the store is unreachable ({reason()}); the API starts once it answers"
        )
        return Response(body.model_dump_json(), status_code=503, media_type="application/json")

    return app


def create_app(settings: Settings, service: Service, *, run_loop: bool = True) -> FastAPI:
    """The API over ``service``; with ``run_loop`` its lifespan also runs the control
    loop (restore on start, clean shutdown — snapshot and flush — on stop)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not run_loop:
            yield
            return
        await service.loop.start()
        stop = asyncio.Event()
        task = asyncio.create_task(service.loop.run(stop))
        try:
            yield
        finally:
            stop.set()
            await task

    app = FastAPIOffline(
        title="specpilot",
        version="1",
        description="Speculative-decoding control for vLLM fleets.",
        lifespan=lifespan,
        static_url=DOCS_ASSETS,
    )
    app.state.service = service
    app.state.settings = settings

    @app.middleware("http")
    async def count_requests(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        service.metrics.api_requests.labels(request.method, path, str(response.status_code)).inc()
        return response

    @app.get("/healthz", response_model=HealthOut)
    async def healthz() -> HealthOut:
        return HealthOut(status="ok")

    @app.get("/readyz", response_model=HealthOut, responses={503: {"model": HealthOut}})
    async def readyz(response: Response) -> HealthOut:
        checks = {}
        try:
            await run_in_threadpool(service.store.ping)
            checks["store"] = "ok"
        except StoreLost as exc:
            checks["store"] = f"lost: {exc}"
        except Exception as exc:
            checks["store"] = f"unreachable: {type(exc).__name__}"
        loop = service.loop
        checks["loop"] = "ok" if loop.last_tick_at is not None else "not started"
        checks["role"] = "leader" if loop.is_leader else "follower"
        ready = checks["store"] == "ok" and checks["loop"] == "ok"
        if service.pod is not None:
            # Per-pod topology: the pod serves through its vLLM; while that drains or
            # restarts, a 503 takes the pod out of its Service.
            checks["vllm"] = service.pod.readiness()
            ready = ready and checks["vllm"] == "ok"
        degraded = False
        if service.instances is not None:
            down = service.instances.pools_down()
            checks["instances"] = instances_check(service, down)
            degraded = bool(down)
            # A pod's own vLLM down: the pod must leave its Service (503). Elsewhere a
            # pool with no healthy instance leaves specpilot able to serve its API (and
            # its gateway the other pools): degraded, still 200 (see controller/README).
            ready = ready and not (down and service.pod is not None)
        if not ready:
            response.status_code = 503
        status = "not ready" if not ready else "degraded" if degraded else "ready"
        return HealthOut(status=status, checks=checks)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(build_router())
    return app
