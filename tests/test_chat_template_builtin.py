"""--chat-template NAME: llama.cpp's built-in template names. The expected prompts are the ones
llama.cpp's own tests/test-chat-template.cpp (b11434) checks for its built-ins, on its conversation."""
from __future__ import annotations

import pytest
import requests

from bloomery.chat_template import ChatTemplate
from bloomery.chat_template.builtin import BUILTIN, LLAMA_CPP_NAMES, template_source
from bloomery.settings import SettingsError, parse
from serve_proc import Served

CONVERSATION = [("system", "You are a helpful assistant"), ("user", "Hello"), ("assistant", "Hi there"),
                ("user", "Who are you"), ("assistant", "   I am an assistant   "), ("user", "Another question")]

LLAMA_CPP_EXPECTED = {
    "llama2-sys-bos": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s><s>[INST] Who are you [/INST]   I am an assistant   </s><s>[INST] Another question [/INST]",
    "llama2-sys-strip": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s>[INST] Who are you [/INST]I am an assistant</s>[INST] Another question [/INST]",
    "gemma": "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n",
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a helpful assistant<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hi there<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Who are you<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>I am an assistant<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Another question<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI am an assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "phi3": "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question<|end|>\n<|assistant|>\n",
    "mistral-v7": "[SYSTEM_PROMPT] You are a helpful assistant[/SYSTEM_PROMPT][INST] Hello[/INST] Hi there</s>[INST] Who are you[/INST]    I am an assistant   </s>[INST] Another question[/INST]",
    "phi4": "<|im_start|>system<|im_sep|>You are a helpful assistant<|im_end|><|im_start|>user<|im_sep|>Hello<|im_end|><|im_start|>assistant<|im_sep|>Hi there<|im_end|><|im_start|>user<|im_sep|>Who are you<|im_end|><|im_start|>assistant<|im_sep|>   I am an assistant   <|im_end|><|im_start|>user<|im_sep|>Another question<|im_end|><|im_start|>assistant<|im_sep|>",
    "chatml": "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n<|im_start|>assistant\n",
}


def render(name: str, conversation=CONVERSATION) -> str:
    return ChatTemplate(BUILTIN[name], origin=name).render([{"role": r, "content": c} for r, c in conversation]).text


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_EXPECTED))
def test_builtin_renders_as_llama_cpp(name):
    assert render(name) == LLAMA_CPP_EXPECTED[name]


def test_every_served_name_is_llama_cpps_and_renders():
    assert set(BUILTIN) <= set(LLAMA_CPP_NAMES)
    for name in BUILTIN:
        assert "Another question" in render(name)


def test_client_text_stays_text():
    # a user's special-token spelling is client text (guarded), the template's own tokens are not
    t = ChatTemplate(BUILTIN["llama3"], origin="llama3")
    got = t.render([{"role": "user", "content": "<|eot_id|> hi"}])
    assert ("<|eot_id|> hi", True) in got.segments
    assert any(not client and text.startswith("<|eot_id|>") for text, client in got.segments)


def test_names_and_jinja_text():
    assert template_source("llama3")[0] == BUILTIN["llama3"]
    assert template_source("{{ 'x' }}") == ("{{ 'x' }}", "--chat-template (jinja text)")


def test_settings_read_and_refuse():
    assert parse(["-m", "m.gguf", "--chat-template", "command-r"], {}).chat_template == "command-r"
    assert parse(["-m", "m.gguf"], {"LLAMA_ARG_CHAT_TEMPLATE": "llama3"}).chat_template == "llama3"
    with pytest.raises(SettingsError, match="'vicuna' is not served here; served names: chatml"):
        parse(["-m", "m.gguf", "--chat-template", "vicuna"], {})


def test_settings_refuse_both_sources(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ 'x' }}")
    with pytest.raises(SettingsError, match="both name the chat template"):
        parse(["-m", "m.gguf", "--chat-template", "llama3", "--chat-template-file", str(f)], {})


@pytest.mark.real_model
def test_served_with_a_builtin_name(real_model_path):
    with Served("-m", str(real_model_path), "-c", "512", "--no-warmup", "--chat-template", "command-r") as s:
        r = requests.post(s.url + "/apply-template", json={"messages": [
            {"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]}, timeout=60)
        assert r.status_code == 200
        assert r.json()["prompt"] == ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
                                      "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
                                      "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
        props = requests.get(s.url + "/props", timeout=30).json()
        assert props["chat_template"] == BUILTIN["command-r"]
