"""What a fault type is: its name, where it acts, its parameters as a schema, and its behaviour.

Each fault type lives in its own module under `fakevendor/faults/kinds/` and defines one `FAULT`,
an instance of a `Fault` subclass; `registry.py` lists the modules. The server calls the hooks
below at fixed points of a request, so adding a fault type touches nothing else:

- `before(ctx, decision)`: before the request is processed (a refusal, a latency, a reset);
- `reading(decision)`: how the request body is read (bandwidth, a reset after N bytes);
- `answer(ctx, decision, status, headers, body)`: how the processed request's answer goes out;
- `on_create(params)`: how a job create behaves (copies, idempotency ignored);
- `on_job(job, params, scaled, now)`: what the created job does later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Where a fault acts, in the order a request meets them.
STAGES = ("connect", "request_headers", "request_body", "response_headers", "response_body", "job_lifecycle")
FAMILIES = ("wire", "create", "job")
PROTOCOLS = ("HTTP/1.1", "HTTP/2")


class RuleError(ValueError):
    """A malformed rule; `field` names the offending field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


@dataclass(frozen=True)
class Param:
    """One parameter of a fault type: the schema rules check and forms ask for."""

    name: str
    kind: str = "number"  # number | integer | choice | text | bool | json
    required: bool = False
    example: Any = None  # a valid value (forms prefill it; a test proves every example is accepted)
    choices: tuple = ()
    help: str = ""
    minimum: float | None = 0
    maximum: float | None = None
    nullable: bool = False  # null is a meaning of its own (e.g. a stall that never ends)

    def check(self, params: dict[str, Any]) -> None:
        """Refuse a bad value with a message naming the field."""
        field_name = f"params.{self.name}"
        if self.name not in params:
            if self.required:
                raise RuleError(field_name, "is required")
            return
        value = params[self.name]
        if value is None:
            if not self.nullable:
                raise RuleError(field_name, "must not be null (leave it out for the default)")
            return
        if self.kind in ("number", "integer"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RuleError(field_name, "must be a number")
            if self.kind == "integer" and int(value) != value:
                raise RuleError(field_name, "must be an integer")
            if self.minimum is not None and value < self.minimum:
                raise RuleError(field_name, f"must be at least {_plain(self.minimum)}")
            if self.maximum is not None and value > self.maximum:
                raise RuleError(field_name, f"must be at most {_plain(self.maximum)}")
        elif self.kind == "choice":
            if value not in self.choices or isinstance(value, bool):
                raise RuleError(field_name, f"must be one of {', '.join(map(str, self.choices))}")
        elif self.kind == "text":
            if not isinstance(value, str):
                raise RuleError(field_name, "must be a string")
        elif self.kind == "bool":
            if not isinstance(value, bool):
                raise RuleError(field_name, "must be true or false")

    def describe(self) -> str:
        """The parameter as the generated documentation shows it."""
        text = f"`{self.name}`"
        if self.kind == "choice":
            text += " (" + " \\| ".join(f"`{c}`" for c in self.choices) + ")"
        elif self.kind != "json":
            text += f" ({self.kind})"
        if self.required:
            text += ", required"
        return text + (f": {self.help}" if self.help else "")


def _plain(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else str(number)


def coerce_param(param: Param, raw: str) -> Any:
    """A form field's text as the parameter's type (None: left empty)."""
    raw = (raw or "").strip()
    if param.kind == "bool":
        return raw in ("on", "yes", "true", "1") or None
    if raw == "":
        return None
    if param.kind == "json":
        try:
            return json.loads(raw)
        except ValueError:
            raise RuleError(f"params.{param.name}", "must be JSON") from None
    if param.kind == "integer" or (param.kind == "choice" and all(isinstance(c, int) for c in param.choices)):
        try:
            return int(raw)
        except ValueError:
            raise RuleError(f"params.{param.name}", "must be an integer") from None
    if param.kind == "number":
        try:
            value = float(raw)
        except ValueError:
            raise RuleError(f"params.{param.name}", "must be a number") from None
        return int(value) if value.is_integer() else value
    return raw


class Context(Protocol):
    """What a wire fault may do to the request it acts on (the server provides it)."""

    conn: Any  # the transport: an HTTP/1.1 connection or an HTTP/2 stream (fakevendor.transport.Wire)
    request: Any

    def scaled(self, nominal_ms: float) -> float: ...
    async def discard_body(self) -> None: ...
    async def respond(self, status: int, headers: list[tuple[str, str]], body: bytes | Path, **options: Any) -> None: ...
    async def problem(self, status: int, code: str, detail: str, *, retryable: bool = False,
                      extra: list[tuple[str, str]] | None = None) -> int: ...
    async def rate_limit_answer(self, *, retry_after_s: float, status: int, as_date: bool = False) -> int: ...


# What a hook that ended the exchange returns: the status sent (None: no answer) and the outcome
# the journal records.
Outcome = tuple[int | None, str]


class Fault:
    """One fault type. Subclasses set the class attributes and override the hooks they need."""

    name: str = ""
    family: str = "wire"  # wire | create | job (a request gets at most one rule of each)
    stages: tuple[str, ...] = ()  # where it acts (STAGES)
    params: tuple[Param, ...] = ()
    examples: tuple[dict[str, Any], ...] = ({},)
    summary: str = ""  # what a client sees (the documentation's table is generated from it)
    processed: bool | None = None  # does the vendor do (and bill) the work? None: not a create-level question
    stackable: bool = False  # may stack ("stack": true) before another wire fault: a latency
    protocols: tuple[str, ...] = PROTOCOLS  # where it acts as described (elsewhere it is a plain answer)

    def validate(self, params: dict[str, Any]) -> None:
        """The schema, then `check` for rules across parameters."""
        for param in self.params:
            param.check(params)
        self.check(params)

    def check(self, params: dict[str, Any]) -> None:
        """Rules across parameters (override)."""

    # --- wire hooks --------------------------------------------------------------------
    async def before(self, ctx: Context, decision: Any) -> Outcome | None:
        """Act before the request is processed; an Outcome ends the exchange, None goes on."""
        return None

    def reading(self, decision: Any, time_scale: float) -> dict[str, Any]:
        """Options for reading the request body: `bytes_per_s`, `reset_after`."""
        return {}

    async def answer(self, ctx: Context, decision: Any, status: int, headers: list[tuple[str, str]],
                     body: bytes | Path) -> Outcome | None:
        """Send the processed request's answer your way; None lets the server send it plainly."""
        return None

    # --- create and job hooks ------------------------------------------------------------
    def on_create(self, params: dict[str, Any]) -> dict[str, Any]:
        """How a create behaves: `copies` (jobs billed per request), `ignore_keys`."""
        return {}

    def on_job(self, job: dict[str, Any], params: dict[str, Any], scaled: Any, now: float) -> None:
        """Shape the created job's row (its timing, failure, digests)."""


def supports(conn: Any, fault: Fault) -> bool:
    """Does this transport carry the fault as described (some act on raw HTTP/1.1 bytes)?"""
    return getattr(conn, "protocol", "HTTP/1.1") in fault.protocols
