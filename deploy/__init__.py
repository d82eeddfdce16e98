"""Kubernetes manifests for specpilot (docs/deploy.md) and the generator of those made
from ``dashboards/`` (``deploy.render``)."""
