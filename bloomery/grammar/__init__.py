"""Structured output through one constraint engine (llguidance): JSON schemas, llama-server's
GBNF grammars and forced tool calls (Lark with embedded schemas).

Front side (compile.py): schema_grammar / gbnf_grammar / lark_grammar check the input and give
the grammar text the request carries in SamplingParams.grammar; SchemaError names a keyword
and its JSON path, GrammarSyntaxError a GBNF line and column.
Engine side: Matcher(text, Vocab.from_tokenizer(tok), stop_ids) masks the sampler's row (the
mask for the next id computed while the model runs) and advances on each accepted id.

The errors import with the package; the rest (and llguidance, about 0.06 s) with the first name read
(`bloomery.grammar.schema_grammar`, `from bloomery.grammar import Matcher`), so a server's start that
only names the errors never imports the constraint engine.
"""
import importlib

from bloomery.grammar.errors import GrammarError, GrammarSyntaxError, SchemaError

_LAZY = {"after_prefix": "compile", "gbnf_grammar": "compile", "json_object_grammar": "compile",
         "lark_grammar": "compile", "lark_literal": "compile", "schema_grammar": "compile", "schema_rule": "compile",
         "Matcher": "matcher", "Vocab": "vocab"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bloomery.grammar' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"bloomery.grammar.{module}"), name)
    globals()[name] = value
    return value


__all__ = ["GrammarError", "GrammarSyntaxError", "Matcher", "SchemaError", "Vocab", "after_prefix", "gbnf_grammar",
           "json_object_grammar", "lark_grammar", "lark_literal", "schema_grammar", "schema_rule"]


__all__ = ["GrammarError", "GrammarSyntaxError", "Matcher", "SchemaError", "Vocab", "after_prefix", "gbnf_grammar",
           "json_object_grammar", "lark_grammar", "lark_literal", "schema_grammar", "schema_rule"]
