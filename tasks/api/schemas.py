"""The tasks API's shapes, declared once: requests are validated against these models and the
OpenAPI document is generated from them (tasks/api/views.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from ninja import Schema
from pydantic import BaseModel, ConfigDict, Field, Strict, create_model, field_validator

from tasks.filetypes import TARGET_FORMATS
from tasks.outbound import MAX_URL, OutboundRefused
from tasks.selectors import STAGES
from tasks.services.intake import MAX_DEADLINE_S, MAX_PARAMS_BYTES, SubmitRequest
from tasks.services.notifications import callback_url_validate
from tasks.states import WAITING_REASONS, State

StateName = Literal[tuple(State.values)]
WaitingReason = Literal[tuple(WAITING_REASONS)]
STATE_LIST = rf"^({'|'.join(State.values)})(,({'|'.join(State.values)}))*$"


class Problem(Schema):
    """RFC 9457 problem details; `code` is stable, `detail` says what to do."""

    type: str
    title: str
    status: int
    code: str
    detail: str
    field: str | None = None


# --- submissions ---------------------------------------------------------------------------------

class _Submission(BaseModel):
    # pydantic's model, not ninja's Schema: an input needs none of Schema's reading of Django
    # objects, whose wrapping validator every submission paid.
    model_config = ConfigDict(extra="forbid")

    file_id: str = Field(min_length=1, max_length=100, description="The id returned by POST /api/v1/files.")
    params: dict[str, Any] | None = Field(None, description=f"Options for the vendor; at most {MAX_PARAMS_BYTES} bytes of JSON.")
    priority: Literal["interactive", "batch"] = "batch"
    deadline_s: Annotated[float, Strict(), Field(ge=60, le=MAX_DEADLINE_S)] | None = Field(
        None, description="Seconds from acceptance by which the task must be finished (default 24 hours).")
    callback_url: str | None = Field(None, max_length=MAX_URL, pattern=r"^(https?://.+)?$", description=(
        "Called once the task is final. An http(s) URL whose host resolves only to public addresses."))

    @field_validator("params")
    @classmethod
    def _params_bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        import json

        if value is not None and len(json.dumps(value)) > MAX_PARAMS_BYTES:
            raise ValueError(f"params must be at most {MAX_PARAMS_BYTES} bytes of JSON")
        return value

    @field_validator("callback_url")
    @classmethod
    def _callback_callable(cls, value: str | None) -> str | None:
        if value:
            try:
                callback_url_validate(value)
            except OutboundRefused as refused:
                raise ValueError(refused.detail.rstrip(".")) from None
        return value

    def to_request(self) -> SubmitRequest:
        return SubmitRequest(
            file_id=self.file_id, kind=self.kind, target_format=self.target_format, params=self.params or {},
            priority=self.priority, deadline_s=self.deadline_s, callback_url=self.callback_url or "",
        )


class TranscriptionSubmission(_Submission):
    kind: Literal["transcription"]
    target_format: Literal[TARGET_FORMATS["transcription"]]


class ConversionSubmission(_Submission):
    kind: Literal["conversion"]
    target_format: Literal[TARGET_FORMATS["conversion"]]


# Which target formats a kind allows is part of the type: the document says it with a
# discriminated oneOf, and validation refuses any other pairing.
Submission = Annotated[Union[TranscriptionSubmission, ConversionSubmission], Field(discriminator="kind")]


MAX_BATCH = 500


class BatchSubmission(Schema):
    model_config = ConfigDict(extra="forbid")

    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_BATCH, description=(
        f"Up to {MAX_BATCH} submissions, each the body of submitTask plus its own optional `idempotency_key` "
        "(1-255 characters; the same rules as the Idempotency-Key header). Each item is checked and accepted on "
        "its own: a refused item stores nothing and does not stop the others."))


# --- answers ------------------------------------------------------------------------------------

class FileOut(Schema):
    id: str
    sha256: str
    size: int
    detected_type: str
    created_at: str
    precheck: Literal["pending", "passed", "quarantined"]


class Accepted(Schema):
    id: str
    state: StateName
    status_url: str
    created_at: str
    waiting_reason: Literal["lane_full"] | None = Field(
        None, description="Present when the task was accepted but waits to enter its lane.")


class BatchItemOut(Schema):
    index: int = Field(description="The item's position in the request.")
    status: int = Field(description="202 accepted (or replayed), else the problem status a single submission would get.")
    id: str | None = None
    state: StateName | None = None
    status_url: str | None = None
    created_at: str | None = None
    replayed: bool | None = Field(None, description="The item's idempotency_key named a task accepted earlier.")
    waiting_reason: Literal["lane_full"] | None = None
    code: str | None = Field(None, description="The problem code of a refused item.")
    detail: str | None = None
    field: str | None = None


class BatchOut(Schema):
    data: list[BatchItemOut]
    accepted: int
    replayed: int
    refused: int


class TaskError(Schema):
    code: str
    message: str
    retryable: bool


class TaskResult(Schema):
    url: str
    sha256: str
    size: int
    content_type: str


Stages = create_model("Stages", __base__=Schema, __doc__="Real seconds the latest attempt spent in each stage; null where not reached.",
                      **{stage: (float | None, None) for stage in STAGES})


class TaskOut(Schema):
    id: str
    state: StateName
    kind: Literal[tuple(TARGET_FORMATS)]
    target_format: str
    priority: Literal["interactive", "batch"]
    lane: str | None
    file_id: str
    created_at: str
    queued_at: str | None
    started_at: str | None
    finished_at: str | None
    deadline_at: str | None
    queue_deadline_at: str | None
    attempts: int
    waiting_reason: WaitingReason | None
    error: TaskError | None
    result: TaskResult | None
    status_url: str
    stages: Stages


class TaskPage(Schema):
    data: list[TaskOut]
    next_cursor: str | None


class EventOut(Schema):
    at: str
    from_: StateName | None = Field(alias="from")
    to: StateName | None
    actor: str
    reason: str
    generation: int


class EventPage(Schema):
    data: list[EventOut]


class CancelOut(Schema):
    id: str
    state: StateName


class ResultLink(Schema):
    url: str
    expires_at: str


class CallbackReceived(Schema):
    received: bool
    duplicate: bool
