"""Real-world JSON schemas for the constraint engine's checks (test_grammar_corpus.py).

OpenAI function-calling examples, Pydantic models with constraints (their schemas as
Pydantic writes them), nested and recursive $refs, and strings that must hold quotes,
backslashes, newlines and non-ASCII text. Each entry: (name, schema, valid values,
invalid cases). A value is written in the schema's property order (the engine writes
properties in that order, as llama-server's converter does). An invalid case is
(prefix, rest): prefix is the start of a valid document and the first byte of rest is
where the text goes wrong, so the engine must refuse the token that holds that byte.
"""
from __future__ import annotations

import datetime
import uuid
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, Field


def _fn(props: dict, required: list[str], strict: bool = True) -> dict:
    s = {"type": "object", "properties": props, "required": required}
    if strict:
        s["additionalProperties"] = False
    return s


# -- Pydantic models ----------------------------------------------------------------------------
class User(BaseModel):
    name: str = Field(min_length=1, max_length=20)
    age: int = Field(ge=0, le=150)
    handle: str = Field(pattern=r"^@[a-z0-9_]{3,15}$")


class LineItem(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-\d{4}$")
    quantity: int = Field(gt=0, le=100)
    unit_price: float = Field(gt=0)
    pack_of: int = Field(multiple_of=6, ge=6)


class Address(BaseModel):
    street: str
    city: str
    postcode: str = Field(max_length=10)


class Order(BaseModel):
    id: uuid.UUID
    placed: datetime.datetime
    ship_to: Address
    bill_to: Optional[Address] = None
    items: list[LineItem] = Field(min_length=1, max_length=5)


class TreeNode(BaseModel):
    value: int
    children: list["TreeNode"] = Field(default_factory=list, max_length=3)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Pet(BaseModel):
    pet: Annotated[Union[Cat, Dog], Field(discriminator="kind")]
    born: datetime.date
    weight_kg: float = Field(gt=0, lt=200)


class Reading(BaseModel):
    sensor: Literal["temp", "humidity"]
    at: datetime.time
    value: tuple[float, str]
    labels: dict[str, int] = Field(default_factory=dict)


class Review(BaseModel):
    stars: int = Field(ge=1, le=5)
    title: str = Field(max_length=60)
    body: str
    pros: list[str] = Field(default_factory=list, max_length=4)


CORPUS: list[tuple[str, object, list, list[tuple[str, str]]]] = [
    # -- OpenAI function-calling examples ----------------------------------------------------
    ("get_current_weather", _fn({"location": {"type": "string", "description": "City and state, e.g. San Francisco, CA"},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["location", "unit"]),
     [{"location": "San Francisco, CA", "unit": "celsius"}, {"location": "Zürich, ZH", "unit": "fahrenheit"}],
     [('{"location": "Paris", "unit": "', 'kelvin"}'), ('{"location": "Paris"', "}")]),
    ("get_delivery_date", _fn({"order_id": {"type": "string"}}, ["order_id"]),
     [{"order_id": "order_12345"}, {"order_id": ""}],
     [('{"', 'customer_id": "1"}'), ('{"order_id": ', "12345}")]),
    ("send_email", _fn({"to": {"type": "string", "format": "email"}, "subject": {"type": "string", "maxLength": 40},
                        "body": {"type": "string"}}, ["to", "subject", "body"]),
     [{"to": "ana@example.com", "subject": "Re: \"Q3\" numbers", "body": "Hi Ana,\n\nSee the attached.\n\t— Bo"}],
     [('{"to": "ana', ' at example.com", "subject": "x", "body": "y"}')]),
    ("search_flights", _fn({"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                            "date": {"type": "string", "format": "date"},
                            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
                           ["origin", "destination", "date", "passengers"]),
     [{"origin": "SFO", "destination": "NRT", "date": "2025-03-14", "passengers": 2}],
     [('{"origin": "SF', 'OX", "destination": "NRT", "date": "2025-03-14", "passengers": 2}'),
      ('{"origin": "SFO", "destination": "NRT", "date": "2025-03-14", "passengers": 1', "2}")]),
    ("create_calendar_event", _fn({"title": {"type": "string"}, "start": {"type": "string", "format": "date-time"},
                                   "end": {"type": "string", "format": "date-time"},
                                   "attendees": {"type": "array", "items": {"type": "string", "format": "email"},
                                                 "maxItems": 3}}, ["title", "start", "end", "attendees"]),
     [{"title": "Stand-up", "start": "2025-01-06T09:00:00Z", "end": "2025-01-06T09:15:00+01:00",
       "attendees": ["a@x.io", "b@y.org"]}],
     [('{"title": "x", "start": "2025-01-06', ' 09:00", "end": "", "attendees": []}')]),
    ("write_file", _fn({"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
     [{"path": "hello.py", "content": "print(\"hello\")\nprint('bye')\n"},
      {"path": "C:\\temp\\a.txt", "content": "tab\there\r\nnul\u0000 bell\u0007 ünï €"}],
     [('{"path": "a.py", "content": "print(1)', '\n"}')]),
    ("edit_file", _fn({"path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
                       "replace_all": {"type": "boolean"}}, ["path", "old_string", "new_string", "replace_all"]),
     [{"path": "src/x.rs", "old_string": "let s = \"a\\\\b\";", "new_string": "let s = r\"a\\b\";",
       "replace_all": False}],
     [('{"path": "x", "old_string": "a", "new_string": "b", "replace_all": ', '"false"}')]),
    ("strict_nullable", _fn({"query": {"type": "string"}, "limit": {"type": ["integer", "null"]},
                             "cursor": {"type": ["string", "null"]}}, ["query", "limit", "cursor"]),
     [{"query": "café", "limit": None, "cursor": "abc=="}, {"query": "", "limit": 10, "cursor": None}],
     [('{"query": "x", "limit": ', 'true, "cursor": null}')]),
    ("get_stock_price", _fn({"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
                             "exchange": {"type": "string", "enum": ["NYSE", "NASDAQ", "LSE"]}}, ["ticker"]),
     [{"ticker": "AAPL"}, {"ticker": "T", "exchange": "NYSE"}],
     [('{"ticker": "', 'aapl"}'), ('{"ticker": "ABCDE', 'F"}')]),
    ("book_restaurant", _fn({"name": {"type": "string"}, "party_size": {"type": "integer", "minimum": 1, "maximum": 20},
                             "time": {"type": "string", "format": "time"},
                             "notes": {"type": ["string", "null"]}}, ["name", "party_size", "time", "notes"]),
     [{"name": "Chez Łukasz", "party_size": 4, "time": "19:30:00Z", "notes": "Allergy: \"nuts\""}],
     [('{"name": "x", "party_size": ', '0, "time": "19:30:00Z", "notes": null}')]),
    # -- Pydantic models ----------------------------------------------------------------------
    ("pydantic_user", User.model_json_schema(),
     [{"name": "Ada", "age": 36, "handle": "@ada_l"}],
     [('{"name": "Ada", "age": 15', '1, "handle": "@ada"}'), ('{"name": "Ada", "age": 36, "handle": "', 'ada"}')]),
    ("pydantic_line_item", LineItem.model_json_schema(),
     [{"sku": "ABC-1234", "quantity": 3, "unit_price": 19.99, "pack_of": 12}],
     [('{"sku": "ABC-12', 'X4", "quantity": 3, "unit_price": 1.5}'),
      ('{"sku": "ABC-1234", "quantity": ', '-1, "unit_price": 1.5, "pack_of": 6}'),
      ('{"sku": "ABC-1234", "quantity": 1, "unit_price": 1.5, "pack_of": 10', '}')]),
    ("pydantic_order", Order.model_json_schema(),
     [{"id": "6f1c2e9a-3b4d-4e5f-8a9b-0c1d2e3f4a5b", "placed": "2024-11-02T17:45:00Z",
       "ship_to": {"street": "1 Rue de l'Église", "city": "Lyon", "postcode": "69001"}, "bill_to": None,
       "items": [{"sku": "XYZ-0001", "quantity": 1, "unit_price": 0.5, "pack_of": 6}]}],
     [('{"id": "6f1c2e9a-3b4d-4e5f-8a9b-0c1d2e3f4a5b", "placed": "2024-11-02T17:45:00Z", "ship_to": '
       '{"street": "a", "city": "b", "postcode": "c"}, "bill_to": null, "items": [', ']}')]),
    ("pydantic_tree", TreeNode.model_json_schema(),
     [{"value": 1, "children": [{"value": 2, "children": []}, {"value": 3, "children": [{"value": 4, "children": []}]}]}],
     [('{"value": 1, "children": [{"value": ', '"2"}]}')]),
    ("pydantic_pet", Pet.model_json_schema(),
     [{"pet": {"kind": "cat", "lives": 9}, "born": "2020-02-29", "weight_kg": 4.2},
      {"pet": {"kind": "dog", "good": True}, "born": "2019-12-31", "weight_kg": 31}],
     [('{"pet": {"kind": "', 'cow", "lives": 1}, "born": "2020-01-01", "weight_kg": 1}'),
      ('{"pet": {"kind": "cat", "lives": 1', '0}, "born": "2020-01-01", "weight_kg": 1}')]),
    ("pydantic_reading", Reading.model_json_schema(),
     [{"sensor": "temp", "at": "08:15:00Z", "value": [21.5, "°C"], "labels": {"room": 3, "floor": -1}}],
     [('{"sensor": "temp", "at": "08:15:00Z", "value": [', '"21.5", "C"]}')]),
    ("pydantic_review", Review.model_json_schema(),
     [{"stars": 5, "title": "Great \"little\" kettle", "body": "Boils fast.\nQuiet.\n\n日本語もOK", "pros": ["fast"]}],
     [('{"stars": ', '6, "title": "x", "body": "y"}')]),
    # -- nested and recursive $refs -------------------------------------------------------------
    ("address_book", {"$defs": {"person": {"type": "object", "properties": {
        "name": {"type": "string"}, "phones": {"type": "array", "items": {"$ref": "#/$defs/phone"}}},
        "required": ["name", "phones"], "additionalProperties": False},
        "phone": {"type": "object", "properties": {"kind": {"enum": ["home", "work"]},
                                                   "number": {"type": "string", "pattern": "^\\+?[0-9 ]{3,15}$"}},
                  "required": ["kind", "number"], "additionalProperties": False}},
        "type": "object", "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/person"}}},
        "required": ["people"], "additionalProperties": False},
     [{"people": [{"name": "Zoë", "phones": [{"kind": "home", "number": "+44 20 7946 0958"}]}]}],
     [('{"people": [{"name": "Z", "phones": [{"kind": "', 'mobile", "number": "123"}]}]}')]),
    ("linked_list_definitions", {"definitions": {"node": {"type": "object", "properties": {
        "v": {"type": "string"}, "next": {"anyOf": [{"$ref": "#/definitions/node"}, {"type": "null"}]}},
        "required": ["v", "next"], "additionalProperties": False}}, "$ref": "#/definitions/node"},
     [{"v": "a", "next": {"v": "b\\c", "next": None}}],
     [('{"v": "a", "next": {"v": "b"', "}}")]),
    ("geojson_point", {"type": "object", "properties": {
        "type": {"const": "Point"},
        "coordinates": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 3}},
        "required": ["type", "coordinates"], "additionalProperties": False},
     [{"type": "Point", "coordinates": [2.3522, 48.8566]}, {"type": "Point", "coordinates": [-122.4, 37.8, 16]}],
     [('{"type": "Point", "coordinates": [1', ']}'), ('{"type": "', 'Line", "coordinates": [1, 2]}')]),
    ("json_schema_store_package", {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9-]+$", "maxLength": 30},
        "version": {"type": "string", "pattern": "^\\d+\\.\\d+\\.\\d+$"},
        "scripts": {"type": "object", "additionalProperties": {"type": "string"}},
        "private": {"type": "boolean"}}, "required": ["name", "version"], "additionalProperties": False},
     [{"name": "left-pad", "version": "1.3.0", "scripts": {"test": "node -e \"process.exit(0)\""}, "private": True}],
     [('{"name": "', 'Left-pad", "version": "1.0.0"}'), ('{"name": "x", "version": "1.3', '"}')]),
    # -- strings that must hold quotes, backslashes, newlines and non-ASCII ---------------------
    ("code_snippet", _fn({"language": {"enum": ["python", "c", "shell"]}, "code": {"type": "string"}},
                         ["language", "code"]),
     [{"language": "c", "code": "#include <stdio.h>\nint main(void) {\n\tprintf(\"%s\\n\", \"hi\");\n}\n"},
      {"language": "shell", "code": "echo 'a' \"b\" \\\n  | tr a-z A-Z"}],
     [('{"language": "', 'rust", "code": ""}')]),
    ("translation", _fn({"source": {"type": "string"}, "target": {"type": "string"}}, ["source", "target"]),
     [{"source": "Good morning", "target": "おはようございます"}, {"source": "Straße", "target": "улица 🚲"}],
     [('{"source": "a", "target": ', "b}")]),
    ("regex_holder", _fn({"pattern": {"type": "string"}, "flags": {"type": "string", "pattern": "^[gimsuy]*$"}},
                         ["pattern", "flags"]),
     [{"pattern": "^\\d{3}-\\w+\\s*\\\\$", "flags": "gi"}],
     [('{"pattern": "x", "flags": "g', 'z"}')]),
    ("markdown_doc", _fn({"title": {"type": "string", "minLength": 1}, "body": {"type": "string"}}, ["title", "body"]),
     [{"title": "Notes — \"draft\"", "body": "# Heading\n\n* item\n* `code`\n\n> quote\r\n"}],
     [('{"title": "', '", "body": ""}')]),
    ("csv_row", {"type": "array", "items": {"type": "string"}, "minItems": 1},
     [["a,b", "say \"hi\"", "line\nbreak", "ä"]],
     [("[", "]"), ('["a", ', "1]")]),
    ("unicode_escapes", _fn({"text": {"type": "string"}}, ["text"]),
     [{"text": "\u0001\u001f\u0080\u00a0\u2028\u2029\ufeff"}],
     [('{"text": "a', '\n"}')]),
    # -- keywords ---------------------------------------------------------------------------------
    ("type_arrays", _fn({"value": {"type": ["integer", "string", "null"]},
                         "flag": {"type": ["boolean", "null"]}}, ["value", "flag"]),
     [{"value": 3, "flag": None}, {"value": "three", "flag": False}, {"value": None, "flag": True}],
     [('{"value": 3', '.5, "flag": null}')]),
    ("all_of_mixin", {"allOf": [
        {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}}, "required": ["id"]},
        {"type": "object", "properties": {"tag": {"type": "string", "maxLength": 8}}, "required": ["tag"]}]},
     [{"id": 7, "tag": "new"}],
     [('{"id": ', '0, "tag": "x"}')]),
    ("any_of_shapes", {"anyOf": [
        _fn({"circle": {"type": "number", "exclusiveMinimum": 0}}, ["circle"]),
        _fn({"rect": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False,
                      "minItems": 2}}, ["rect"])]},
     [{"circle": 1.5}, {"rect": [2, 3]}],
     [('{"circle": 0', "}"), ('{"rect": [2, 3', ', 4]}')]),
    ("config_const_enum", _fn({"version": {"const": 2}, "mode": {"enum": ["fast", "safe", None]},
                               "retries": {"type": "integer", "minimum": 0, "exclusiveMaximum": 5},
                               "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
                              ["version", "mode", "retries", "ratio"]),
     [{"version": 2, "mode": None, "retries": 4, "ratio": 0.25}, {"version": 2, "mode": "safe", "retries": 0,
                                                                    "ratio": 1}],
     [('{"version": ', '3, "mode": "fast", "retries": 0, "ratio": 0}'),
      ('{"version": 2, "mode": "fast", "retries": ', '5, "ratio": 0}'),
      ('{"version": 2, "mode": "fast", "retries": 1, "ratio": 1.', '5}')]),
    ("temperatures", {"type": "array", "items": {"type": "number", "minimum": -273.15, "maximum": 1000},
                      "maxItems": 4},
     [[-273.15, 0, 21.5, 1000], []],
     [("[-27", "4]"), ("[1, 2, 3, 4", ", 5]")]),
    ("string_lengths", _fn({"code": {"type": "string", "minLength": 4, "maxLength": 4},
                            "note": {"type": "string", "maxLength": 3}}, ["code", "note"]),
     [{"code": "AB\"\\", "note": "é\n"}],
     [('{"code": "ABCD', 'E", "note": ""}'), ('{"code": "ABC', '", "note": ""}')]),
    ("optional_props_any_subset", {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}, "additionalProperties": False},
     [{}, {"b": "x"}, {"a": 1, "c": True}, {"a": 1, "b": "y", "c": False}],
     [('{"a": 1', ' "b": "x"}'), ('{"', 'd": 1}')]),
]
