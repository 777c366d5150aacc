"""<think> spans into reasoning_content, streamed and whole; reasoning fields; the loop detector."""
from __future__ import annotations

import itertools

import pytest

from bloomery.api.params import Fields
from bloomery.api.reasoning import LoopDetector, ThinkParser, prompt_opens_think, read_reasoning
from bloomery.api.toolcalls.reply import Reply
from bloomery.http.types import ApiError


@pytest.mark.parametrize("text,starts_open,reasoning,content", [
    ("<think>\nhmm, let me see\n</think>\n\nThe answer", False, "hmm, let me see", "The answer"),
    ("I think</think>answer", True, "I think", "answer"),
    ("plain <think>x</think>", False, "", "plain <think>x</think>"),
    ("<think>cut short\n", False, "cut short", ""),
])
def test_whole_and_streamed_agree(text, starts_open, reasoning, content):
    whole = ThinkParser(True, starts_open)
    whole.feed(text)
    whole.finish()
    assert (whole.reasoning, whole.content) == (reasoning, content)
    streamed = ThinkParser(True, starts_open)
    r = c = ""
    for ch in text:
        dr, dc = streamed.feed(ch)
        r, c = r + dr, c + dc
    dr, dc = streamed.finish()
    assert (r + dr, c + dc) == (reasoning, content)


def test_format_none_keeps_tags_in_content():
    p = ThinkParser(extract=False)
    p.feed("<think>x</think>y")
    assert p.content == "<think>x</think>y" and p.reasoning == ""


def test_prompt_opening_a_span():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")


def test_reply_streams_reasoning_deltas():
    r = Reply(None, starts_open=True)
    deltas = [d for ch in "plan</think>done" for d in r.feed(ch)] + r.finish(False)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "plan"
    assert "".join(d.get("content", "") for d in deltas) == "done"
    assert r.message()["reasoning_content"] == "plan"


@pytest.mark.parametrize("body,word", [({"reasoning_format": "xml"}, "reasoning_format"),
                                       ({"reasoning_effort": "huge"}, "reasoning_effort"),
                                       ({"reasoning_budget": -2}, "reasoning_budget"),
                                       ({"reasoning_loop": "yes"}, "reasoning_loop")])
def test_bad_reasoning_fields_named(body, word):
    with pytest.raises(ApiError) as e:
        read_reasoning(Fields(body))
    assert word in str(e.value.body())


def test_effort_none_turns_thinking_off_but_client_kwargs_win():
    rs = read_reasoning(Fields({"reasoning_effort": "none"}))
    assert rs.template_kwargs(None) == {"enable_thinking": False}
    assert rs.template_kwargs({"enable_thinking": True}) == {"enable_thinking": True}


def test_loop_detector_needs_256_ids_and_a_whole_cycle():
    d = LoopDetector()
    hits = [i for i, t in enumerate(itertools.islice(itertools.cycle([1, 2, 3]), 400)) if d.feed(t)]
    assert hits and hits[0] == 3 + 255          # 256 ids equal to the id 3 back
    d = LoopDetector()
    assert not any(d.feed(t) for t in range(600))
