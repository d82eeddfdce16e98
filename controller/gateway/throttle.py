"""Logging that a client or a failing upstream cannot turn into a flood of lines."""

from __future__ import annotations

import logging
import math
import time

LOG_EVERY_S = 10.0
"""The same kind of trouble (out of file descriptors, refused requests, an instance that
keeps failing) is logged at most once per this many seconds, with a count of what
happened since."""


class Throttled:
    """Logs one kind of trouble at most once per ``LOG_EVERY_S``, counting the rest."""

    __slots__ = ("_logger", "_next", "_suppressed")

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._next = -math.inf
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        if self._suppressed:
            message += " (and %d more like it in the last %.0f s)"
            args = (*args, self._suppressed, LOG_EVERY_S)
        self._logger.warning(message, *args)
        self._next = now + LOG_EVERY_S
        self._suppressed = 0
