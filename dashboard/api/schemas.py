"""What every operation of the API shares: its error answer, strict JSON input, how requests
are parsed, and the error statuses that follow from an operation's shape (documented in the
OpenAPI schema)."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote_to_bytes

from django.http import HttpRequest
from django.utils.datastructures import MultiValueDict
from ninja import NinjaAPI, Schema
from ninja.errors import ValidationError
from ninja.parser import Parser
from ninja.schema import DjangoGetter
from pydantic import BaseModel, ConfigDict, Field, model_validator


class ErrorOut(Schema):
    """Every error answer. Some carry more than ``detail``: a 429 its ``quota``, ``used``,
    ``requested`` and ``limit``; a 409 the thing's ``status``; a 422 from validation its
    ``errors``; a 413 its ``limit``; a 400 for an unknown image the ``images`` there are."""

    model_config = ConfigDict(extra="allow")

    detail: str = Field(description="what went wrong, and what to change")


class ObjectIn(Schema):
    """A request body (or a part of one) that is a JSON object. ninja's ``Schema`` reads its
    fields as attributes of whatever it is given, so without this ``[null]``, ``5`` or
    ``"x"`` would pass as an object with every field at its default."""

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, data: Any) -> Any:
        given = data._obj if isinstance(data, DjangoGetter) else data  # ninja wraps it first
        if isinstance(given, dict | BaseModel) or not isinstance(
            given, str | bytes | int | float | list | tuple
        ):
            return data
        raise ValueError(f"must be a JSON object, not {_json_type(given)}")


def _json_type(value: Any) -> str:
    value = value._obj if isinstance(value, DjangoGetter) else value
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list | tuple):
        return "an array"
    return "a string"


class StrictIn(ObjectIn):
    """A JSON request body, taken as its schema types it: `true` is not a number and `"1"` is
    not an integer (pydantic's lax mode would take both); a field it does not have is a 422
    naming it (a misspelt ``timout_s`` would otherwise be dropped without a word, and the
    default used). The schema says so (``additionalProperties: false``)."""

    model_config = ConfigDict(strict=True, extra="forbid")


def errors(*codes: int) -> dict[int, type[ErrorOut]]:
    """Responses for the error statuses an operation's service can answer with, beyond those
    its shape implies (see :func:`document_errors`): ``response={200: X, **errors(409)}``."""
    return {code: ErrorOut for code in codes}


# The most rows a list may skip (the database takes up to 2**63 - 1; no list is near this).
MAX_OFFSET = 2**31 - 1
# Streamed answers (a command's output, a run's log): one JSON object per line, as it comes.
NDJSON_CONTENT: dict[str, Any] = {
    "schema": {"type": "string", "description": "newline-delimited JSON: one event object per line"}
}
BINARY_CONTENT: dict[str, Any] = {"schema": {"type": "string", "format": "binary"}}

# A \uD800-\uDFFF escape: only then can a parsed JSON string hold a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class BodyError(ValueError):
    """A body that is not a JSON object the API can read (ninja answers it 400)."""


class ApiParser(Parser):
    """JSON bodies and query strings as the API takes them. A JSON string with a lone UTF-16
    surrogate (``"\\ud800"``) is not text anything downstream can encode: the body is refused
    (400) rather than failing later. A query parameter whose percent-encoded bytes are not UTF-8
    is refused (422), where Django would have turned them into U+FFFD and gone on with another
    value than the one sent (a ``?path=`` naming a different file)."""

    def parse_body(self, request: HttpRequest) -> Any:
        try:
            data = json.loads(request.body)
        except ValueError as exc:
            raise BodyError(f"the body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            # Every body this API takes is an object; ninja would read anything else as {}.
            raise BodyError(f"the body must be a JSON object, not {type(data).__name__}")
        if _SURROGATE_ESCAPE.search(request.body) and has_lone_surrogate(data):
            raise BodyError("a string in the body holds a lone UTF-16 surrogate: send text as UTF-8")
        return data

    # A parameter that takes one value, given more than once, is refused (422): Django's
    # QueryDict would answer its last and drop the rest, so `?offset=1&offset=x` was read as
    # whatever came last (found by schemathesis: an array where the schema says integer).
    single_values = True

    def parse_querydict(self, data: MultiValueDict, list_fields: list[str], request: HttpRequest) -> Any:
        if data is request.GET:
            _require_utf8_query(request.META.get("QUERY_STRING", ""))
            if self.single_values:
                _require_single_values(data, list_fields)
        return super().parse_querydict(data, list_fields, request)


# Where a request's values came from (and the body parameter's name), left out of a message's
# field path: ("body", "payload", "cpu") is "cpu", ("query", "path") is "path".
_SOURCES = ({"body", "query", "path", "header", "cookie"}, {"payload"})
# Names pydantic gives the members of a union in an error's location ("str", "list[str]",
# "constrained-int", "function-wrap[…]"): not fields.
_PLAIN_TYPES = {"str", "int", "float", "bool", "none"}  # (no field is called so)


def _union_member(part: Any) -> bool:
    return isinstance(part, str) and (part in _PLAIN_TYPES or "[" in part or "-" in part)


def explain(errors: list[dict[str, Any]]) -> str:
    """Validation errors as one line, ``field: what is wrong; …``. A value that fits none of a
    union's members is explained by one member only: the first whose error is inside the value
    (an object port with a bad field is told about that field, not that it is no integer), else
    the first (an out-of-range port is "less than or equal to 65535", not that and "an object
    needs a port" too)."""
    messages: list[str] = []
    chosen = _chosen_members(errors)
    for err in errors:
        path: list[Any] = []
        skip = False
        for part in _located(err):
            if _union_member(part):
                if chosen.get(tuple(path)) != part:
                    skip = True
                    break
                continue
            path.append(part)
        message = err.get("msg", "invalid")
        if err.get("type") == "extra_forbidden":
            message = "not a field of this request (see its schema for the fields there are)"
        line = f"{'.'.join(map(str, path))}: {message}" if path else message
        if not skip and line not in messages:
            messages.append(line)
    return "; ".join(messages)


def _located(err: dict[str, Any]) -> list[Any]:
    """An error's location without where it came from (``body``, ``payload``…)."""
    loc = list(err.get("loc", ()))
    for names in _SOURCES:
        if loc and loc[0] in names:
            loc.pop(0)
    return loc


def _chosen_members(errors: list[dict[str, Any]]) -> dict[tuple[Any, ...], Any]:
    """For each union in the errors (by the path to it), the member that explains it: the first
    with an error inside the value (a field of it), else the first."""
    members: dict[tuple[Any, ...], dict[Any, bool]] = {}
    for err in errors:
        path: list[Any] = []
        loc = _located(err)
        for i, part in enumerate(loc):
            if _union_member(part):
                inside = i + 1 < len(loc) and not _union_member(loc[i + 1])
                seen = members.setdefault(tuple(path), {})
                seen[part] = seen.get(part, False) or inside
                continue
            path.append(part)
    return {
        prefix: next((m for m, inside in seen.items() if inside), next(iter(seen)))
        for prefix, seen in members.items()
    }


def has_lone_surrogate(value: Any) -> bool:
    """Whether parsed JSON holds a string with a lone UTF-16 surrogate (it cannot be encoded)."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_lone_surrogate(v) for v in value)
    return False


def _require_single_values(data: MultiValueDict, list_fields: list[str]) -> None:
    for key, values in data.lists():
        if len(values) > 1 and key not in list_fields:
            raise ValidationError([{
                "loc": ["query", key], "type": "repeated",
                "msg": f"is given {len(values)} times; give it once (only list parameters repeat)",
            }])  # fmt: skip


def _require_utf8_query(query: str) -> None:
    for part in query.split("&"):
        key, _, value = part.partition("=")
        for raw in (key, value):
            try:
                unquote_to_bytes(raw.replace("+", " ")).decode()
            except UnicodeDecodeError:
                name = unquote_to_bytes(key.replace("+", " ")).decode(errors="replace")
                raise ValidationError([{
                    "loc": ["query", name], "type": "utf8",
                    "msg": "is not valid UTF-8 (percent-encode the UTF-8 bytes of the text)",
                }]) from None  # fmt: skip


def document_errors(api: NinjaAPI) -> None:
    """Give each operation the error responses its shape implies, so none can be forgotten:
    401 and 403 when it needs a token (no valid token; the token's role or scopes), 400, 413
    and 422 when it takes a body (not JSON; over its size limit; not as the schema says), 422
    when it takes query parameters, 404 and 422 when its path names a thing (not found; not an
    id at all). Statuses that only some services answer (409, 429, 502, 503) each operation
    declares."""
    for router in api._get_bound_routers():
        for path_view in router.path_operations.values():
            for operation in path_view.operations:
                codes: set[int] = set()
                if operation.auth_callbacks:
                    codes |= {401, 403}
                sources = {model.__ninja_param_source__: model for model in operation.models}
                if "body" in sources:
                    codes |= {400, 413, 422}
                if "query" in sources:
                    codes.add(422)
                if "path" in sources:
                    # 422 too: an id that is not a number where one is, or that holds a NUL.
                    codes |= {404, 422}
                for code in sorted(codes):
                    if code not in operation.response_models:
                        operation.response_models[code] = operation._create_response_model(ErrorOut)
