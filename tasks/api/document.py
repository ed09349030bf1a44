"""What the generated OpenAPI document cannot infer from the declarations: that refusals are
application/problem+json, which stable codes each status carries, and the headers that go with
them (Retry-After, Location, Idempotent-Replayed)."""

from __future__ import annotations

from typing import Any

# Every code the API answers with, by status.
CODES: dict[int, tuple[str, ...]] = {
    400: ("invalid_request", "invalid_json", "invalid_multipart", "empty_file"),
    401: ("unauthenticated", "bad_signature"),
    404: ("not_found", "file_not_found"),
    409: ("idempotency_key_in_use", "already_finished", "not_ready"),
    410: ("result_expired", "link_expired"),
    413: ("payload_too_large", "file_too_large"),
    415: ("unsupported_type",),
    422: ("idempotency_key_mismatch", "file_quarantined"),
    429: ("over_quota",),
    503: ("backlog_full",),
}
RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer", "minimum": 1}, "description": "Seconds to wait before retrying."}}
LOCATION = {"Location": {"schema": {"type": "string"}, "description": "The URL of what was created or accepted."}}
REPLAYED = {"Idempotent-Replayed": {"schema": {"type": "string", "enum": ["true"]},
                                    "description": "This answer replays the request first made with this Idempotency-Key."}}


# What a client can do next with an answer (OpenAPI links): follow an accepted task, and submit
# work on an uploaded file. Stateful fuzzers walk these too.
TASK_LINKS = {name: {"operationId": target, "parameters": {"task_id": "$response.body#/id"}}
              for name, target in (("GetTask", "getTask"), ("GetTaskEvents", "getTaskEvents"), ("CancelTask", "cancelTask"),
                                   ("GetTaskResult", "getTaskResult"), ("CreateResultLink", "createResultLink"))}
LINKS = {
    ("submitTask", 202): TASK_LINKS,
    ("uploadFile", 201): {"GetFile": {"operationId": "getFile", "parameters": {"file_id": "$response.body#/id"}},
                          "SubmitTask": {"operationId": "submitTask", "requestBody": {
                              "file_id": "$response.body#/id", "kind": "transcription", "target_format": "txt"}}},
}


def refine(document: dict[str, Any]) -> dict[str, Any]:
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if operation.get("security", True) != []:
                responses.setdefault(401, {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Problem"}}}})
            for status, response in list(responses.items()):
                _refine_response(int(status), response, operation.get("operationId", ""))
            operation["responses"] = {str(k): responses[k] for k in sorted(responses, key=int)}
    return document


def _refine_response(status: int, response: dict[str, Any], operation_id: str) -> None:
    if status >= 400:
        schema = (response.get("content") or {}).get("application/json", {}).get("schema") or {"$ref": "#/components/schemas/Problem"}
        response["content"] = {"application/problem+json": {"schema": schema}}
        response["description"] = f"code: {' | '.join(CODES.get(status, ('invalid_request',)))}"
        if status in (409, 429, 503):
            response["headers"] = {**response.get("headers", {}), **RETRY_AFTER}
    elif status in (201, 202):
        if (operation_id, status) in LINKS:
            response["links"] = LINKS[(operation_id, status)]
        headers = {**LOCATION, **(REPLAYED if operation_id == "submitTask" else {})}
        if operation_id in ("uploadFile", "submitTask"):
            response["headers"] = {**response.get("headers", {}), **headers}
