"""Stop strings and UTF-8-safe incremental text (bloomery/api/stops.py)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from bloomery.api.stops import TextAssembler, find_stop, partial_stop_len


def feed_all(asm: TextAssembler, pieces: list[bytes]) -> list[str]:
    out = [asm.feed(p) for p in pieces]
    out.append(asm.finish())
    return out


def test_plain_text_passes_through_piece_by_piece():
    asm = TextAssembler()
    assert feed_all(asm, [b"Hello", b",", b" world"]) == ["Hello", ",", " world", ""]


def test_a_possible_stop_prefix_is_held_back_then_released():
    asm = TextAssembler((" 7",))
    assert asm.feed(b" 4,") == " 4,"
    assert asm.feed(b" ") == ""           # " " could begin " 7"
    assert asm.feed(b"5") == " 5"          # it did not: released with the next piece
    assert asm.finish() == ""
    assert asm.text == " 4, 5" and asm.stopping_word == ""


def test_a_stop_across_two_ids_ends_the_content_before_it():
    asm = TextAssembler((" 7",))
    sent = feed_all(asm, [b" 6", b",", b" ", b"7", b" 8"])
    assert "".join(sent) == " 6,"
    assert asm.text == " 6," and asm.stopping_word == " 7"


def test_text_before_the_stop_in_the_same_piece_is_kept():
    asm = TextAssembler(("5",))
    assert "".join(feed_all(asm, [b"1, 2, 3, 4, 5, 6"])) == "1, 2, 3, 4, "
    assert asm.stopping_word == "5"


def test_the_earliest_of_several_stops_wins():
    assert find_stop("abcXYdefZ", ("Z", "XY")) == (3, "XY")
    asm = TextAssembler(("Z", "XY"))
    asm.feed(b"abcXYdefZ")
    assert asm.text == "abc" and asm.stopping_word == "XY"


def test_held_text_is_released_at_the_end_when_no_stop_came():
    asm = TextAssembler(("STOP",))
    assert asm.feed(b"go ST") == "go "
    assert asm.finish() == "ST"


def test_a_split_utf8_character_is_never_sent_in_halves():
    data = "你好".encode()                  # 6 bytes, 3 per character
    asm = TextAssembler()
    sent = [asm.feed(data[i:i + 1]) for i in range(len(data))]
    assert sent == ["", "", "你", "", "", "好"]


def test_a_broken_utf8_tail_becomes_a_replacement_char_at_the_end_only():
    asm = TextAssembler()
    assert asm.feed(b"ok\xe4\xbd") == "ok"
    assert asm.finish() == "\ufffd"


def test_partial_stop_len_counts_only_unsent_text():
    assert partial_stop_len("abcS", ("STOP",)) == 1
    assert partial_stop_len("abcSTO", ("STOP",)) == 3
    assert partial_stop_len("abcSTS", ("STOP",), start=5) == 1
    assert partial_stop_len("abcSTO", ("STOP",), start=5) == 0
    assert partial_stop_len("abc", ("STOP",)) == 0


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab5 ,", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=8),
       stop=st.text(alphabet="ab5", min_size=1, max_size=3))
def test_streamed_pieces_equal_the_final_content_and_never_contain_the_stop(text, cuts, stop):
    data = text.encode()
    bounds = sorted({0, len(data), *[c for c in cuts if c <= len(data)]})
    pieces = [data[a:b] for a, b in zip(bounds, bounds[1:])]
    asm = TextAssembler((stop,))
    sent = "".join(feed_all(asm, pieces))
    assert sent == asm.text
    pos = text.find(stop)
    assert asm.text == (text if pos < 0 else text[:pos])
    assert stop not in sent
