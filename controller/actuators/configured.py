"""The actuators a settings file asks for, each paced by the policy's dwell time."""

from __future__ import annotations

from controller.actuators.base import Actuator
from controller.actuators.file import FileActuator
from controller.actuators.k8s import DeploymentTarget, KubernetesActuator
from controller.actuators.pacing import Paced
from controller.actuators.preflight import Preflight
from controller.actuators.webhook import RetrySettings, WebhookActuator
from controller.settings import Settings


def actuators_from(settings: Settings) -> list[Actuator]:
    """File (unless turned off), webhook and Kubernetes, as configured. Pushes that may
    restart instances are paced per pool by ``policy.min_dwell_s`` so a flapping
    decision never becomes a restart storm."""
    wanted = settings.actuators
    preflight = Preflight(target_models=dict(wanted.target_models))
    actuators: list[Actuator] = []
    if wanted.file:
        actuators.append(FileActuator(settings.actuator_dir, preflight))
    if wanted.webhook is not None:
        hook = wanted.webhook
        webhook = WebhookActuator(
            str(hook.url),
            retry=RetrySettings(attempts=hook.attempts, timeout_s=hook.timeout_s),
            headers=dict(hook.headers),
            preflight=preflight,
        )
        actuators.append(Paced(webhook, settings.policy.min_dwell_s))
    if wanted.kubernetes is not None:
        targets = {
            pool: DeploymentTarget(d.namespace, d.deployment, d.container)
            for pool, d in wanted.kubernetes.deployments.items()
        }
        kubernetes = KubernetesActuator(
            targets, patch_type=wanted.kubernetes.patch_type, preflight=preflight
        )
        actuators.append(Paced(kubernetes, settings.policy.min_dwell_s))
    return actuators
