"""OTLP export requests (traces and logs) decoded into plain rows, with ``opentelemetry-proto``.

Both encodings OTLP/HTTP defines: binary protobuf, and OTLP/JSON, which is protobuf's JSON
mapping except that trace and span ids are hex strings (not base64): they are turned into what
protobuf's parser expects, then the same message is read. Unknown fields are ignored, as the
specification asks of receivers. A span or log record whose ids are malformed is rejected
alone (the answer's partial success counts it); a body that does not parse is refused whole.
Nothing here touches the database."""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format  # type: ignore[import-untyped]
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsPartialSuccess,
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

# Attributes (span's or resource's) that tie telemetry to Hangar's objects.
SANDBOX_KEY, RUN_KEY, HARNESS_KEY = "hangar.sandbox.id", "hangar.run.id", "hangar.harness.id"


class BadRequest(ValueError):
    """The body is not an OTLP export request of the kind posted."""


@dataclass
class Decoded:
    rows: list[dict[str, Any]] = field(default_factory=list)
    rejected: int = 0
    errors: list[str] = field(default_factory=list)


def text(s: str) -> str:
    """``s`` without NUL characters (U+FFFD in their place): Postgres's text and jsonb cannot
    hold one, and a receiver should not refuse a whole export request for one."""
    return s.replace("\x00", "\ufffd") if "\x00" in s else s


def value(v: Any) -> Any:
    """An OTLP ``AnyValue`` as its JSON type: ``123``, ``true``, ``"text"``, lists, objects;
    bytes as base64."""
    kind = v.WhichOneof("value")
    if kind == "string_value":
        s = v.string_value
        return s.replace("\x00", "\ufffd") if "\x00" in s else s
    if kind is None:
        return None
    if kind == "double_value":
        d = v.double_value
        return d if math.isfinite(d) else str(d)  # JSON (and jsonb) has no NaN or infinity
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    if kind == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    return getattr(v, kind)


def attributes(kvs: Any) -> dict[str, Any]:
    out = {kv.key: value(kv.value) for kv in kvs}
    if "\x00" in "".join(out):
        return {text(k): v for k, v in out.items()}
    return out


def _hex(raw: bytes, size: int) -> str | None:
    return raw.hex() if len(raw) == size and any(raw) else None


def _tied(attrs: dict[str, Any], resource: dict[str, Any], key: str) -> str:
    found = attrs.get(key) or resource.get(key) or ""
    return str(found)[:32]


# -- parsing ------------------------------------------------------------------------------------


def _from_json(body: bytes, message: Any, id_paths: tuple[tuple[str, ...], ...]) -> Any:
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequest("an OTLP/JSON body is an object")
    for path in id_paths:
        _ids_to_base64(doc, path)
    try:
        return json_format.ParseDict(doc, message, ignore_unknown_fields=True)
    except (json_format.ParseError, TypeError, ValueError) as exc:
        raise BadRequest(f"not an OTLP/JSON export request: {exc}") from None


def _ids_to_base64(node: Any, path: tuple[str, ...]) -> None:
    """OTLP/JSON's hex ids, at ``path`` (lists walked), into protobuf JSON's base64."""
    if not path:
        return
    head, rest = path[0], path[1:]
    items = node if isinstance(node, list) else [node]
    for item in items:
        if not isinstance(item, dict) or head not in item:
            continue
        if rest:
            _ids_to_base64(item[head], rest)
        elif isinstance(item[head], str) and item[head]:
            try:
                item[head] = base64.b64encode(binascii.unhexlify(item[head])).decode()
            except (binascii.Error, ValueError):
                raise BadRequest(f"{head} {item[head][:40]!r} is not a hex string") from None


_SPAN = ("resourceSpans", "scopeSpans", "spans")
_LOG = ("resourceLogs", "scopeLogs", "logRecords")
TRACE_IDS = tuple((*_SPAN, key) for key in ("traceId", "spanId", "parentSpanId")) + tuple(
    (*_SPAN, "links", key) for key in ("traceId", "spanId")
)
LOG_IDS = tuple((*_LOG, key) for key in ("traceId", "spanId"))


def parse(kind: str, body: bytes, content_type: str) -> Any:
    """The export request (``kind``: traces or logs) in ``body``; raises :class:`BadRequest`."""
    message: Any = ExportTraceServiceRequest() if kind == "traces" else ExportLogsServiceRequest()
    if content_type == JSON:
        return _from_json(body, message, TRACE_IDS if kind == "traces" else LOG_IDS)
    try:
        message.ParseFromString(body)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise BadRequest(f"not an OTLP protobuf export request: {exc}") from None
    return message


def answer(kind: str, rejected: int, error: str, content_type: str) -> bytes:
    """The export response: empty, or a partial success naming what was rejected and why."""
    if kind == "traces":
        response: Any = ExportTraceServiceResponse()
        if rejected:
            response.partial_success.CopyFrom(
                ExportTracePartialSuccess(rejected_spans=rejected, error_message=error)
            )
    else:
        response = ExportLogsServiceResponse()
        if rejected:
            response.partial_success.CopyFrom(
                ExportLogsPartialSuccess(rejected_log_records=rejected, error_message=error)
            )
    if content_type == JSON:
        return json.dumps(json_format.MessageToDict(response)).encode()
    return bytes(response.SerializeToString())


# -- rows ---------------------------------------------------------------------------------------


def span_rows(request: Any) -> Decoded:
    out = Decoded()
    for rs in request.resource_spans:
        resource = attributes(rs.resource.attributes)
        service = str(resource.get("service.name") or "")[:255]
        for ss in rs.scope_spans:
            scope = {"name": text(ss.scope.name), "version": text(ss.scope.version)}
            for span in ss.spans:
                trace_id, span_id = _hex(span.trace_id, 16), _hex(span.span_id, 8)
                if trace_id is None or span_id is None:
                    out.rejected += 1
                    out.errors.append(f"span {text(span.name[:60])!r} has no valid trace or span id")
                    continue
                parent = _hex(span.parent_span_id, 8) or ""
                attrs = attributes(span.attributes)
                out.rows.append({
                    "trace_id": trace_id, "span_id": span_id, "parent_span_id": parent,
                    "name": text(span.name[:255]) or "(unnamed)", "kind": int(span.kind),
                    "start_ns": int(span.start_time_unix_nano),
                    "end_ns": max(int(span.end_time_unix_nano), int(span.start_time_unix_nano)),
                    "status_code": int(span.status.code), "status_message": text(span.status.message),
                    "attributes": attrs,
                    "events": [
                        {"name": text(e.name), "time_ns": int(e.time_unix_nano), "attributes": attributes(e.attributes)}
                        for e in span.events
                    ],
                    "links": [
                        {"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex(),
                         "attributes": attributes(link.attributes)}
                        for link in span.links
                    ],
                    "resource": resource, "scope": scope, "service": service,
                    "sandbox_id": _tied(attrs, resource, SANDBOX_KEY), "run_id": _tied(attrs, resource, RUN_KEY),
                    "harness_id": _tied(attrs, resource, HARNESS_KEY),
                })  # fmt: skip
    return out


def log_rows(request: Any) -> Decoded:
    out = Decoded()
    for rl in request.resource_logs:
        resource = attributes(rl.resource.attributes)
        service = str(resource.get("service.name") or "")[:255]
        for sl in rl.scope_logs:
            for record in sl.log_records:
                trace_id = _hex(record.trace_id, 16) or ""
                if record.trace_id and not trace_id:
                    out.rejected += 1
                    out.errors.append("a log record's trace id is not 16 bytes")
                    continue
                attrs = attributes(record.attributes)
                out.rows.append({
                    "trace_id": trace_id, "span_id": _hex(record.span_id, 8) or "",
                    "time_ns": int(record.time_unix_nano or record.observed_time_unix_nano),
                    "severity_number": int(record.severity_number), "severity_text": text(record.severity_text[:32]),
                    "body": value(record.body) if record.HasField("body") else None,
                    "attributes": attrs, "resource": resource, "service": service,
                    "sandbox_id": _tied(attrs, resource, SANDBOX_KEY), "run_id": _tied(attrs, resource, RUN_KEY),
                    "harness_id": _tied(attrs, resource, HARNESS_KEY),
                })  # fmt: skip
    return out
