"""The grammar package's errors, importable without llguidance (whose import is about 0.06 s): the
front and the engine name them at their start, and import the constraint engine with the first grammar."""
from __future__ import annotations


class SchemaError(ValueError):
    """A schema (or grammar) the engine cannot serve; keyword and path say where."""

    def __init__(self, message: str, keyword: str = "", path: str = ""):
        super().__init__(message)
        self.keyword, self.path = keyword, path


class GrammarSyntaxError(ValueError):
    """An invalid GBNF grammar: line and column (1-based) of the fault."""

    def __init__(self, message: str, line: int, column: int):
        super().__init__(f"invalid GBNF grammar at line {line}, column {column}: {message}")
        self.line, self.column = line, column



class GrammarError(ValueError):
    """A grammar the engine cannot run, an id it did not allow, or a state no id can continue."""
