"""Prompt ids of a chat-shaped body, and the token-count routes built on it.

POST /chat/completions/input_tokens (and /v1/): the ids the same chat request would
prompt with; POST /v1/responses/input_tokens (and /responses/): the same for a
Responses body. Both answer llama-server's {"input_tokens": N, "object": "response.input_tokens"}.
max_tokens is not needed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from bloomery import workpool
from bloomery.api.params import Fields
from bloomery.http.types import Request, Response

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App


def rendered_of(app: "App", chat_body: dict):
    """(the rendered prompt, its guarded ids) of an OpenAI chat body (messages, tools, chat_template_kwargs,
    reasoning_effort)."""
    from bloomery.api.chat import render_and_encode   # chat.py owns rendering; imported late (it imports us not)
    return render_and_encode(app, Fields(chat_body))


async def prompt_ids_of(app: "App", chat_body: dict) -> list[int]:
    """The guarded prompt ids of an OpenAI chat body, off the loop."""
    return (await workpool.run(rendered_of, app, chat_body))[1]


def _answer(n: int) -> Response:
    return Response.json({"input_tokens": n, "object": "response.input_tokens"})


async def handle_chat_input_tokens(app: "App", req: Request) -> Response:
    body = Fields(req.json()).body
    return _answer(len(await prompt_ids_of(app, body)))


async def handle_responses_input_tokens(app: "App", req: Request) -> Response:
    from bloomery.api.responses_convert import to_chat_body
    body = Fields(req.json()).body
    chat_body = to_chat_body(body, app.responses, for_count=True)
    return _answer(len(await prompt_ids_of(app, chat_body)))
