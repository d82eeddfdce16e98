"""Record real vLLM output into ``tests/fixtures/vllm-0.32/`` for unit tests.

Starts real servers from the testbed one after another and saves, byte for byte:

- ``metrics-<cfg>-start.txt`` / ``metrics-<cfg>-after.txt``: ``/metrics`` right after
  start-up and after the traffic below, for ``ngram`` (γ=4), ``draft`` (the trained draft
  model, γ=3) and ``off``;
- ``metrics-ngram-restarted.txt``: the n-gram server restarted and given one request, so
  (``after``, ``restarted``) is a counter-reset pair;
- ``completion-<cfg>.json``, ``chat-<cfg>.json``: non-streaming responses;
- ``completion-<cfg>-stream-usage.sse``, ``chat-<cfg>-stream-usage.sse``: streaming with
  ``stream_options.include_usage`` (per-request metrics ride on the final usage chunk);
  ``completion-<cfg>-stream.sse``: streaming without it;
- ``requests-<cfg>.jsonl``: every response body of the traffic, non-streaming, so a test
  can reconcile per-request metrics with the counter deltas.

Run: ``specpilot testbed record [--out DIR]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from testbed.environment import ModelSet, VllmEnvironment
from testbed.server import VllmServer, parse_spec
from testbed.traffic import PROSE_PROMPTS, chat_body, code_prompt, completion_body

CONFIGS = {"ngram": "ngram:4", "draft": "draft:3", "off": "off"}
DEFAULT_OUT = Path("tests/fixtures/vllm-0.32")


def _metrics(client: httpx.Client, server: VllmServer) -> str:
    response = client.get(f"{server.base_url}/metrics")
    response.raise_for_status()
    return response.text


def _stream(client: httpx.Client, url: str, body: dict[str, object]) -> str:
    with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        return "".join(response.iter_text())


def drive_traffic(
    client: httpx.Client, server: VllmServer, count: int = 6
) -> list[dict[str, object]]:
    """Send ``count`` non-streaming completions (code, then prose); return the bodies."""
    bodies = []
    for i in range(count):
        prompt = code_prompt(i) if i % 3 != 2 else PROSE_PROMPTS[i % len(PROSE_PROMPTS)]
        response = client.post(f"{server.base_url}/v1/completions", json=completion_body(prompt))
        response.raise_for_status()
        bodies.append(response.json())
    return bodies


def record(env: VllmEnvironment, models: ModelSet, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(name: str, text: str) -> None:
        path = out / name
        path.write_text(text)
        written.append(path)

    with httpx.Client(timeout=120.0) as client:
        for name, spec in CONFIGS.items():
            with VllmServer(env, models, parse_spec(spec, models)) as server:
                save(f"metrics-{name}-start.txt", _metrics(client, server))
                bodies = drive_traffic(client, server)
                save(f"requests-{name}.jsonl", "".join(json.dumps(b) + "\n" for b in bodies))
                completions = f"{server.base_url}/v1/completions"
                chats = f"{server.base_url}/v1/chat/completions"
                response = client.post(completions, json=completion_body(code_prompt(7)))
                save(f"completion-{name}.json", response.text)
                response = client.post(chats, json=chat_body(code_prompt(8)))
                save(f"chat-{name}.json", response.text)
                save(
                    f"completion-{name}-stream-usage.sse",
                    _stream(
                        client,
                        completions,
                        completion_body(code_prompt(9), 24, stream=True, include_usage=True),
                    ),
                )
                save(
                    f"completion-{name}-stream.sse",
                    _stream(client, completions, completion_body(code_prompt(9), 24, stream=True)),
                )
                save(
                    f"chat-{name}-stream-usage.sse",
                    _stream(
                        client,
                        chats,
                        chat_body(code_prompt(10), 24, stream=True, include_usage=True),
                    ),
                )
                save(f"metrics-{name}-after.txt", _metrics(client, server))
            if name == "ngram":
                with VllmServer(env, models, parse_spec(spec, models)) as server:
                    drive_traffic(client, server, count=1)
                    save("metrics-ngram-restarted.txt", _metrics(client, server))
    return written
