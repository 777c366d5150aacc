"""Chat templates: jinja2 sandbox rendering with llama.cpp's variables, and the client-text guard.

    template.py    ChatTemplate: parse, normalise, mark, render, cut into segments
    normalize.py   llama-server's message/tool checks and fixes; template_args
    caps.py        what a template reads, probed as llama.cpp's jinja::caps_get
    sandbox.py     the jinja2 environment, its globals and filters, the render limits
    tojson.py      tojson as llama.cpp's jinja writes it
    guard.py       ClientStr and the marks around client text
    segments.py    marked text -> (text, is_client_text) segments -> token ids
"""
from .errors import TemplateError
from .guard import MARK_CLOSE, MARK_OPEN
from .normalize import template_args
from .segments import RenderedPrompt, encode_segments
from .template import CHATML_TEMPLATE, ChatTemplate

__all__ = ["CHATML_TEMPLATE", "ChatTemplate", "MARK_CLOSE", "MARK_OPEN", "RenderedPrompt",
           "TemplateError", "encode_segments", "template_args"]
