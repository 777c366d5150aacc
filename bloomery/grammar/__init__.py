"""Structured output: a JSON schema (the serving guide's subset, 11.4) or a forced tool
call, decoded under a token-level mask.

Front side: `schema.schema_nodes(schema)` (SchemaError names a refused keyword) and the
tool-call builders in bloomery.api.toolcalls give a node table; `Program(nodes).to_json()`
is the text the request carries in SamplingParams.grammar.
Engine side: `Matcher(cache.get(text), vocab, stop_ids)` masks the sampler's row and
advances on each accepted id; the request ends with "stop" once `matcher.done`.
"""
from bloomery.grammar.matcher import GrammarError, Matcher, ProgramCache, Vocab
from bloomery.grammar.program import Program, ProgramError
from bloomery.grammar.schema import SchemaError, json_object_nodes, schema_nodes

__all__ = ["GrammarError", "Matcher", "Program", "ProgramCache", "ProgramError", "SchemaError", "Vocab",
           "json_object_nodes", "schema_nodes"]
