"""Write each pool's effective ``--speculative-config`` to ``<dir>/<pool>.json``.

For orchestrators that watch files or ConfigMaps. The file holds exactly the JSON to
pass as ``--speculative-config`` (``null``: start without speculation). Each write is
atomic (temporary file in the same directory, fsync, rename, fsync of the directory),
so a reader never sees half a file and a crash leaves the old or the new one.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from controller.actuators.preflight import Preflight
from controller.fleet import PoolConfig


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def render(config: PoolConfig) -> str:
    return json.dumps(config.config, sort_keys=True) + "\n"


class FileActuator:
    name = "file"

    def __init__(self, directory: Path, preflight: Preflight | None = None) -> None:
        self.directory = directory
        self.preflight = preflight or Preflight()

    def path(self, pool: str) -> Path:
        return self.directory / f"{pool}.json"

    async def apply(self, configs: Sequence[PoolConfig]) -> None:
        for config in configs:  # all refused before any file is written
            self.preflight.check(config)
        await asyncio.to_thread(self._write, configs)

    def _write(self, configs: Sequence[PoolConfig]) -> None:
        for config in configs:
            path, text = self.path(config.pool), render(config)
            # Unchanged files are left alone so watchers do not restart for nothing.
            if path.exists() and path.read_text() == text:
                continue
            write_atomically(path, text)
