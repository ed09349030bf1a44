"""The OpenAPI 3.1 document of the tasks API, precise enough for generated clients and fuzzers."""

from __future__ import annotations

from typing import Any

from tasks.filetypes import KINDS, TARGET_FORMATS
from tasks.selectors import STAGES
from tasks.states import WAITING_REASONS, State

ALL_TARGETS = sorted({t for targets in TARGET_FORMATS.values() for t in targets})
WAITING = list(WAITING_REASONS)


def _problem(description: str, codes: list[str], *, retry_after: bool = False) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": f"{description} (code: {', '.join(codes)})",
        "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }
    if retry_after:
        response["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait."}}
    return response


UNAUTHENTICATED = _problem("Missing or unknown token", ["unauthenticated"])
NOT_FOUND = _problem("No such resource for this tenant", ["not_found"])
TASK_ID = {"name": "task_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}}


def document(base_url: str) -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Sluice tasks API",
            "version": "1.0.0",
            "description": "Upload files, submit tasks (202 Accepted), follow, cancel and download results.",
        },
        "servers": [{"url": base_url.rstrip("/")}],
        "security": [{"bearer": []}],
        "paths": {
            "/api/v1/files": {
                "post": {
                    "operationId": "uploadFile",
                    "summary": "Store an immutable file version",
                    "parameters": [{"name": "X-Filename", "in": "header", "required": False, "schema": {"type": "string", "maxLength": 255},
                                    "description": "Display label only; never used to build a path."}],
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                            "multipart/form-data": {
                                "schema": {"type": "object", "required": ["file"],
                                           "properties": {"file": {"type": "string", "format": "binary"}}}
                            },
                        },
                    },
                    "responses": {
                        "201": {"description": "Stored", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/File"}}}},
                        "400": _problem("Empty file or bad request", ["empty_file", "invalid_request"]),
                        "401": UNAUTHENTICATED,
                        "413": _problem("Over the size limit", ["file_too_large"]),
                        "415": _problem("Content type not processed", ["unsupported_type"]),
                        "429": _problem("Over quota", ["over_quota"], retry_after=True),
                    },
                }
            },
            "/api/v1/files/{file_id}": {
                "get": {
                    "operationId": "getFile",
                    "parameters": [{"name": "file_id", "in": "path", "required": True, "schema": {"type": "string", "format": "uuid"}}],
                    "responses": {
                        "200": {"description": "The file version", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/File"}}}},
                        "401": UNAUTHENTICATED,
                        "404": _problem("No such file", ["file_not_found"]),
                    },
                }
            },
            "/api/v1/tasks": {
                "post": {
                    "operationId": "submitTask",
                    "summary": "Submit a task; 202 means accepted and durable, not done",
                    "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False,
                                    "schema": {"type": "string", "minLength": 1, "maxLength": 255}}],
                    "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Submission"}}}},
                    "responses": {
                        "202": {
                            "description": "Accepted",
                            "headers": {"Location": {"schema": {"type": "string"}},
                                        "Idempotent-Replayed": {"schema": {"type": "string", "enum": ["true"]}}},
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Accepted"}}},
                        },
                        "400": _problem("Invalid request", ["invalid_request"]),
                        "401": UNAUTHENTICATED,
                        "404": _problem("No such file", ["file_not_found"]),
                        "409": _problem("Key in use", ["idempotency_key_in_use"], retry_after=True),
                        "422": _problem("Key reused with another request, or file quarantined",
                                        ["idempotency_key_mismatch", "file_quarantined"]),
                        "429": _problem("Tenant quota", ["over_quota"], retry_after=True),
                        "503": _problem("Admission closed", ["backlog_full"], retry_after=True),
                    },
                },
                "get": {
                    "operationId": "listTasks",
                    "parameters": [
                        {"name": "state", "in": "query", "required": False, "schema": {"type": "string"},
                         "description": "One state or several, comma-separated."},
                        {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1, "maximum": 200}},
                        {"name": "cursor", "in": "query", "required": False, "schema": {"type": "string"}},
                    ],
                    "responses": {
                        "200": {"description": "A page of tasks, newest first", "content": {"application/json": {"schema": {
                            "type": "object", "required": ["data", "next_cursor"],
                            "properties": {"data": {"type": "array", "items": {"$ref": "#/components/schemas/Task"}},
                                           "next_cursor": {"type": ["string", "null"]}}}}}},
                        "400": _problem("Invalid filter", ["invalid_request"]),
                        "401": UNAUTHENTICATED,
                    },
                },
            },
            "/api/v1/tasks/{task_id}": {
                "get": {
                    "operationId": "getTask",
                    "parameters": [TASK_ID],
                    "responses": {
                        "200": {"description": "The task", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Task"}}}},
                        "401": UNAUTHENTICATED,
                        "404": NOT_FOUND,
                    },
                }
            },
            "/api/v1/tasks/{task_id}/events": {
                "get": {
                    "operationId": "getTaskEvents",
                    "parameters": [TASK_ID],
                    "responses": {
                        "200": {"description": "The task's history", "content": {"application/json": {"schema": {
                            "type": "object", "properties": {"data": {"type": "array", "items": {"$ref": "#/components/schemas/Event"}}}}}}},
                        "401": UNAUTHENTICATED,
                        "404": NOT_FOUND,
                    },
                }
            },
            "/api/v1/tasks/{task_id}/cancel": {
                "post": {
                    "operationId": "cancelTask",
                    "parameters": [TASK_ID],
                    "responses": {
                        "202": {"description": "CANCELLED at once, or CANCEL_REQUESTED while the vendor is asked to stop",
                                "content": {"application/json": {"schema": {"type": "object", "required": ["id", "state"],
                                            "properties": {"id": {"type": "string"}, "state": {"type": "string"}}}}}},
                        "401": UNAUTHENTICATED,
                        "404": NOT_FOUND,
                        "409": _problem("Already finished", ["already_finished"]),
                    },
                }
            },
            "/api/v1/tasks/{task_id}/result": {
                "get": {
                    "operationId": "getTaskResult",
                    "parameters": [TASK_ID],
                    "responses": {
                        "200": {"description": "The result bytes",
                                "headers": {"X-Content-SHA256": {"schema": {"type": "string"}},
                                            "Content-Disposition": {"schema": {"type": "string"}}},
                                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                        "401": UNAUTHENTICATED,
                        "404": NOT_FOUND,
                        "409": _problem("Not ready", ["not_ready"]),
                        "410": _problem("Past retention", ["result_expired"]),
                    },
                }
            },
            "/api/v1/tasks/{task_id}/result-link": {
                "post": {
                    "operationId": "createResultLink",
                    "parameters": [TASK_ID],
                    "responses": {
                        "201": {"description": "An expiring signed link", "content": {"application/json": {"schema": {
                            "type": "object", "properties": {"url": {"type": "string"}, "expires_at": {"type": "string", "format": "date-time"}}}}}},
                        "401": UNAUTHENTICATED,
                        "404": NOT_FOUND,
                        "409": _problem("Not ready", ["not_ready"]),
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Problem": {
                    "type": "object", "required": ["type", "title", "status", "code", "detail"],
                    "properties": {"type": {"type": "string"}, "title": {"type": "string"}, "status": {"type": "integer"},
                                   "code": {"type": "string"}, "detail": {"type": "string"}},
                },
                "File": {
                    "type": "object", "required": ["id", "sha256", "size", "detected_type", "created_at"],
                    "properties": {"id": {"type": "string", "format": "uuid"}, "sha256": {"type": "string"},
                                   "size": {"type": "integer"}, "detected_type": {"type": "string"},
                                   "created_at": {"type": "string", "format": "date-time"},
                                   "precheck": {"type": "string", "enum": ["pending", "passed", "quarantined"]}},
                },
                "Submission": {
                    "type": "object", "required": ["file_id", "kind", "target_format"], "additionalProperties": False,
                    "properties": {
                        "file_id": {"type": "string", "format": "uuid"},
                        "kind": {"type": "string", "enum": list(KINDS)},
                        "target_format": {"type": "string", "enum": ALL_TARGETS},
                        "params": {"type": "object"},
                        "priority": {"type": "string", "enum": ["interactive", "batch"]},
                        "deadline_s": {"type": "number", "minimum": 60, "maximum": 2592000},
                        "callback_url": {"type": "string", "format": "uri"},
                    },
                },
                "Accepted": {
                    "type": "object", "required": ["id", "state", "status_url", "created_at"],
                    "properties": {"id": {"type": "string", "format": "uuid"}, "state": {"type": "string", "enum": State.values},
                                   "status_url": {"type": "string"}, "created_at": {"type": "string", "format": "date-time"},
                                   "waiting_reason": {"type": "string", "enum": ["lane_full"],
                                                      "description": "Present when the task was accepted but waits to enter its lane."}},
                },
                "Task": {
                    "type": "object",
                    "required": ["id", "state", "kind", "target_format", "priority", "created_at", "attempts", "waiting_reason", "error", "result"],
                    "properties": {
                        "id": {"type": "string", "format": "uuid"},
                        "state": {"type": "string", "enum": State.values},
                        "kind": {"type": "string", "enum": list(KINDS)},
                        "target_format": {"type": "string"},
                        "priority": {"type": "string"},
                        "lane": {"type": ["string", "null"]},
                        "file_id": {"type": "string"},
                        "created_at": {"type": "string", "format": "date-time"},
                        "queued_at": {"type": ["string", "null"], "format": "date-time"},
                        "started_at": {"type": ["string", "null"], "format": "date-time"},
                        "finished_at": {"type": ["string", "null"], "format": "date-time"},
                        "deadline_at": {"type": ["string", "null"], "format": "date-time"},
                        "queue_deadline_at": {"type": ["string", "null"], "format": "date-time"},
                        "attempts": {"type": "integer"},
                        "waiting_reason": {"type": ["string", "null"], "enum": [*WAITING, None]},
                        "error": {"oneOf": [{"type": "null"}, {"type": "object", "properties": {
                            "code": {"type": "string"}, "message": {"type": "string"}, "retryable": {"type": "boolean"}}}]},
                        "result": {"oneOf": [{"type": "null"}, {"type": "object", "properties": {
                            "url": {"type": "string"}, "sha256": {"type": "string"}, "size": {"type": "integer"},
                            "content_type": {"type": "string"}}}]},
                        "status_url": {"type": "string"},
                        "stages": {
                            "type": "object",
                            "description": "Real seconds the latest attempt spent in each stage; null where not reached.",
                            "properties": {stage: {"type": ["number", "null"]} for stage in STAGES},
                        },
                    },
                },
                "Event": {
                    "type": "object",
                    "properties": {"at": {"type": "string"}, "from": {"type": ["string", "null"]}, "to": {"type": ["string", "null"]},
                                   "actor": {"type": "string"}, "reason": {"type": "string"}, "generation": {"type": "integer"}},
                },
            },
        },
    }
