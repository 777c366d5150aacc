"""--host with several addresses (one socket each, one port) and --alias / --tags lists, as
llama-server takes them (llama.cpp's test_basic: multiple addresses, aliases and tags)."""
from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from tests.conftest import load_tool
from tests.serve_proc import Served


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def tiny(tokenizer_source, tmp_path_factory):
    return load_tool("make_synthetic").write_synthetic(tmp_path_factory.mktemp("m") / "tiny.gguf", "qwen2",
                                                        tokenizer_from=str(tokenizer_source))


def _get(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, json.loads(r.read())


def test_several_addresses_one_port(tiny):
    if not _ipv6_loopback():
        pytest.skip("IPv6 loopback is unavailable")
    with Served("-m", str(tiny), "--host", "127.0.0.1,::1") as srv:
        assert _get(f"http://127.0.0.1:{srv.port}/health")[0] == 200
        assert _get(f"http://[::1]:{srv.port}/health")[0] == 200
        assert sum("listening" in line for line in srv.lines) == 2


def test_alias_list_and_tags(tiny):
    with Served("-m", str(tiny), "--alias", "tinyllama-2,fim,code", "--tags", "chat,fim,small") as srv:
        status, body = _get(srv.url + "/v1/models")
        model = body["data"][0]
        assert (status, model["id"]) == (200, "code")          # the first in sorted order
        assert set(model["aliases"]) == {"tinyllama-2", "fim", "code"}
        assert set(model["tags"]) == {"chat", "fim", "small"}
        assert _get(srv.url + "/v1/models/fim")[1]["id"] == "code"


def test_bad_address_in_the_list_is_refused_by_name(tiny):
    srv = Served("-m", str(tiny), "--host", "127.0.0.1,192.0.2.1")
    with pytest.raises(RuntimeError) as e:
        srv.start()
    assert "192.0.2.1" in str(e.value)
