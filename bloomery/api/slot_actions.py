"""POST /slots/{id}?action=save|restore|erase: llama-server's slot files (--slot-save-path).

The front's part: the checks llama-server makes before its task (the folder is set, the id is a
number, the action is known, the file name is a plain name inside the folder) and the answer; the
engine does the copy between steps (engine/slot_file.py) and says how it went. A name with a path
separator, `..` or a control character is refused, so nothing is read or written outside the folder.
"""
from __future__ import annotations

import os
import unicodedata
from typing import TYPE_CHECKING

from bloomery.engine.slot_file import ACTIONS
from bloomery.http.types import ApiError, Request, Response

if TYPE_CHECKING:
    from bloomery.api.context import ApiContext as App

NO_FOLDER = "This server does not support slots action. Start it with `--slot-save-path`"
MAX_NAME_BYTES = 255
ERROR_TYPES = {400: "invalid_request_error", 501: "not_supported_error", 503: "unavailable_error"}


def filename_problem(name: object) -> str | None:
    """Why `name` may not name a slot file (None: it may): empty, too long, a path separator, `..`,
    a control character, or a leading dot or space / trailing dot or space, as llama.cpp's own check."""
    if not isinstance(name, str) or not name:
        return "the file name is empty" if isinstance(name, str) else "\"filename\" must be a string"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"the file name is longer than {MAX_NAME_BYTES} bytes"
    if "/" in name or "\\" in name or ".." in name:
        return "the file name has a path separator or '..': it must name a file in --slot-save-path"
    if any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn") for c in name):
        return "the file name has a control or unassigned character"
    if name[0] in ". " or name[-1] in ". ":
        return "the file name starts or ends with a dot or a space"
    if ":" in name:
        return "the file name has a ':'"
    return None


def _slot_id(path: str) -> int:
    text = path.rsplit("/", 1)[-1]
    try:
        return int(text, 10)
    except ValueError:
        raise ApiError(400, "Invalid slot ID", "invalid_request_error") from None


async def handle_slot_action(app: "App", req: Request) -> Response:
    folder = getattr(app, "slot_save_path", None)
    if not folder:
        raise ApiError(501, NO_FOLDER, "not_supported_error")
    id_slot = _slot_id(req.path)
    action = req.query.get("action", "")
    if action not in ACTIONS:
        raise ApiError(400, "Invalid action", "invalid_request_error")
    path = filename = ""
    if action != "erase":
        body = req.json()
        if not isinstance(body, dict) or "filename" not in body:
            raise ApiError(400, f"\"filename\" is required to {action} a slot", "invalid_request_error", "filename")
        filename = body["filename"]
        why = filename_problem(filename)
        if why is not None:
            raise ApiError(400, f"Invalid filename: {why}", "invalid_request_error", "filename")
        path = os.path.join(folder, filename)
    got = await app.client.slot_action(action, id_slot, path, filename, os.path.basename(app.info.model_path))
    if got.status != 200:
        raise ApiError(got.status, got.error, ERROR_TYPES.get(got.status, "server_error"))
    return Response.json(got.body)

