"""`<repo>[@<rev>][:<quant>]` -> HfSpec. Pure.

llama-server spells it `<user>/<model>[:quant]`; bloomery adds `@rev` (a branch, tag
or commit). Git ref names cannot hold ':', so the last ':' always starts the quant.
A repo id without a namespace (`gpt2`) is accepted as the hub accepts it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from bloomery.hf.errors import SpecError

_REPO_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_QUANT_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_REV_BAD = re.compile(r"[\s~^:?*\[\\]|\.\.|//|@\{")      # git check-ref-format, the parts that matter here
DEFAULT_REVISION = "main"


@dataclass(frozen=True)
class HfSpec:
    repo: str                      # "owner/name" (or "name")
    revision: str = DEFAULT_REVISION
    quant: str = ""                # "" : llama-server's default choice (Q4_K_M, then Q8_0, then the first)

    def __str__(self) -> str:
        rev = "" if self.revision == DEFAULT_REVISION else f"@{self.revision}"
        return f"{self.repo}{rev}" + (f":{self.quant}" if self.quant else "")


def parse_spec(text: str, flag: str = "--hf-repo") -> HfSpec:
    """The flag's value -> HfSpec, or SpecError naming the part that is wrong."""
    if not text or text != text.strip():
        raise SpecError(f"{flag} {text!r}: give <user>/<model>[@<rev>][:<quant>] without spaces")
    left, colon, quant = text.rpartition(":") if ":" in text else (text, "", "")
    if colon and not _QUANT_RE.match(quant):
        raise SpecError(f"{flag} {text!r}: quant {quant!r} must be letters, digits, '_' or '-' (e.g. Q4_K_M)")
    repo, at, rev = left.partition("@")
    if not _REPO_RE.match(repo) or ".." in repo:
        raise SpecError(f"{flag} {text!r}: repo {repo!r} is not a hub repo id (<user>/<model>)")
    if at and (not rev or _REV_BAD.search(rev) or rev.startswith("/") or rev.endswith("/")):
        raise SpecError(f"{flag} {text!r}: revision {rev!r} is not a branch, tag or commit name")
    return HfSpec(repo, rev if at else DEFAULT_REVISION, quant)
