"""Requests generated from the OpenAPI schema for the bad-input sweep: for each operation, a
minimal valid request (path ids filled in, required fields at their least values), then the
same request with one parameter or body field at a time set to a value that breaks servers."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# Strings that break servers: traversal, NUL, control characters, markup, a megabyte.
EVIL_STRINGS = [
    "../../../../../../etc/passwd",
    "/proc/1/root/etc/shadow",
    "a\x00b",
    "\x01\x07\x1b[31m\r\n\t",
    "<script>alert(1)</script>{{7*7}}${7*7}",
    "' OR 1=1 --",
    "",
    " ",
    "x" * 1_000_000,
]
HUGE = 2**64


@dataclass
class Probe:
    """One request: what it is (for the report), and how to send it."""

    label: str
    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    body: Any = None
    refused: str = ""  # a word the answer must be a 4xx naming (a field that is not there)


def resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    seen = 0
    while "$ref" in schema and seen < 20:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = spec["components"]["schemas"][name]
        seen += 1
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            options = [o for o in schema[key] if resolve(spec, o).get("type") != "null"]
            if options:
                merged = {k: v for k, v in schema.items() if k != key}
                return {**resolve(spec, options[0]), **merged}
    return schema


def minimal(spec: dict[str, Any], schema: dict[str, Any], depth: int = 0) -> Any:
    """The least valid value of ``schema`` that the sweep knows how to make."""
    s = resolve(spec, schema)
    if "enum" in s:
        return s["enum"][0]
    if "const" in s:
        return s["const"]
    kind = s.get("type")
    if kind == "string":
        examples = s.get("examples") or []
        if examples and isinstance(examples[0], str):
            return examples[0]
        return "x" * max(1, int(s.get("minLength", 1)))
    if kind == "integer":
        return int(s.get("minimum", s.get("exclusiveMinimum", 0) + 1 if "exclusiveMinimum" in s else 1))
    if kind == "number":
        return float(s.get("minimum", 1.0))
    if kind == "boolean":
        return False
    if kind == "array":
        if s.get("minItems") and depth < 4:
            return [minimal(spec, s.get("items", {}), depth + 1)] * int(s["minItems"])
        return []
    if kind == "object" or "properties" in s:
        props = s.get("properties", {})
        return {
            k: minimal(spec, props[k], depth + 1) for k in s.get("required", []) if k in props and depth < 4
        }
    return None


def bad_values(spec: dict[str, Any], schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(what it is, the value) past what ``schema`` takes, or that breaks parsers."""
    s = resolve(spec, schema)
    kind = s.get("type")
    if kind == "string" or "enum" in s:
        for value in EVIL_STRINGS:
            yield f"string {value[:24]!r}{'…' if len(value) > 24 else ''}", value
        if "maxLength" in s:
            yield f"maxLength+1 ({s['maxLength']})", "y" * (int(s["maxLength"]) + 1)
    elif kind in ("integer", "number"):
        for bound, delta in (
            ("maximum", 1),
            ("exclusiveMaximum", 0),
            ("minimum", -1),
            ("exclusiveMinimum", 0),
        ):
            if bound in s:
                yield f"{bound}{delta:+d}", s[bound] + delta
        yield "2**64", HUGE
        yield "-2**64", -HUGE
        yield "a string", "12abc"
        if kind == "number":
            yield "1e309", 1e308 * 10  # inf: not valid JSON; httpx refuses or sends Infinity
    elif kind == "array":
        yield "a string for an array", "x"
        yield "10,000 items", ["x"] * 10_000
    elif kind == "object" or "properties" in s:
        yield "a list for an object", []
        if s.get("additionalProperties") not in (None, False):
            yield "NUL and traversal in a key", {"../a\x00": "v", "K": "\x00"}
    elif kind == "boolean":
        yield "a string for a boolean", "maybe"


def probes(spec: dict[str, Any], fill: dict[str, str], prefix: str = "/api/v1") -> Iterator[Probe]:
    """Every operation's minimal request, then each of its inputs broken in turn."""
    for path, item in spec["paths"].items():
        for method, op in item.items():
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            real = path
            for p in op.get("parameters", []):
                if p["in"] == "path":
                    real = real.replace("{" + p["name"] + "}", fill.get(p["name"], "999999"))
            query = {p["name"]: minimal(spec, p["schema"]) for p in op.get("parameters", [])
                     if p["in"] == "query" and p.get("required")}  # fmt: skip
            body_schema = (
                op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            )
            body = minimal(spec, body_schema) if body_schema else None
            name = f"{method.upper()} {path}"
            yield Probe(f"{name} minimal", method.upper(), real, dict(query), copy.deepcopy(body))
            for p in op.get("parameters", []):
                if p["in"] != "query":
                    continue
                for what, value in bad_values(spec, p["schema"]):
                    if isinstance(value, (list, dict)):
                        continue  # a query parameter is a string
                    if isinstance(value, str):
                        value = value[:60_000]  # a URL's limit (clients refuse longer)
                    yield Probe(f"{name} ?{p['name']}={what}", method.upper(), real, {**query, p["name"]: value},
                                copy.deepcopy(body))  # fmt: skip
            if body_schema is None:
                continue
            props = resolve(spec, body_schema).get("properties", {})
            for key, prop in props.items():
                for what, value in bad_values(spec, prop):
                    yield Probe(f"{name} .{key}={what}", method.upper(), real, dict(query),
                                {**(body or {}), key: value})  # fmt: skip
            if isinstance(body, dict):
                yield Probe(f"{name} unknown field", method.upper(), real, dict(query),
                            {**body, "zz_unknown": 1}, refused="zz_unknown")  # fmt: skip
                yield Probe(f"{name} a list for the body", method.upper(), real, dict(query), [body])
