"""The gate's pure checks: API keys, the loopback Host guard, CORS headers (no I/O; front.Gate calls them).

Keys: llama-server reads `Authorization` (a "Bearer " prefix is dropped) and, when
that header is absent, `X-Api-Key`. Each offered key is compared with every
configured key through hmac.compare_digest, all of them every time, so the
answer's timing says nothing about how much of a key matched or which one.

Host guard (DNS rebinding): a page on evil.example whose name is re-pointed at
127.0.0.1 makes the browser send requests to a server bound to loopback with
`Host: evil.example`. A server bound to a loopback address answers only Host
names that are loopback (localhost, *.localhost, 127.0.0.0/8, ::1); one bound
elsewhere (--host 0.0.0.0, a LAN address) is meant to be reached by other names
and is not checked. llama-server has no such check; a loopback client always
sends one of these names unless it was configured to lie.

CORS (llama-server's flags --cors-origins, --cors-methods, --cors-headers,
--cors-credentials): "*" answers `Access-Control-Allow-Origin: *` and never allows
credentials (llama-server echoes the Origin with credentials there, which lets any page
send the browser's credentials); "localhost" echoes an Origin on localhost, 127.0.0.1 or
[::1]; a list echoes an Origin in it (with `Vary: Origin`). Without --cors-origins the
default is "localhost" when no API key is set (any web page could otherwise drive a
keyless server through the visitor's browser) and "*" with a key. OPTIONS is answered
200 with an empty body and the allowed methods and headers.
"""
from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_HEADERS = "*"


def offered_key(headers: dict[str, str]) -> bytes:
    """The key a request offers, as llama-server reads it (Authorization first, then X-Api-Key)."""
    value = headers.get("authorization") or headers.get("x-api-key") or ""
    if value.startswith("Bearer "):
        value = value[len("Bearer "):]
    return value.encode("latin-1", "replace")   # headers were decoded latin-1: these are the bytes sent


def key_matches(offered: bytes, keys: tuple[bytes, ...]) -> bool:
    """Constant-time over every key: no early exit, no short-circuit on length."""
    hits = [hmac.compare_digest(offered, k) for k in keys]
    return any(hits)


def is_loopback_host(name: str) -> bool:
    """A host name or address (no port, IPv6 without brackets) that can only mean this machine."""
    name = name.strip().rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name part of a Host header: "[::1]:8080" -> "::1", "localhost:80" -> "localhost"."""
    h = host_header.strip()
    if h.startswith("["):
        return h[1:].split("]", 1)[0]
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h


def host_refusal(listen_host: str, headers: dict[str, str]) -> str | None:
    """Why this Host is refused (None: allowed). Only a server bound to loopback checks."""
    if not listen_host or not is_loopback_host(listen_host):
        return None
    host = headers.get("host")
    if host is None:          # HTTP/1.0 may leave it out; a browser never does
        return None
    if is_loopback_host(host_name(host)):
        return None
    return (f"Host header {host[:200]!r} is not a loopback name: this server listens on {listen_host} and "
            "answers only Host localhost, 127.0.0.1 or [::1] (a guard against DNS rebinding); "
            "start it with --host 0.0.0.0 (and an API key) to serve it under other names")


@dataclass(frozen=True)
class Cors:
    origins: str = "localhost"
    methods: str = CORS_METHODS
    headers: str = CORS_HEADERS
    credentials: bool = True


def origin_allowed(origin: str, origins: str = "*") -> bool:
    """--cors-origins: "*" any origin; "localhost" an origin whose host is localhost, 127.0.0.1 or
    [::1] (any scheme and port); else a comma list of exact origins."""
    if origins.strip() == "*":
        return True
    if origins.strip() == "localhost":
        from urllib.parse import urlsplit
        try:
            host = urlsplit(origin).hostname or ""
        except ValueError:
            return False
        return host in ("localhost", "127.0.0.1", "::1")
    return origin in {o.strip() for o in origins.split(",") if o.strip()}


def cors_headers(headers: dict[str, str], cors: Cors) -> list[tuple[str, str]]:
    """What every answer carries: `*` under --cors-origins "*", else the Origin echoed when allowed."""
    if cors.origins.strip() == "*":
        return [("access-control-allow-origin", "*")]
    origin = headers.get("origin")
    if not origin or not origin_allowed(origin, cors.origins):
        return [("vary", "Origin")]
    return [("access-control-allow-origin", origin), ("vary", "Origin")]


def credentials_allowed(cors: Cors) -> bool:
    return cors.credentials and cors.origins.strip() != "*"


def preflight_headers(headers: dict[str, str], cors: Cors) -> list[tuple[str, str]]:
    """OPTIONS' answer headers, as llama-server writes them (credentials never beside `*`)."""
    return [*cors_headers(headers, cors),
            ("access-control-allow-credentials", "true" if credentials_allowed(cors) else "false"),
            ("access-control-allow-methods", cors.methods), ("access-control-allow-headers", cors.headers)]
