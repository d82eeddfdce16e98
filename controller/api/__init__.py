"""specpilot's REST API (FastAPI)."""

from controller.api.app import create_app, create_waiting_app

__all__ = ["create_app", "create_waiting_app"]
