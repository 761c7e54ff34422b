"""Gemini API field spellings, and Google's ``Schema`` as JSON Schema: what the Gemini dialect
(:mod:`capture_proxy.dialects.gemini`) reads requests with."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


@functools.cache
def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest)


def get_field(obj: dict[str, Any], name: str) -> Any:
    """``obj``'s field ``name`` (lowerCamelCase) under either spelling proto3 JSON accepts."""
    value = obj.get(name)
    return obj.get(snake(name)) if value is None else value


def json_schema(schema: Any) -> Any:
    """Google's OpenAPI-style ``Schema`` as JSON Schema (the Gemini dialect's contract); property names and
    values such as ``enum`` or ``default`` are kept as they are."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        name = camel(key)
        if name == "type" and isinstance(value, str):
            out["type"] = value.lower()
        elif name == "properties" and isinstance(value, dict):
            out["properties"] = {prop: json_schema(sub) for prop, sub in value.items()}
        elif name == "items":
            out["items"] = json_schema(value)
        elif name == "anyOf" and isinstance(value, list):
            out["anyOf"] = [json_schema(sub) for sub in value]
        elif name not in ("nullable", "propertyOrdering"):
            out[name] = value
    if get_field(schema, "nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out
