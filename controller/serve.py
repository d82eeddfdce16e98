"""``specpilot serve``: the control loop and the REST API in one process under uvicorn.

uvicorn turns SIGTERM and SIGINT into a graceful shutdown; the app's lifespan then
stops the loop, which saves the learned state and flushes buffered writes.
"""

from __future__ import annotations

import logging
import sys

import uvicorn

from controller.api import create_app
from controller.builtin import policy_from, source_from
from controller.service import build_service
from controller.settings import Settings
from controller.store.db import StoreUnavailable, redact

log = logging.getLogger(__name__)


def serve(settings: Settings) -> int:
    """Run until a signal stops it: 0 after a clean shutdown, 1 if the store is unreachable."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        service = build_service(settings, policy_from(settings), source_from(settings))
    except StoreUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    log.info(
        "specpilot serving on http://%s:%d (store %s)",
        settings.api.host,
        settings.api.port,
        redact(settings.store_url),
    )
    app = create_app(settings, service)
    config = uvicorn.Config(
        app, host=settings.api.host, port=settings.api.port, log_level="info", lifespan="on"
    )
    try:
        uvicorn.Server(config).run()
    finally:
        service.close()
    return 0
