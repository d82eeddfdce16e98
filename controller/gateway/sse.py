"""Relaying a vLLM server-sent-event stream event by event, and undoing the usage chunk.

vLLM streams ``data: {json}\\n\\n`` events. To measure speculation on a stream the gateway
asks for ``stream_options.include_usage`` even when the client did not; vLLM then
(a) appends a usage chunk (``"choices":[]``, with ``usage`` and ``metrics``) before
``data: [DONE]`` and (b) stops stamping ``system_fingerprint`` on the terminal chunks
(those whose choice has a ``finish_reason``) because the usage chunk carries it. To give
the client exactly what vLLM would have sent it, :class:`SseRelay` holds a terminal chunk
back until the usage chunk arrives (vLLM sends it right after), stamps the fingerprint
onto it the way vLLM would have, and drops the usage chunk.

Only complete events are forwarded; an event split across reads waits for its end. Every
event goes through as the bytes vLLM sent, unparsed: the relay looks for byte markers, and
the usage chunk is kept as received (:attr:`SseRelay.usage_data`) and decoded by the
observation, after the client has its response: decoding it (its metrics are mostly
floats) is work the client need not wait for.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

_EVENT_END = b"\n\n"
# Raw quotes cannot occur inside a JSON string value (they are escaped there), so these
# markers only match keys: a choice whose finish_reason is a string, and the usage chunk.
_FINISH_MARK = b'"finish_reason":"'
_USAGE_MARK = b'"choices":[]'
_USAGE_KEY = b'"usage":{'
_FINGERPRINT_KEY = b'"system_fingerprint":'
_DONE = b"data: [DONE]"
_DATA = b"data: "


class SseRelay:
    """Feed it the upstream body as it arrives; it returns what to send the client now.

    ``strip_usage`` is True when the gateway added ``include_usage`` itself. The usage
    chunk's JSON, when one arrived, is in :attr:`usage_data` afterwards either way
    (:func:`json_object` decodes it).
    """

    __slots__ = ("_held", "_pending", "strip_usage", "usage_data")

    def __init__(self, *, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.usage_data: bytes | None = None
        """The usage chunk's JSON as received, when one came."""
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
            if _USAGE_MARK in event and _USAGE_KEY in event and event.startswith(_DATA):
                self.usage_data = event[len(_DATA) :]
                if self.strip_usage:
                    fingerprint = _fingerprint(event)
                    out.extend(_stamp(e, fingerprint) for e in held)
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


def json_object(data: bytes) -> dict[str, Any] | None:
    """``data`` decoded, when it is a JSON object; None otherwise."""
    try:
        document = orjson.loads(data)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def _fingerprint(event: bytes) -> bytes | None:
    """The ``system_fingerprint`` string of a usage chunk as JSON text (quotes included),
    read off the bytes; None when it is absent or not a string."""
    at = event.find(_FINGERPRINT_KEY)
    if at < 0:
        return None
    at += len(_FINGERPRINT_KEY)
    if event[at : at + 1] != b'"':
        return None  # null
    end = event.find(b'"', at + 1)
    if end > 0 and event[end - 1 : end] == b"\\":
        # An escaped quote inside the string (never in vLLM's own fingerprints): decode.
        chunk = json_object(event[len(_DATA) :])
        value = chunk.get("system_fingerprint") if chunk is not None else None
        return json.dumps(value).encode() if isinstance(value, str) else None
    return event[at : end + 1] if end > 0 else None


def _stamp(framed: bytes, fingerprint: bytes | None) -> bytes:
    """Put ``system_fingerprint`` (JSON text) where vLLM's serializer puts it on a
    terminal chunk.

    The field follows ``choices`` (and ``usage``, absent here) in vLLM's response model,
    and the later fields (``metrics``, ``prompt_token_ids``…) are not set on a terminal
    chunk, so it goes right after the closing ``}]`` of the choices array.
    """
    if fingerprint is None or _FINISH_MARK not in framed:
        return framed
    at = framed.rfind(b"}]")
    if at < 0:
        return framed
    at += 2
    return b"".join((framed[:at], b",", _FINGERPRINT_KEY, fingerprint, framed[at:]))
