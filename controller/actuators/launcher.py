"""Start vLLM as a local process: the managed actuator's launcher on a GPU node.

The operator gives the command that serves the model, without a port and speculative
config (``python -m vllm.entrypoints.openai.api_server --model /models/llama
--served-model-name llama``, or ``vllm serve ...``); each launch adds ``--host``,
``--port`` (a free one) and sets ``--speculative-config`` the same way the Kubernetes
actuator edits a container's arguments (``controller.actuators.k8s``), so an existing
one is replaced and ``None`` removes it along with ``--per-request-spec-decode-metrics``.

Each process runs in its own session (process group), so stopping it also stops vLLM's
engine-core and worker children; ``stop`` returns when the whole group is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from controller.actuators.k8s import with_speculative_config
from controller.actuators.managed import Instance, SpecConfig
from testbed.server import free_port, process_group_alive


class LaunchError(RuntimeError):
    """vLLM exited or did not become healthy; the message ends with its log's tail."""


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def local_host(host: str) -> str:
    """Where this machine reaches a server listening on ``host``: a wildcard address
    (a pod's vLLM listens on every interface for its Service) is reached on loopback."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, host)


@dataclass
class ProcessInstance:
    process: asyncio.subprocess.Process
    base_url: str
    served_model: str
    log_path: Path
    stop_grace_s: float = 30.0

    async def stop(self) -> None:
        """SIGTERM the group (vLLM finishes what it can), SIGKILL after the grace."""
        pgid = self.process.pid
        for sig, wait_s in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self.process.returncode is None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.process.wait(), 0.1)
                if not process_group_alive(pgid):
                    return
                await asyncio.sleep(0.1)


@dataclass
class CommandLauncher:
    command: Sequence[str]
    """The serving command without host, port or speculative config."""
    served_model: str
    """The model name the server answers to (its ``--served-model-name``)."""
    host: str = "127.0.0.1"
    port: int | None = None
    """The port every launch listens on (in place: one instance at a time); None: a
    free one each time."""
    environment: Mapping[str, str] = field(default_factory=dict)
    """Added to this process's environment (``CUDA_VISIBLE_DEVICES``, ...)."""
    log_dir: Path | None = None
    """Where each instance's output goes; None: the temporary directory."""
    health_poll_s: float = 0.5

    def argv(self, config: SpecConfig, port: int) -> list[str]:
        argv = with_speculative_config(self.command, config)
        return [*argv, "--host", self.host, "--port", str(port)]

    async def launch(self, pool: str, config: SpecConfig, timeout_s: float) -> Instance:
        port = self.port or free_port()
        log_dir = self.log_dir or Path(tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"specpilot-{pool}-{port}.log"
        with log_path.open("ab") as log:
            process = await asyncio.create_subprocess_exec(
                *self.argv(config, port),
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **self.environment},
                start_new_session=True,
            )
        instance = ProcessInstance(
            process, f"http://{local_host(self.host)}:{port}", self.served_model, log_path
        )
        try:
            await self._wait_healthy(instance, timeout_s)
        except BaseException:
            await instance.stop()
            raise
        return instance

    async def _wait_healthy(self, instance: ProcessInstance, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if instance.process.returncode is not None:
                    raise LaunchError(
                        f"exited with {instance.process.returncode} during start:\n"
                        + _tail(instance.log_path)
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{instance.base_url}/health")).status_code == 200:
                        return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(instance.process.wait(), self.health_poll_s)
        raise LaunchError(f"not healthy after {timeout_s:.0f} s:\n" + _tail(instance.log_path))
