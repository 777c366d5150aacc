"""Fuzz the HTTP front of a real bloomery-serve (issue 4): random and mutated requests (methods, paths,
headers, bodies, JSON with wrong types, huge numbers, deep nesting, invalid UTF-8, truncated chunked
bodies) never crash the server, never answer 500 for a client error, and /health answers afterwards.

One server (a tiny synthetic qwen2 with the real tokenizer, so generation is quick) for the module;
the run is bounded by max_examples and a wall-clock budget (~60 s)."""
from __future__ import annotations

import json
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_proc import Served

pytestmark = [pytest.mark.real_model]
BUDGET_S = 60.0
ROUTES = ["/completion", "/completions", "/v1/completions", "/v1/chat/completions", "/chat/completions",
          "/tokenize", "/detokenize", "/apply-template", "/props", "/slots", "/metrics", "/health", "/v1/models",
          "/models", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/infill", "/embedding",
          "/api/show", "/api/tags", "/slots/0", "/v1/models/x", "/", "/nope"]
FIELDS = ["prompt", "messages", "n_predict", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
          "stream", "stop", "logit_bias", "n_probs", "logprobs", "top_logprobs", "tools", "tool_choice",
          "response_format", "grammar", "typical_p", "mirostat", "samplers", "content", "tokens", "n",
          "repeat_penalty", "repeat_last_n", "presence_penalty", "cache_prompt", "id_slot", "model", "system",
          "stream_options", "chat_template_kwargs", "with_pieces", "add_special", "input", "json_schema"]
HUGE = [10**30, -10**30, 2**31, 2**32, 2**63, -2**63 - 1, 1e308, -1e308, 1e-320, 0.5, -1, 0, 10**400]

scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(HUGE), st.integers(-2**40, 2**40),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS + ["role", "type", "text"]), inner,
                                                  max_size=4)), max_leaves=20)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x", 3]),
                                           "content": st.one_of(st.text(max_size=20), json_values)}), max_size=3)
bodies_obj = st.dictionaries(st.sampled_from(FIELDS), st.one_of(json_values, messages), max_size=6).map(
    lambda d: {**d, "n_predict": 2, "max_tokens": 2} if d.get("stream") is not True else {**d, "n_predict": 2})


def deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


raw_bodies = st.one_of(
    bodies_obj.map(lambda d: json.dumps(d).encode()),
    st.integers(50, 200_000).map(deep),
    st.integers(50, 200_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.binary(max_size=200),                                             # invalid UTF-8 and garbage
    bodies_obj.map(lambda d: json.dumps(d).encode()[:-3]),               # truncated JSON
    st.just(b'{"prompt": "\xff\xfe", "n_predict": 2}'),
    st.just(b'{"prompt": "a", "n_predict": NaN, "temperature": Infinity}'),
    st.just(b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
)
HEADER_SETS = st.lists(st.sampled_from([
    ("Content-Type", "application/json"), ("Content-Type", "text/plain"), ("Content-Encoding", "gzip"),
    ("Content-Encoding", "br"), ("Accept", "text/event-stream"), ("Expect", "100-continue"),
    ("Authorization", "Bearer x"), ("Origin", "http://x"), ("Connection", "keep-alive"),
    ("Transfer-Encoding", "gzip"), ("X-Junk", "\x01\x7f"), ("Range", "bytes=0-1")]), max_size=4, unique=True)
METHODS = st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH", "BREW", "G\x00T"])
PATHS = st.one_of(st.sampled_from(ROUTES), st.sampled_from(ROUTES).map(lambda p: p + "?x=%ff&y"),
                  st.text("/abc%ff.?#&=\\ ", max_size=30).map(lambda p: "/" + p))


API_POSTS = ["/completion", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/apply-template",
             "/v1/messages", "/v1/responses", "/infill"]


def post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


# the nasty cases every run sends, whatever hypothesis draws
NASTY = [post(p, b) for p in ("/completion", "/v1/chat/completions", "/tokenize") for b in (
    deep(100_000), b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    b'{"prompt": "\\udc00x", "content": "\\udfff", "n_predict": 2}',
    b'{"prompt": "\xff\xfe", "n_predict": 2}', b'{"prompt": "a", "n_predict": 1e400}')]


@st.composite
def requests(draw) -> bytes:
    """Half the draws are well-framed POSTs to an API route (the body is what is fuzzed), half anything."""
    if draw(st.booleans()):
        return post(draw(st.sampled_from(API_POSTS)), draw(raw_bodies))
    method, path, headers, body = draw(METHODS), draw(PATHS), draw(HEADER_SETS), draw(raw_bodies)
    framing = draw(st.sampled_from(["length", "chunked", "truncated-chunked", "short-length", "none"]))
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers)
    if framing == "chunked":
        head += "Transfer-Encoding: chunked\r\n"
        payload = (b"%x\r\n" % len(body) + body + b"\r\n" if body else b"") + b"0\r\n\r\n"
    elif framing == "truncated-chunked":
        head += "Transfer-Encoding: chunked\r\n"
        payload = b"%x\r\n" % (len(body) + 10) + body
    elif framing == "short-length":      # declares more than it sends: the body timeout or the close ends it
        head += f"Content-Length: {len(body) + 5}\r\n"
        payload = body
    elif framing == "length":
        head += f"Content-Length: {len(body)}\r\n"
        payload = body
    else:
        payload = b""
    return head.encode("latin-1", "replace") + b"\r\n" + payload


def exchange(port: int, data: bytes) -> bytes:
    """Send, half-close (a truncated request ends here), read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        try:
            c.sendall(data)
            c.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        out = b""
        try:
            while part := c.recv(65536):
                out += part
        except (ConnectionResetError, TimeoutError):
            pass
        return out


@pytest.fixture(scope="module")
def server(real_model_path, tmp_path_factory):
    from conftest import load_tool

    model = tmp_path_factory.mktemp("fuzz") / "tiny.gguf"
    load_tool("make_synthetic").write_synthetic(model, "qwen2", tokenizer_from=str(real_model_path))
    with Served("-m", str(model), "-c", "64", "-np", "2") as s:
        yield s


def health(port: int) -> int:
    answer = exchange(port, b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def test_fuzzed_requests_never_crash_or_500(server):
    started = time.monotonic()
    seen: list[tuple[int, bytes]] = []

    @settings(max_examples=400, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def one(data: bytes) -> None:
        check(data)

    def check(data: bytes) -> None:
        if time.monotonic() - started > BUDGET_S:
            return
        answer = exchange(server.port, data)
        assert server.proc.poll() is None, f"the server died on {data[:300]!r}"
        statuses = [int(m) for m in _statuses(answer)]
        seen.extend((s, data[:200]) for s in statuses)
        assert not [s for s in statuses if s == 500 or s > 503], f"{statuses} on {data[:300]!r}:\n{answer[:600]!r}"

    for data in NASTY:
        check(data)
    one()
    assert health(server.port) == 200
    errors = [ln for ln in server.lines if "handler error" in ln or "connection error" in ln or "Traceback" in ln]
    assert not errors, "\n".join(errors[:10])
    assert len(seen) > 50 and {s for s, _ in seen} & {200} and {s for s, _ in seen} & {400}


def _statuses(answer: bytes) -> list[bytes]:
    """Status codes of every response in the answer (100 Continue included; SSE bodies skipped roughly)."""
    import re
    return re.findall(rb"(?:^|\r\n)HTTP/1\.[01] (\d{3}) ", answer)


def test_server_answers_after_the_fuzz(server):
    assert health(server.port) == 200
