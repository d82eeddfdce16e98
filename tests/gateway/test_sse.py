"""SseRelay on recorded real vLLM 0.32 streams (tests/fixtures/vllm-0.32)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from controller.gateway.sse import SseRelay, json_object

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm-0.32"
_ID = re.compile(rb'"id":"[^"]*"')


def normalise_ids(data: bytes) -> bytes:
    return _ID.sub(b'"id":"X"', data)


def relay_all(relay: SseRelay, pieces: list[bytes]) -> bytes:
    return b"".join(relay.feed(piece) for piece in pieces) + relay.finish()


@pytest.mark.parametrize("config", ["ngram", "draft", "off"])
def test_stripping_the_usage_chunk_gives_what_vllm_sends_without_it(config: str) -> None:
    # Recorded from the same greedy request with and without include_usage.
    with_usage = (FIXTURES / f"completion-{config}-stream-usage.sse").read_bytes()
    without = (FIXTURES / f"completion-{config}-stream.sse").read_bytes()
    relay = SseRelay(strip_usage=True)
    out = relay_all(relay, [with_usage])
    assert normalise_ids(out) == normalise_ids(without)
    usage = json_object(relay.usage_data or b"")
    assert usage is not None
    assert usage["usage"]["completion_tokens"] > 0
    assert b'"system_fingerprint"' in out and b'"usage"' not in out


def test_any_split_of_the_stream_gives_the_same_bytes() -> None:
    data = (FIXTURES / "completion-ngram-stream-usage.sse").read_bytes()
    whole = relay_all(SseRelay(strip_usage=True), [data])
    for size in (1, 7, 64, 333):
        pieces = [data[i : i + size] for i in range(0, len(data), size)]
        assert relay_all(SseRelay(strip_usage=True), pieces) == whole


def test_events_are_forwarded_as_soon_as_they_are_complete() -> None:
    data = (FIXTURES / "completion-ngram-stream-usage.sse").read_bytes()
    first_end = data.index(b"\n\n") + 2
    relay = SseRelay(strip_usage=True)
    assert relay.feed(data[: first_end - 1]) == b""
    assert relay.feed(data[first_end - 1 : first_end]) == data[:first_end]


@pytest.mark.parametrize(
    "name", ["chat-ngram-stream-usage.sse", "completion-draft-stream-usage.sse"]
)
def test_client_asked_usage_passes_through_unchanged(name: str) -> None:
    data = (FIXTURES / name).read_bytes()
    relay = SseRelay(strip_usage=False)
    pieces = [data[i : i + 50] for i in range(0, len(data), 50)]
    assert relay_all(relay, pieces) == data
    usage = json_object(relay.usage_data or b"")
    assert usage is not None
    spec = usage["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] >= spec["num_accepted_draft_tokens"] > 0


def test_stream_cut_before_the_usage_chunk_is_forwarded_as_cut() -> None:
    data = (FIXTURES / "chat-ngram-stream-usage.sse").read_bytes()
    cut = data[: data.index(b'"choices":[]')]
    relay = SseRelay(strip_usage=True)
    assert relay_all(relay, [cut]) == cut
    assert relay.usage_data is None


def test_done_without_usage_releases_held_terminal_chunk_unchanged() -> None:
    terminal = b'data: {"id":"a","choices":[{"index":0,"text":"x","finish_reason":"length"}]}\n\n'
    stream = terminal + b"data: [DONE]\n\n"
    relay = SseRelay(strip_usage=True)
    assert relay_all(relay, [stream]) == stream


@pytest.mark.parametrize("strip_usage", [True, False])
@pytest.mark.parametrize(
    "name", ["completion-ngram-stream-usage.sse", "chat-draft-stream-usage.sse"]
)
def test_what_passes_is_what_feed_would_return_unchanged(name: str, strip_usage: bool) -> None:
    """The gateway forwards a read that ``passes`` as it came, skipping ``feed``: the
    client must get the same bytes as if every read had been fed."""
    data = (FIXTURES / name).read_bytes()
    events = [event + b"\n\n" for event in data.split(b"\n\n") if event]
    for size in (1, 2, 3):
        pieces = [b"".join(events[i : i + size]) for i in range(0, len(events), size)]
        fed, skipping = SseRelay(strip_usage=strip_usage), SseRelay(strip_usage=strip_usage)
        reference = [fed.feed(piece) for piece in pieces]
        passed = 0
        for piece, expected in zip(pieces, reference, strict=True):
            if skipping.passes(piece):
                passed += 1
                assert expected == piece
            else:
                assert skipping.feed(piece) == expected
        assert skipping.finish() == fed.finish()
        assert passed > 0
    # A partial event never passes, and neither does what follows it.
    relay = SseRelay(strip_usage=strip_usage)
    assert not relay.passes(events[0][:-1])
    assert relay.feed(events[0][:-1]) == b""
    assert not relay.passes(events[1])


@pytest.mark.parametrize(
    ("fingerprint", "stamped"),
    [
        (b'"fp-1"', b'"system_fingerprint":"fp-1"'),
        (b'"a\\"b"', b'"system_fingerprint":"a\\"b"'),  # an escaped quote: decoded
        (b"null", None),  # nothing to stamp, as vLLM would not
    ],
)
def test_terminal_chunk_gets_the_usage_chunks_fingerprint_as_json(
    fingerprint: bytes, stamped: bytes | None
) -> None:
    terminal = b'data: {"id":"a","choices":[{"index":0,"text":"x","finish_reason":"length"}]}\n\n'
    usage = (
        b'data: {"id":"a","choices":[],"usage":{"completion_tokens":1},"system_fingerprint":'
        + fingerprint
        + b"}\n\n"
    )
    relay = SseRelay(strip_usage=True)
    out = relay_all(relay, [terminal, usage, b"data: [DONE]\n\n"])
    if stamped is None:
        assert out == terminal + b"data: [DONE]\n\n"
    else:
        assert out == terminal.replace(b"}]}", b"}]," + stamped + b"}") + b"data: [DONE]\n\n"
    decoded = json_object(relay.usage_data or b"")
    assert decoded is not None and decoded["usage"]["completion_tokens"] == 1
