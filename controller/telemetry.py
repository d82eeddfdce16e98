"""specpilot's own Prometheus metrics, registered on the registry passed in.

Base units, ``_total`` on counters, ``_ratio`` for 0-1 values, labels kept to
model / class / bucket / arm / actor; the model's label is vLLM's own ``model_name``, so
that one dashboard variable selects a model's vLLM and specpilot series alike.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

CONTEXT_LABELS = ("model_name", "workload_class", "bucket")


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.loop_iterations = Counter(
            "specpilot_loop_iterations_total", "Control-loop iterations run.", registry=registry
        )
        self.loop_errors = Counter(
            "specpilot_loop_errors_total",
            "Control-loop iterations that failed (the loop goes on).",
            registry=registry,
        )
        self.loop_duration = Histogram(
            "specpilot_loop_iteration_duration_seconds",
            "Time one control-loop iteration took.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        )
        self.observations = Counter(
            "specpilot_observations_total", "Per-request observations collected.", registry=registry
        )
        self.decisions = Counter(
            "specpilot_decisions_total",
            "Changes of a context's effective arm, by who made them.",
            ["actor"],
            registry=registry,
        )
        self.guard_rail_rejections = Counter(
            "specpilot_guard_rail_rejections_total",
            "Policy choices a guard rail refused.",
            ["rule"],
            registry=registry,
        )
        self.actuations = Counter(
            "specpilot_actuations_total",
            "Pool configs handed to actuators, by outcome.",
            ["actuator", "outcome"],
            registry=registry,
        )
        self.leader = Gauge(
            "specpilot_leader", "1 while this replica leads (runs the policy).", registry=registry
        )
        self.frozen = Gauge(
            "specpilot_policy_frozen", "1 while learning and pushing are frozen.", registry=registry
        )
        self.overrides_active = Gauge(
            "specpilot_overrides_active", "Operator overrides in force.", registry=registry
        )
        self.store_up = Gauge(
            "specpilot_store_up",
            "1 when the last store write reached the database.",
            registry=registry,
        )
        self.store_buffered = Gauge(
            "specpilot_store_buffered_records",
            "Records waiting in memory for the database to come back.",
            registry=registry,
        )
        self.store_dropped = Counter(
            "specpilot_store_dropped_records_total",
            "Records dropped because the write buffer was full.",
            registry=registry,
        )
        self.push_applied = Gauge(
            "specpilot_push_applied",
            "Push mode: 1 when what vLLM reports shows the pool's last pushed config "
            "running, 0 while it does not (pending, or not applied in time).",
            ["pool"],
            registry=registry,
        )
        self.predicted_speedup = Gauge(
            "specpilot_context_predicted_speedup",
            "Speed-up over no speculation the policy expects from the context's arm.",
            CONTEXT_LABELS,
            registry=registry,
        )
        self.context_acceptance = Gauge(
            "specpilot_context_acceptance_ratio",
            "vLLM's acceptance (accepted over draft tokens) of the context's arm for its "
            "model and class, over its newest evidence of 500 draft tokens or more.",
            CONTEXT_LABELS,
            registry=registry,
        )
        self.acceptance = Gauge(
            "specpilot_acceptance_ratio",
            "vLLM's acceptance (accepted over draft tokens) of a model, class and proposer, "
            "over its newest evidence of 500 draft tokens or more (what AcceptanceDrift "
            "resolves on).",
            ["model_name", "workload_class", "proposer"],
            registry=registry,
        )
        self.drafted_nothing = Gauge(
            "specpilot_drafted_nothing",
            "1 while the newest window or request of a model, class and proposer drafted "
            "nothing (e.g. n-gram found no match): no acceptance to measure, not 0.",
            ["model_name", "workload_class", "proposer"],
            registry=registry,
        )
        self.context_arm = Gauge(
            "specpilot_context_arm",
            "1 for the arm the context runs (in routing mode: the arm the gateway routes "
            "its requests to, bar exploration).",
            (*CONTEXT_LABELS, "arm"),
            registry=registry,
        )
        self.explored = Gauge(
            "specpilot_context_explored_ratio",
            "Routing mode: share of the context's requests since its arm last changed that "
            "the routing table sent to another arm (exploration, probes, trials).",
            CONTEXT_LABELS,
            registry=registry,
        )
        self.failed_over = Gauge(
            "specpilot_context_failover_ratio",
            "Routing mode: share of the context's requests since its arm last changed that "
            "the gateway served on another pool than the routing table's, because that "
            "pool could not take them (a failover, not an exploration).",
            CONTEXT_LABELS,
            registry=registry,
        )
        self.alerts = Counter(
            "specpilot_alerts",
            "Alerts raised (each one stored), by alert name.",
            ["alert"],
            registry=registry,
        )
        self.alert_firing = Gauge(
            "specpilot_alert_firing",
            "1 while the alert fires for this model, class and proposer, else 0.",
            ["alert", "model_name", "workload_class", "proposer"],
            registry=registry,
        )
        self.instance_up = Gauge(
            "specpilot_instance_up",
            "1 while the pool instance answers GET /v1/models with its pool's model, else 0 "
            "(unreachable, an HTTP error, or another model); url as /v1/fleet shows it.",
            ["pool", "url"],
            registry=registry,
        )
        self.api_requests = Counter(
            "specpilot_api_requests_total",
            "REST API requests by route template and status code.",
            ["method", "route", "status"],
            registry=registry,
        )
        self.alert_notifications = Counter(
            "specpilot_alert_notifications_total",
            "Deliveries of specpilot's alerts to Alertmanager or the webhook, by outcome "
            "(ok, failed after every attempt, dropped from a full queue).",
            ["sink", "outcome"],
            registry=registry,
        )
