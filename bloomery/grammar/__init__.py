"""Structured output through one constraint engine (llguidance): JSON schemas, llama-server's
GBNF grammars and forced tool calls (Lark with embedded schemas).

Front side (compile.py): schema_grammar / gbnf_grammar / lark_grammar check the input and give
the grammar text the request carries in SamplingParams.grammar; SchemaError names a keyword
and its JSON path, GrammarSyntaxError a GBNF line and column.
Engine side: Matcher(text, Vocab.from_tokenizer(tok), stop_ids) masks the sampler's row (the
mask for the next id computed while the model runs) and advances on each accepted id.
"""
from bloomery.grammar.compile import (GrammarSyntaxError, SchemaError, after_prefix, gbnf_grammar,
                                      json_object_grammar, lark_grammar, lark_literal, schema_grammar, schema_rule)
from bloomery.grammar.matcher import GrammarError, Matcher
from bloomery.grammar.vocab import Vocab

__all__ = ["GrammarError", "GrammarSyntaxError", "Matcher", "SchemaError", "Vocab", "after_prefix", "gbnf_grammar",
           "json_object_grammar", "lark_grammar", "lark_literal", "schema_grammar", "schema_rule"]
