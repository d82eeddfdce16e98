"""The process launcher on a stand-in server script (real processes, loopback HTTP)."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

import pytest

from controller.actuators.launcher import CommandLauncher, LaunchError, ProcessInstance

SERVER = textwrap.dedent(
    """
    import json, subprocess, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    args = sys.argv[1:]
    if "--fail" in args:
        print("refusing this config", flush=True)
        sys.exit(3)
    port = int(args[args.index("--port") + 1])
    # A child in the same process group, as vLLM's engine core is.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"argv": args, "child": child.pid}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "server.py"
    path.write_text(SERVER)
    return path


def alive(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_starts_with_the_config_waits_for_health_and_stops_the_whole_group(
    script: Path, tmp_path: Path
) -> None:
    launcher = CommandLauncher(
        [sys.executable, str(script), "--model", "/m", "--speculative-config", "{}"],
        served_model="m",
        log_dir=tmp_path,
    )
    config = {"method": "ngram", "num_speculative_tokens": 3}

    async def scenario() -> tuple[dict[str, object], int]:
        import httpx

        instance = await launcher.launch("chat", config, timeout_s=30)
        assert isinstance(instance, ProcessInstance)
        async with httpx.AsyncClient() as client:
            seen = (await client.get(f"{instance.base_url}/health")).json()
        await instance.stop()
        return seen, int(str(seen["child"]))

    seen, child = asyncio.run(scenario())
    argv = seen["argv"]
    assert isinstance(argv, list)
    assert argv[:4] == [
        "--model",
        "/m",
        "--speculative-config",
        json.dumps(config, sort_keys=True, separators=(",", ":")),
    ]
    assert argv[4:6] == ["--host", "127.0.0.1"]
    assert not alive(child)


def test_an_exit_during_start_is_a_launch_error_with_the_log(script: Path, tmp_path: Path) -> None:
    launcher = CommandLauncher([sys.executable, str(script), "--fail"], "m", log_dir=tmp_path)
    with pytest.raises(LaunchError, match=r"exited with 3(.|\n)*refusing this config"):
        asyncio.run(launcher.launch("chat", None, timeout_s=30))
