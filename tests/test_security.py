"""Security and limits on a real bloomery-serve (issue 4, serving guide 8.1 and 11.1): API keys from
every source, public routes, keys never in the records, CORS as llama-server answers it, the
loopback Host guard, the 64 MiB body bound (declared, chunked, decoded), codings, header size."""
from __future__ import annotations

import gzip
import json
import socket
import zlib

import pytest

from bloomery.http import guard
from serve_proc import Served

pytestmark = [pytest.mark.real_model]
KEYS = ("sk-cmd-one", "sk-cmd-two", "sk-file-three", "sk-env-four")
LIMIT = 64 << 20


@pytest.fixture(scope="module")
def server(real_model_path, tmp_path_factory):
    from conftest import load_tool

    tmp = tmp_path_factory.mktemp("sec")
    model = tmp / "tiny.gguf"
    load_tool("make_synthetic").write_synthetic(model, "qwen2", tokenizer_from=str(real_model_path))
    key_file = tmp / "keys"
    key_file.write_text(f"# comment\n\n{KEYS[2]}\n")
    with Served("-m", str(model), "-c", "64", "--api-key", f"{KEYS[0]},{KEYS[1]}", "--api-key-file", str(key_file),
                env={"LLAMA_API_KEY": KEYS[3]}) as s:
        yield s


def raw(server, data: bytes, read_s: float = 30) -> tuple[int, dict, bytes]:
    """Send bytes, read one answer (the server closes or sends Content-Length); status, headers, body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=read_s) as c:
        try:
            c.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass   # the server answered and closed before we finished: read its answer
        buf = b""
        while b"\r\n\r\n" not in buf:
            part = c.recv(65536)
            if not part:
                break
            buf += part
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        n = int(headers.get("content-length", 0))
        while len(body) < n:
            part = c.recv(65536)
            if not part:
                break
            body += part
        return int(lines[0].split()[1]), headers, body


def request(server, method: str, path: str, headers: dict | None = None, body: bytes = b"") -> tuple[int, dict, dict]:
    hs = {"Host": f"127.0.0.1:{server.port}", "Content-Length": str(len(body)), "Connection": "close",
          **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hs.items()) + "\r\n"
    status, rh, rb = raw(server, head.encode("latin-1") + body)
    return status, rh, json.loads(rb) if rb.strip().startswith(b"{") else {}


TOKENIZE = json.dumps({"content": "hello"}).encode()


@pytest.mark.parametrize("key,header", [(KEYS[0], "Authorization"), (KEYS[1], "X-Api-Key"),
                                         (KEYS[2], "Authorization"), (KEYS[3], "X-Api-Key")])
def test_every_key_source_admits(server, key, header):
    value = f"Bearer {key}" if header == "Authorization" else key
    status, _, body = request(server, "POST", "/tokenize", {header: value}, TOKENIZE)
    assert status == 200 and body["tokens"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-cmd-on"}, {"Authorization": "Bearer  sk-cmd-one"},
                                     {"X-Api-Key": "Bearer"}, {"Authorization": "Bearer " + KEYS[0] + "x"},
                                     {"Authorization": "Basic " + KEYS[0]}])
@pytest.mark.parametrize("path", ["/tokenize", "/completion", "/v1/chat/completions", "/props", "/slots"])
def test_no_or_wrong_key_is_401(server, headers, path):
    status, _, body = request(server, "POST" if path not in ("/props", "/slots") else "GET", path, headers, TOKENIZE)
    assert status == 401
    assert body["error"] == {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}


@pytest.mark.parametrize("path", ["/health", "/v1/health", "/v1/models", "/models"])
def test_public_routes_need_no_key(server, path):
    status, _, body = request(server, "GET", path)
    assert status == 200 and "error" not in body


def test_denied_request_is_answered_before_its_body(server):
    """401 on the headers: no 100 Continue, the declared 1 MB never sent."""
    head = (f"POST /completion HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\n"
            f"Content-Length: {1 << 20}\r\n\r\n").encode()
    status, _, body = raw(server, head, read_s=10)
    assert status == 401 and b"Invalid API Key" in body


def test_keys_never_reach_the_records(server):
    for k in KEYS:
        request(server, "POST", "/tokenize", {"Authorization": f"Bearer {k}"}, TOKENIZE)
        request(server, "POST", "/tokenize", {"Authorization": f"Bearer {k}-wrong"}, TOKENIZE)
    text = "\n".join(server.lines)
    assert "Invalid API Key" in text           # the refusals were recorded ...
    assert not [k for k in KEYS if k in text]  # ... and no key (nor a key-prefixed guess) was printed


@pytest.mark.parametrize("origin", ["localhost", "web.mydomain.fr", "http://127.0.0.1:3000"])
def test_cors_preflight_with_a_key_allows_any_origin_without_credentials(server, origin):
    status, headers, _ = request(server, "OPTIONS", "/completions", {
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"})
    assert status == 200
    assert headers["access-control-allow-origin"] == "*"
    assert headers["access-control-allow-credentials"] == "false"
    assert headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert headers["access-control-allow-headers"] == "*"


def test_every_answer_carries_the_cors_origin(server):
    _, ok, _ = request(server, "GET", "/health", {"Origin": "http://a.example"})
    _, denied, _ = request(server, "GET", "/props", {"Origin": "http://a.example"})
    assert ok["access-control-allow-origin"] == denied["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("host,status", [("evil.example", 403), ("evil.example:8080", 403), ("127.0.0.1.nip.io", 403),
                                         ("localhost", 200), ("localhost:1", 200), ("127.0.0.1", 200),
                                         ("[::1]:80", 200), ("app.localhost", 200)])
def test_host_guard_on_loopback(server, host, status):
    got, _, body = request(server, "GET", "/health", {"Host": host})
    assert got == status
    if status == 403:
        assert body["error"]["type"] == "permission_error" and host.split(":")[0] in body["error"]["message"]


def test_host_guard_is_off_when_not_bound_to_loopback():
    assert guard.host_refusal("0.0.0.0", {"host": "evil.example"}) is None
    assert guard.host_refusal("10.1.2.3", {"host": "evil.example"}) is None
    assert guard.host_refusal("::1", {"host": "evil.example"}) is not None
    assert guard.host_refusal("127.0.0.1", {}) is None          # HTTP/1.0 without Host


def test_key_compare_checks_every_key():
    keys = (b"a" * 10, b"b" * 10)
    assert guard.key_matches(b"b" * 10, keys) and not guard.key_matches(b"b" * 9, keys)
    assert guard.offered_key({"authorization": "Bearer k", "x-api-key": "z"}) == b"k"
    assert guard.offered_key({"x-api-key": "z"}) == b"z"


AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


def test_declared_body_over_64mib_is_413_before_it_is_sent(server):
    head = (f"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Length: {LIMIT + 1}\r\n\r\n").encode()
    status, _, body = raw(server, head, read_s=10)
    assert status == 413 and str(LIMIT) in body.decode()


def test_chunked_body_over_64mib_is_413(server):
    chunk = b"x" * (1 << 20)
    data = (f"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    data += (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 65 + b"0\r\n\r\n"
    status, _, body = raw(server, data)
    assert status == 413 and b"chunked" in body


@pytest.mark.parametrize("coding,pack", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_compressed_bomb_stops_at_the_limit(server, coding, pack):
    bomb = pack(b"{" + b" " * (LIMIT + 10) + b"}")     # ~65 KB that decodes to 64 MiB and more
    assert len(bomb) < 1 << 20
    status, _, body = request(server, "POST", "/tokenize", {**AUTH, "Content-Encoding": coding}, bomb)
    assert status == 413 and "decodes" in body["error"]["message"]


@pytest.mark.parametrize("coding", ["gzip", "x-gzip", "deflate"])
def test_compressed_body_is_read(server, coding):
    data = zlib.compress(TOKENIZE) if coding == "deflate" else gzip.compress(TOKENIZE)
    status, _, body = request(server, "POST", "/tokenize", {**AUTH, "Content-Encoding": coding}, data)
    assert status == 200 and body["tokens"]


@pytest.mark.parametrize("coding", ["br", "zstd", "gzip, gzip"])
def test_other_codings_are_415_naming_gzip_and_deflate(server, coding):
    status, headers, body = request(server, "POST", "/tokenize", {**AUTH, "Content-Encoding": coding}, TOKENIZE)
    assert status == 415 and headers["accept-encoding"] == "gzip, deflate"
    assert "gzip, deflate" in body["error"]["message"]


def test_header_section_over_64kib_is_431(server):
    status, _, body = request(server, "GET", "/health", {"X-Big": "a" * (70 << 10)})
    assert status == 431 and "header" in body["error"]["message"]


def test_server_still_answers(server):
    status, _, body = request(server, "POST", "/tokenize", AUTH, TOKENIZE)
    assert status == 200 and body["tokens"]


# --cors-origins: "*", "localhost", or a list (llama.cpp's test_cors_origins_localhost_*)
@pytest.mark.parametrize("origin,origins,allowed", [
    ("http://evil.com", "*", True),
    ("http://localhost:8080", "localhost", True), ("http://127.0.0.1", "localhost", True),
    ("http://[::1]:3000", "localhost", True), ("http://localhost.evil.com", "localhost", False),
    ("http://notlocalhost", "localhost", False), ("http://web.mydomain.fr", "localhost", False),
    ("https://a.example", "https://a.example, https://b.example", True),
    ("https://c.example", "https://a.example,https://b.example", False),
])
def test_cors_origins_setting(origin, origins, allowed):
    from bloomery.http import guard
    got = dict(guard.preflight_headers({"origin": origin}, guard.Cors(origins)))
    assert ("access-control-allow-origin" in got) == allowed
    if allowed:
        assert got["access-control-allow-origin"] == ("*" if origins == "*" else origin)
    # credentials are never allowed beside "*" (llama-server echoes the Origin with credentials there)
    assert got["access-control-allow-credentials"] == ("false" if origins == "*" else "true")


@pytest.mark.parametrize("argv,env,origins", [
    ([], {}, "localhost"), (["--api-key", "k"], {}, "*"), (["--cors-origins", "*"], {}, "*"),
    ([], {"LLAMA_ARG_CORS_ORIGINS": "https://a.example"}, "https://a.example"),
    (["--api-key", "k", "--cors-origins", "localhost"], {}, "localhost"),
])
def test_cors_default_is_localhost_without_a_key(argv, env, origins, monkeypatch):
    from bloomery import settings
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert settings.parse(["-m", "x.gguf", *argv]).cors_origins == origins


def test_cors_methods_headers_and_credentials_flags(monkeypatch):
    from bloomery import settings
    from bloomery.http import guard
    s = settings.parse(["-m", "x.gguf", "--cors-origins", "https://a.example", "--cors-methods", "GET, POST",
                        "--cors-headers", "Authorization", "--no-cors-credentials"])
    got = dict(guard.preflight_headers({"origin": "https://a.example"},
                                       guard.Cors(s.cors_origins, s.cors_methods, s.cors_headers, s.cors_credentials)))
    assert got == {"access-control-allow-origin": "https://a.example", "vary": "Origin",
                   "access-control-allow-credentials": "false", "access-control-allow-methods": "GET, POST",
                   "access-control-allow-headers": "Authorization"}
    monkeypatch.setenv("LLAMA_ARG_CORS_CREDENTIALS", "0")
    assert settings.parse(["-m", "x.gguf"]).cors_credentials is False


def test_api_key_on_the_command_line_is_warned_about(tmp_path):
    from bloomery import settings
    warned = [m for m, kv in settings.parse(["-m", "x.gguf", "--api-key", "k"]).notes if "visible" in m]
    assert warned and "--api-key-file" in warned[0]
    (tmp_path / "keys").write_text("k\n")
    assert not [m for m, kv in settings.parse(["-m", "x.gguf", "--api-key-file", str(tmp_path / "keys")]).notes
                if "visible" in m]


