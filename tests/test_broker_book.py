"""The broker's pure bookkeeping: need records, fit, strict FIFO, leases, state round trip, capacity, config."""
from __future__ import annotations

import pytest

from bloomery.broker import protocol
from bloomery.broker.book import Book, Capacity, Need, NeedError, parse_need
from bloomery.broker.capacity import ConfigError, capacity_from, cgroup_limit_bytes, parse_size, read_config

GIB = 1 << 30


def need(pid, host, cards=()):
    return Need(pid=pid, host_bytes=host, card_bytes=tuple(cards))


def test_parse_need_accepts_the_supervisor_record():
    n = parse_need({"version": 1, "pid": 42, "unit": "bloomery@a.service", "model": "m.gguf",
                    "host_bytes": 5, "card_bytes": [0, 7], "disk_bytes": 9})
    assert n == Need(42, 5, (0, 7), 9, "bloomery@a.service", "m.gguf")


@pytest.mark.parametrize("rec, named", [
    ([], "expected a JSON object"),
    ({"host_bytes": 1}, "'pid': missing"),
    ({"pid": 0, "host_bytes": 1}, "'pid': 0 is not a process id"),
    ({"pid": "1", "host_bytes": 1}, "'pid': expected a non-negative integer"),
    ({"pid": 1}, "'host_bytes': missing"),
    ({"pid": 1, "host_bytes": -1}, "'host_bytes': -1 is outside"),
    ({"pid": 1, "host_bytes": True}, "'host_bytes': expected a non-negative integer"),
    ({"pid": 1, "host_bytes": 1, "card_bytes": 5}, "'card_bytes': expected a list"),
    ({"pid": 1, "host_bytes": 1, "card_bytes": [1, "x"]}, "'card_bytes[1]'"),
    ({"pid": 1, "host_bytes": 1, "card_bytes": [0] * 65}, "the bound is 64"),
    ({"pid": 1, "host_bytes": 1, "unit": 3}, "'unit': expected a string"),
    ({"pid": 1, "host_bytes": 1, "model": "x" * 600}, "'model': 600 characters"),
    ({"pid": 1, "host_bytes": 1, "gpu": 2}, "unknown field(s) 'gpu'"),
    ({"pid": 1, "host_bytes": 1, "version": 2}, "'version': 2 is not supported"),
])
def test_parse_need_refuses_by_name(rec, named):
    with pytest.raises(NeedError) as e:
        parse_need(rec)
    assert named in str(e.value)


def test_fifo_grants_in_order_and_no_later_need_jumps_an_earlier_one():
    b = Book(Capacity(10 * GIB))
    b.enqueue("a", need(1, 6 * GIB), 1.0, 0)
    assert [e.id for e in b.grant(0)] == ["a"]
    b.enqueue("big", need(2, 8 * GIB), 2.0, 0)       # does not fit beside a
    b.enqueue("small", need(3, 1 * GIB), 3.0, 0)     # would fit, but is behind big
    assert b.grant(0) == []
    assert b.position("big") == 1 and b.position("small") == 2
    assert "host: needs 8589934592, free 4294967296" in b.waits_for("big") and "lease(s) a" in b.waits_for("big")
    assert "behind big" in b.waits_for("small")
    assert b.remove("a") == "lease"
    assert [e.id for e in b.grant(0)] == ["big", "small"]
    assert b.held().host_bytes == 9 * GIB


def test_cards_fit_per_card():
    b = Book(Capacity(100 * GIB, (10 * GIB, 10 * GIB)))
    b.enqueue("a", need(1, 0, (8 * GIB, 0)), 1.0, 0)
    b.enqueue("b", need(2, 0, (0, 8 * GIB)), 2.0, 0)
    b.enqueue("c", need(3, 0, (3 * GIB,)), 3.0, 0)
    assert [e.id for e in b.grant(0)] == ["a", "b"]
    assert "card 0: needs 3221225472, free 2147483648" in b.waits_for("c")


@pytest.mark.parametrize("n, named", [
    (need(1, 11 * GIB), "host_bytes 11811160064 (11.00 GiB) is larger than the host can ever grant"),
    (need(1, 0, (0, 0, 1)), "card_bytes[2] 1 names card 2; the host has 2 card(s)"),
    (need(1, 0, (0, 5 * GIB)), "card_bytes[1] 5368709120 (5.00 GiB) is larger than card 1 can ever grant"),
])
def test_a_need_larger_than_the_host_is_refused_not_queued(n, named):
    b = Book(Capacity(10 * GIB, (4 * GIB, 4 * GIB)))
    with pytest.raises(NeedError) as e:
        b.enqueue("x", n, 1.0, 0)
    assert named in str(e.value)
    assert b.queue == []


def test_one_need_per_process_and_ids_are_checked():
    b = Book(Capacity(10 * GIB))
    b.enqueue("a", need(1, GIB), 1.0, 0)
    with pytest.raises(NeedError, match="pid 1 already has a"):
        b.enqueue("b", need(1, GIB), 1.0, 0)
    b.enqueue("c", need(1, GIB), 9.0, 0)             # same pid number, another process (pid reuse)
    with pytest.raises(NeedError, match="request field 'id'"):
        b.enqueue("bad id/", need(5, GIB), 1.0, 0)


def test_prune_drops_dead_leases_and_queued_needs():
    b = Book(Capacity(10 * GIB))
    for i, pid in enumerate((1, 2, 3)):
        b.enqueue(f"e{pid}", need(pid, 4 * GIB), float(i), 0)
    b.grant(0)
    gone = b.prune(lambda e: e.need.pid != 1 and e.need.pid != 3)
    assert sorted((w, e.id) for w, e in gone) == [("lease", "e1"), ("queued", "e3")]
    assert list(b.leases) == ["e2"] and b.queue == []


def test_state_round_trip_keeps_leases_and_queue_order():
    b = Book(Capacity(10 * GIB))
    for pid in (1, 2, 3, 4):
        b.enqueue(f"e{pid}", need(pid, 4 * GIB), float(pid), 0)
    b.grant(0)
    b.leases["e1"].kids = [(77, 5.5)]
    c = Book(Capacity(10 * GIB))
    c.load(b.to_dict())
    assert list(c.leases) == ["e1", "e2"] and [e.id for e in c.queue] == ["e3", "e4"]
    assert c.leases["e1"].kids == [(77, 5.5)] and c.leases["e1"].start_time == 1.0
    c.enqueue("e5", need(5, GIB), 5.0, 0)
    assert c.queue[-1].seq > max(e.seq for e in c.queue[:-1])


def test_capacity_caps_and_reserves():
    cfg = {"host": {"cap_bytes": 8 * GIB, "reserve_bytes": GIB}, "cards": {"reserve_bytes": GIB},
           "card": {1: {"cap_bytes": 5 * GIB}}}
    cap = capacity_from(16 * GIB, 12 * GIB, [(1, 10 * GIB), (1, 10 * GIB)], cfg)
    assert cap == Capacity(7 * GIB, (9 * GIB, 4 * GIB))
    assert capacity_from(16 * GIB, 6 * GIB, [], {}) == Capacity(6 * GIB, ())      # the cgroup limit wins


def test_cgroup_limits_v2_and_v1(tmp_path):
    (tmp_path / "system.slice" / "b.service").mkdir(parents=True)
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "system.slice" / "memory.max").write_text(f"{3 * GIB}\n")
    (tmp_path / "system.slice" / "b.service" / "memory.max").write_text(f"{5 * GIB}\n")
    pc = tmp_path / "cgroup"
    pc.write_text("0::/system.slice/b.service\n")
    assert cgroup_limit_bytes(tmp_path, pc) == 3 * GIB
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker").mkdir(parents=True)
    (v1 / "memory" / "docker" / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    pc.write_text("4:memory:/docker\n")
    assert cgroup_limit_bytes(v1, pc) == 2 * GIB


def test_config_sizes_and_refusals(tmp_path):
    assert parse_size("1.5GiB", "x") == 3 * GIB // 2 and parse_size(12, "x") == 12
    assert parse_size("2 MB", "x") == 2 * 10**6
    p = tmp_path / "b.toml"
    p.write_text('[host]\ncap_bytes = "4GiB"\n[cards]\nreserve_bytes = 10\n[cards.0]\ncap_bytes = 99\n')
    assert read_config(str(p)) == {"host": {"cap_bytes": 4 * GIB}, "cards": {"reserve_bytes": 10},
                                   "card": {0: {"cap_bytes": 99}}}
    for text, named in [('[host]\ncap = 1\n', "host: unknown key 'cap'"), ('[hosts]\n', "unknown table(s) hosts"),
                        ('[host]\ncap_bytes = "lots"\n', "host.cap_bytes: expected bytes"),
                        ('[host\n', "not TOML")]:
        p.write_text(text)
        with pytest.raises(ConfigError) as e:
            read_config(str(p))
        assert named in str(e.value) and str(p) in str(e.value)


@pytest.mark.parametrize("frames, named", [
    ([b"a", b"b"], "expected one frame"),
    ([b"x" * (protocol.MAX_REQUEST_BYTES + 1)], f"the bound is {protocol.MAX_REQUEST_BYTES} bytes"),
    ([b"\xff"], "not UTF-8"),
    ([b"{"], "not JSON"),
    ([b"[]"], "expected a JSON object, got list"),
    ([b'{"op": "grab"}'], "request field 'op': 'grab'"),
    ([b'{"op": "need", "id": 3, "need": {}}'], "request field 'id'"),
    ([b'{"op": "need", "id": "a"}'], "request field 'need': missing"),
])
def test_requests_refused_by_name(frames, named):
    with pytest.raises(protocol.RequestError) as e:
        protocol.decode_request(frames)
    assert named in str(e.value)
