"""Instance URLs: what the gateway can reach, and how one is shown without its secret.

One home for both, used by the settings (refusing at ``config check`` what the gateway
could not run), the gateway's instances (the ``Host`` header, logs) and the API.
"""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit


def instance_url_problem(url: str) -> str | None:
    """Why the gateway cannot send requests to ``url``, or None when it can.

    The gateway's upstream client speaks plain HTTP/1.1 (no TLS) and sends each
    request's own path, so an instance is ``http://HOST[:PORT]`` with nothing after it.
    """
    try:
        parts = urlsplit(url.rstrip("/"))
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme != "http":
        return (
            f"scheme {parts.scheme or 'none'!r}: the gateway speaks plain HTTP to vLLM "
            "(http://HOST[:PORT]; put TLS in front of the gateway, not behind it)"
        )
    if not parts.hostname:
        return "no host"
    if parts.path or parts.query or parts.fragment:
        return (
            "a path, query or fragment: an instance is http://HOST[:PORT] "
            "(each request keeps its own path)"
        )
    try:
        host_header(url)
    except UnicodeError as exc:
        return f"a host name that cannot be sent ({exc})"
    return None


def host_header(url: str) -> bytes:
    """What an HTTP request to ``url`` says as ``Host``: host and port, never the user info."""
    return urlsplit(url).netloc.rpartition("@")[2].encode("idna")


def redact_url(url: str) -> str:
    """``url`` as it may be shown (API, logs): a password in its user info becomes
    ``***``, and so does user info without one (it is likely a token)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    shown = f"{user}:***" if colon else "***"
    return SplitResult(parts.scheme, f"{shown}@{hostport}", *parts[2:]).geturl()
