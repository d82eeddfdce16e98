"""Prompts and request bodies the testbed sends to real vLLM servers.

The code prompts repeat their own text, so n-gram lookup finds its drafts in the
prompt, as it does on real code-edit traffic; the prose prompts do not.
"""

from __future__ import annotations

from typing import Any

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
    prompt: str, max_tokens: int = 64, *, stream: bool = False, include_usage: bool = False
) -> dict[str, Any]:
    """Greedy, fixed-length: ``ignore_eos`` keeps the tiny random model from stopping early."""
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
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
