"""Fixtures shared by every test area: the real vLLM testbed.

vLLM servers are session-scoped and shared: one start costs ~50 s and ~3 GB, so a test
asks ``vllm_servers.get("ngram:4")`` and gets the running one if another test started it.
With ``SPECPILOT_REQUIRE_VLLM=1`` (set by scripts/test-all, so in CI) a missing vLLM
environment is installed, and anything that goes wrong fails the tests; without it, tests
that need vLLM are skipped unless the cached environment already exists.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator

import pytest

from testbed.environment import ModelSet, VllmEnvironment
from testbed.server import VllmServer, parse_spec


def required(name: str) -> bool:
    """True when the test command demands the real service ``name`` (VLLM, POSTGRES, …)."""
    return os.environ.get(f"SPECPILOT_REQUIRE_{name}") == "1"


@pytest.fixture(scope="session")
def testbed() -> tuple[VllmEnvironment, ModelSet]:
    env, models = VllmEnvironment.default(), ModelSet.default()
    if not (env.ready and models.ready) and not required("VLLM"):
        pytest.skip("vLLM testbed not installed: run `specpilot testbed ensure`")
    env.ensure()
    return env, models.ensure(env)


class VllmServers:
    """Started servers by spec, at most ``limit`` alive at once (least recently used stops)."""

    def __init__(self, env: VllmEnvironment, models: ModelSet, limit: int = 3) -> None:
        self.env, self.models, self.limit = env, models, limit
        self._servers: OrderedDict[tuple[str, int | None], VllmServer] = OrderedDict()

    def get(self, spec: str, *, batch_tokens: int | None = None) -> VllmServer:
        """A running server for ``spec`` (see ``testbed.server.parse_spec``);
        ``batch_tokens`` gives it a compute knee (``testbed.server.KNEE_TOKENS``)."""
        key = (spec, batch_tokens)
        if key in self._servers:
            self._servers.move_to_end(key)
            return self._servers[key]
        while len(self._servers) >= self.limit:
            _, oldest = self._servers.popitem(last=False)
            oldest.stop()
        server = VllmServer(
            self.env, self.models, parse_spec(spec, self.models), batch_tokens=batch_tokens
        ).start()
        self._servers[key] = server
        return server

    def stop_all(self) -> None:
        while self._servers:
            self._servers.popitem()[1].stop()


@pytest.fixture(scope="session")
def vllm_servers(testbed: tuple[VllmEnvironment, ModelSet]) -> Iterator[VllmServers]:
    servers = VllmServers(*testbed)
    yield servers
    servers.stop_all()
