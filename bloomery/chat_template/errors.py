"""The one error every part of the chat-template package raises."""


class TemplateError(Exception):
    """A template or its input is wrong; the message names what (routes answer 400)."""
