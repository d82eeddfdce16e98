"""Relaying a vLLM server-sent-event stream event by event, and undoing the usage chunk.

vLLM streams ``data: {json}\\n\\n`` events. To measure speculation on a stream the gateway
asks for ``stream_options.include_usage`` even when the client did not; vLLM then
(a) appends a usage chunk (``"choices":[]``, with ``usage`` and ``metrics``) before
``data: [DONE]`` and (b) stops stamping ``system_fingerprint`` on the terminal chunks
(those whose choice has a ``finish_reason``) because the usage chunk carries it. To give
the client exactly what vLLM would have sent it, :class:`SseRelay` holds a terminal chunk
back until the usage chunk arrives (vLLM sends it right after), stamps the fingerprint
onto it the way vLLM would have, and drops the usage chunk.

Only complete events are forwarded; an event split across reads waits for its end. The
common event goes through as the bytes vLLM sent, unparsed: the relay looks for two byte
markers and decodes JSON only for the one usage chunk.
"""

from __future__ import annotations

import json
from typing import Any

_EVENT_END = b"\n\n"
# Raw quotes cannot occur inside a JSON string value (they are escaped there), so these
# markers only match keys: a choice whose finish_reason is a string, and the usage chunk.
_FINISH_MARK = b'"finish_reason":"'
_USAGE_MARK = b'"choices":[]'
_DONE = b"data: [DONE]"
_DATA = b"data: "


class SseRelay:
    """Feed it the upstream body as it arrives; it returns what to send the client now.

    ``strip_usage`` is True when the gateway added ``include_usage`` itself. The parsed
    usage chunk, when one arrived, is in :attr:`usage_chunk` afterwards either way.
    """

    __slots__ = ("_held", "_pending", "strip_usage", "usage_chunk")

    def __init__(self, *, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage_chunk: dict[str, Any] | None = None
        self._pending = b""
        self._held: list[bytes] = []

    def feed(self, data: bytes) -> bytes:
        """Bytes to forward now: every event completed by ``data``, possibly rewritten."""
        if self._pending:
            data = self._pending + data
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._pending = data
            return b""
        end += len(_EVENT_END)
        complete, self._pending = data[:end], data[end:]
        if _USAGE_MARK in complete or (
            self.strip_usage and (self._held or _FINISH_MARK in complete)
        ):
            return self._rewrite(complete)
        return complete

    def passes(self, data: bytes) -> bool:
        """Whether :meth:`feed` would return ``data`` unchanged and keep nothing back: it
        holds only complete events, none of which is rewritten, and nothing is pending
        or held. A caller may then forward ``data`` itself and skip :meth:`feed`."""
        return (
            not self._pending
            and not self._held
            and data.endswith(_EVENT_END)
            and _USAGE_MARK not in data
            and not (self.strip_usage and _FINISH_MARK in data)
        )

    def finish(self) -> bytes:
        """What is left when the upstream body ends: held chunks unstamped, then any
        trailing partial event, so a stream cut short is forwarded as it was cut."""
        rest = b"".join(self._held) + self._pending
        self._held.clear()
        self._pending = b""
        return rest

    def _rewrite(self, complete: bytes) -> bytes:
        out: list[bytes] = []
        held = self._held
        for event in complete.split(_EVENT_END)[:-1]:
            framed = event + _EVENT_END
            if _USAGE_MARK in event and event.startswith(_DATA):
                chunk = _usage_chunk(event[len(_DATA) :])
                if chunk is not None:
                    self.usage_chunk = chunk
                    if self.strip_usage:
                        out.extend(_stamp(e, chunk.get("system_fingerprint")) for e in held)
                        held.clear()
                        continue
            if self.strip_usage and (held or _FINISH_MARK in event):
                if event.startswith(_DONE):
                    # No usage chunk came (an error ended the stream): forward as is.
                    out.extend(held)
                    held.clear()
                    out.append(framed)
                else:
                    held.append(framed)
                continue
            out.append(framed)
        return b"".join(out)


def _usage_chunk(data: bytes) -> dict[str, Any] | None:
    try:
        chunk = json.loads(data)
    except ValueError:
        return None
    if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
        return chunk
    return None


def _stamp(framed: bytes, fingerprint: object) -> bytes:
    """Put ``system_fingerprint`` where vLLM's serializer puts it on a terminal chunk.

    The field follows ``choices`` (and ``usage``, absent here) in vLLM's response model,
    and the later fields (``metrics``, ``prompt_token_ids``…) are not set on a terminal
    chunk, so it goes right after the closing ``}]`` of the choices array.
    """
    if not isinstance(fingerprint, str) or _FINISH_MARK not in framed:
        return framed
    at = framed.rfind(b"}]")
    if at < 0:
        return framed
    at += 2
    stamp = b',"system_fingerprint":' + json.dumps(fingerprint).encode()
    return framed[:at] + stamp + framed[at:]
