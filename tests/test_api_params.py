"""Request field reading (bloomery/api/params.py): read, refused by name, or ignored."""
from __future__ import annotations

import math

import pytest

from bloomery.api.params import INT32_MAX, Fields, parse_gen_params
from bloomery.http.types import ApiError

EOG = frozenset({151643, 151645})


def parse(body: dict, **kw):
    return parse_gen_params(Fields(body), n_predict_default=kw.pop("n_predict_default", -1), n_vocab=151936,
                            eog_ids=EOG, **kw)


def refused(body: dict, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body, **kw)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


def test_defaults_are_llama_servers():
    p = parse({})
    sp = p.sampling
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p) == (0.8, 40, 0.95, 0.05)
    assert (sp.repeat_penalty, sp.repeat_last_n, sp.seed) == (1.0, 64, 0xFFFFFFFF)
    assert p.n_predict == -1 and p.cache_prompt and not p.stream and p.stop == ()


def test_null_is_unset_and_unknown_fields_are_ignored():
    p = parse({"temperature": None, "max_tokens": None, "temprature": 0})
    assert p.sampling.temperature == 0.8 and p.n_predict == -1


def test_n_predict_wins_over_max_completion_tokens_over_max_tokens():
    assert parse({"max_tokens": 5}).n_predict == 5
    assert parse({"max_tokens": 5, "max_completion_tokens": 6}).n_predict == 6
    assert parse({"max_tokens": 5, "max_completion_tokens": 6, "n_predict": 7}).n_predict == 7
    assert parse({}, n_predict_default=9).n_predict == 9
    assert parse({"n_predict": -1}, n_predict_default=9).n_predict == 9


def test_max_tokens_as_a_string_is_refused_like_llama_server():
    e = refused({"max_tokens": "48"})
    assert e.message == "Field 'max_tokens': type must be number, but is string"
    assert e.param == "max_tokens"


@pytest.mark.parametrize("value", [-2, INT32_MAX + 1, 1.5])
def test_n_predict_bounds(value):
    assert "n_predict" in refused({"n_predict": value}).message


def test_n_above_one_is_refused_with_llama_servers_message():
    assert refused({"n": 2}).message == "Field 'n': Value must be between 1 <= value <= 1, but got 2"
    assert parse({"n": 1}).n_predict == -1


@pytest.mark.parametrize("body,name", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"), ({"min_p": -1}, "min_p"), ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"seed": 2**32}, "seed"), ({"repeat_last_n": -2}, "repeat_last_n"), ({"stream": "yes"}, "stream"),
    ({"stop": 5}, "stop"), ({"stop": ["a", 1]}, "stop"), ({"stop": [""]}, "stop"),
])
def test_wrong_types_and_bounds_name_the_field(body, name):
    e = refused(body)
    assert f"'{name}'" in e.message and e.param == name


@pytest.mark.parametrize("body,name", [
    ({"grammar": "root ::= \"a"}, "grammar"), ({"mirostat": 2}, "mirostat"), ({"typical_p": 0.5}, "typical_p"),
    ({"dry_multiplier": 0.8}, "dry_multiplier"), ({"xtc_probability": 0.5}, "xtc_probability"),
    ({"json_schema": {"type": "object", "not": {}}}, "json_schema"), ({"lora": [{"id": 0}]}, "lora"),
    ({"n_indent": 4}, "n_indent"),
])
def test_known_but_unsupported_fields_are_refused_by_name(body, name):
    assert f"'{name}'" in refused(body).message


def test_unsupported_fields_at_their_off_values_are_accepted():
    parse({"grammar": "", "mirostat": 0, "typical_p": 1, "dry_multiplier": 0, "xtc_probability": 0, "id_slot": -1,
           "lora": [], "post_sampling_probs": False, "n_indent": 0, "return_progress": False})


def test_grammar_and_json_schema_reach_the_sampling_params():
    """llama-server's grammar (GBNF) and json_schema fields become the engine's grammar text; both at once,
    a bad GBNF (line and column) and a keyword the engine does not serve (its JSON path) are refused."""
    assert "lark_grammar" in parse({"grammar": 'root ::= "a" [0-9]+'}).sampling.grammar
    assert "%json" in parse({"json_schema": {"type": "integer", "minimum": 1}}).sampling.grammar
    assert parse({}).sampling.grammar == ""
    assert "not both" in refused({"grammar": 'root ::= "a"', "json_schema": {}}).message
    assert "line 2, column 1" in refused({"grammar": 'root ::= "a" [0-9+\n'}).message
    assert "#/properties/x/not" in refused({"json_schema": {"properties": {"x": {"not": {}}}}}).message


def test_stop_takes_a_string_or_a_list():
    assert parse({"stop": "x"}).stop == ("x",)
    assert parse({"stop": ["a", "b", "a"]}).stop == ("a", "b")


def test_logit_bias_object_is_read_and_other_forms_refused():
    """Serving guide 11.2: OpenAI's object only; an array of pairs, false and a token's text are refused."""
    assert parse({"logit_bias": {"15": 5, "16": -100}}).sampling.logit_bias == ((15, 5.0), (16, -100.0))
    for bad in ([[15, 5]], {"x": 1}, {"15": 101}, {"999999": 1}, {"15": False}, {"15": 1, "015": 2}, "x"):
        assert "logit_bias" in refused({"logit_bias": bad}).message


def test_ignore_eos_bans_the_stop_ids():
    bias = dict(parse({"ignore_eos": True}).sampling.logit_bias)
    assert bias == {151643: -math.inf, 151645: -math.inf}


def test_n_probs_is_refused_where_the_route_renders_none():
    assert parse({"n_probs": 3}).n_probs == 3
    assert parse({"logprobs": 2}).n_probs == 2          # llama-server's alias on /completion
    assert "n_probs" in refused({"n_probs": 3}, allow_n_probs=False).message


def test_samplers_subsequence_turns_stages_off_and_other_orders_are_refused():
    sp = parse({"samplers": ["top_k", "temperature"]}).sampling
    assert sp.top_k == 40 and sp.top_p == 1.0 and sp.min_p == 0.0
    assert "samplers" in refused({"samplers": ["temperature", "top_k"]}).message
    assert "samplers" in refused({"samplers": ["beam", "temperature"]}).message


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(ApiError) as e:
        Fields([1, 2])
    assert e.value.status == 400 and "object" in e.value.message


def test_post_sampling_probs_where_probabilities_are_rendered():
    assert parse({"n_probs": 3, "post_sampling_probs": True}).sampling.post_sampling_probs
    assert "post_sampling_probs" in refused({"post_sampling_probs": True}, allow_n_probs=False).message
