"""Fault rules: validation, matching and deterministic draws.

A rule matches requests by endpoint (method + path pattern, `*` = one segment) and optional
criteria; `after` skips the first N matches, `times` caps how many get the fault, `probability`
draws from the rule's own generator (derived from the global seed and the rule id), and an
explicit `sequence` of fault types (or "ok") replaces `type` for successive matches.

Types fall in three families; a request gets at most one rule of each family:
- wire: what happens on the socket (delay, stall, dribble, bandwidth, http_error, rate_limit,
  reset, close, garbage, goaway, response_lost, redirect, malformed, slicer, and Toxiproxy's
  timeout, reset_peer, limit_data and slow_close);
- create: how a job create behaves (ignore_idempotency, duplicate_create, duplicate_on_create);
- job: what the created job does later (job_fail, stuck, digest_mismatch, input_digest_mismatch,
  transient_404).
"""

from __future__ import annotations

import hashlib
import random
import threading
from dataclasses import dataclass, field
from typing import Any

WIRE = ("delay", "stall", "dribble", "bandwidth", "http_error", "rate_limit", "reset", "close", "garbage", "goaway",
        "response_lost", "redirect", "malformed", "slicer", "timeout", "reset_peer", "limit_data", "slow_close")
CREATE = ("ignore_idempotency", "duplicate_create", "duplicate_on_create")
JOB = ("job_fail", "stuck", "digest_mismatch", "input_digest_mismatch", "transient_404")
MALFORMED_BODIES = ("not_json", "truncated_json", "missing_fields", "wrong_types", "empty")
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
TYPES = WIRE + CREATE + JOB
# Wire types a rule may stack (`"stack": true`): they delay a request and let it go on, so they
# chain with whichever other wire fault then fires, in priority order (Toxiproxy's toxic chain).
STACKABLE = ("delay", "stall")
FAMILY = {**{t: "wire" for t in WIRE}, **{t: "create" for t in CREATE}, **{t: "job" for t in JOB}}
METHODS = ("GET", "POST", "PUT", "DELETE", "*")


@dataclass(frozen=True)
class Param:
    """One parameter of a fault type, as a form asks for it."""

    name: str
    kind: str = "number"  # number | integer | choice | text | bool
    required: bool = False
    example: Any = None  # a valid value (forms prefill it; a test proves every example is accepted)
    choices: tuple = ()
    help: str = ""


# The parameters of each fault type, declared once: the console's fault forms are generated from
# these; validate_params below checks the same rules.
PARAMETERS: dict[str, tuple[Param, ...]] = {
    "delay": (Param("ms", required=True, example=2000, help="fixed delay before answering"),),
    "stall": (Param("ms", example=30000, help="hold the request, then close without answering"),),
    "dribble": (Param("chunks", "integer", True, 5, help="the answer in this many pieces"),
                Param("total_ms", required=True, example=3000, help="spread over this long")),
    "bandwidth": (Param("bytes_per_s", required=True, example=100000),
                  Param("direction", "choice", example="both", choices=("both", "upstream", "downstream"),
                        help="upstream: the request body; downstream: the answer")),
    "http_error": (Param("status", "integer", True, 503, help="400-599"), Param("code", "text", help="error code in the body")),
    "rate_limit": (Param("status", "choice", example=429, choices=(429, 503)),
                   Param("retry_after_s", example=5, help="Retry-After seconds"),
                   Param("retry_after_date", "bool", help="send Retry-After as an HTTP date")),
    "reset": (Param("stage", "choice", example="before_body", choices=("before_body", "mid_body")),
              Param("after_bytes", "integer", help="for mid_body: reset after this many bytes")),
    "close": (),
    "garbage": (Param("bytes", "integer", example=64, help="random bytes instead of HTTP"),),
    "goaway": (Param("last_stream_id", "integer"), Param("error_code", "integer")),
    "response_lost": (Param("mode", "choice", example="reset", choices=("reset", "close", "stall", "goaway"),
                            help="how the answer is lost after the work was done (and billed)"),),
    "redirect": (Param("status", "choice", example=302, choices=REDIRECT_STATUSES), Param("location", "text")),
    "malformed": (Param("body", "choice", example="not_json", choices=MALFORMED_BODIES),
                  Param("status", "integer", help="200-299: a success with a broken body")),
    "slicer": (Param("average_size", "integer", example=16), Param("size_variation", "integer", example=4),
               Param("delay_ms", example=50)),
    "timeout": (Param("ms", example=5000, help="pass no data, then close (empty: hold until the client gives up)"),),
    "reset_peer": (Param("ms", required=True, example=1000, help="wait this long, then reset the connection (TCP RST)"),),
    "limit_data": (Param("bytes", "integer", True, 200, help="the answer is cut off after this many bytes (the request was processed)"),),
    "slow_close": (Param("ms", required=True, example=3000, help="after the answer, keep the connection open this long, then close"),),
    "ignore_idempotency": (),
    "duplicate_create": (Param("copies", "integer", True, 2, help="jobs created (and billed) per request"),),
    "duplicate_on_create": (Param("copies", "integer", example=2),),
    "job_fail": (Param("code", "text", example="transcription_error"), Param("retryable", "bool")),
    "stuck": (Param("ms", required=True, example=600000, help="the job stays processing this long"),),
    "digest_mismatch": (),
    "input_digest_mismatch": (),
    "transient_404": (Param("ms", required=True, example=3000, help="the new job answers 404 this long"),),
}


def coerce_param(param: Param, raw: str) -> Any:
    """A form field's text as the parameter's type (None: left empty)."""
    raw = (raw or "").strip()
    if param.kind == "bool":
        return raw in ("on", "yes", "true", "1") or None
    if raw == "":
        return None
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


class RuleError(ValueError):
    """A malformed rule; `field` names the offending field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


def _number(params: dict, key: str, *, required: bool = False, minimum: float = 0, integer: bool = False) -> None:
    if key not in params or params[key] is None:
        if required:
            raise RuleError(f"params.{key}", "is required")
        return
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RuleError(f"params.{key}", "must be a number")
    if integer and int(value) != value:
        raise RuleError(f"params.{key}", "must be an integer")
    if value < minimum:
        raise RuleError(f"params.{key}", f"must be at least {minimum}")


def validate_params(kind: str, params: dict[str, Any]) -> None:
    """Check the parameters of one fault type (see the contract's list of types and params)."""
    if not isinstance(params, dict):
        raise RuleError("params", "must be an object")
    if kind == "delay":
        if "ms" in params:
            _number(params, "ms", required=True)
        elif "lower_ms" in params or "upper_ms" in params:
            _number(params, "lower_ms", required=True)
            _number(params, "upper_ms", required=True)
            if params["upper_ms"] < params["lower_ms"]:
                raise RuleError("params.upper_ms", "must be at least lower_ms")
        elif "median_ms" in params:
            _number(params, "median_ms", required=True)
            _number(params, "sigma", required=True)
            _number(params, "max_ms")
        else:
            raise RuleError("params", "delay needs ms, lower_ms+upper_ms, or median_ms+sigma")
    elif kind == "stall":
        _number(params, "ms")
    elif kind == "dribble":
        _number(params, "chunks", required=True, minimum=1, integer=True)
        _number(params, "total_ms", required=True)
    elif kind == "bandwidth":
        _number(params, "bytes_per_s", required=True, minimum=1)
        if params.get("direction", "both") not in ("both", "upstream", "downstream"):
            raise RuleError("params.direction", "must be both, upstream or downstream")
    elif kind == "http_error":
        _number(params, "status", required=True, minimum=400, integer=True)
        if params["status"] > 599:
            raise RuleError("params.status", "must be 400-599")
        if "code" in params and not isinstance(params["code"], str):
            raise RuleError("params.code", "must be a string")
    elif kind == "rate_limit":
        status = params.get("status", 429)
        if status not in (429, 503):
            raise RuleError("params.status", "must be 429 or 503")
        _number(params, "retry_after_s")
        if "retry_after_date" in params and not isinstance(params["retry_after_date"], bool):
            raise RuleError("params.retry_after_date", "must be true or false")
    elif kind == "reset":
        stage = params.get("stage", "before_body")
        if stage not in ("before_body", "mid_body"):
            raise RuleError("params.stage", "must be before_body or mid_body")
        if stage == "mid_body":
            _number(params, "after_bytes", required=True, integer=True)
    elif kind == "garbage":
        _number(params, "bytes", minimum=1, integer=True)
    elif kind == "timeout":
        _number(params, "ms")
    elif kind in ("reset_peer", "slow_close"):
        _number(params, "ms", required=True)
    elif kind == "limit_data":
        _number(params, "bytes", required=True, integer=True)
    elif kind == "goaway":
        _number(params, "last_stream_id", integer=True)
        _number(params, "error_code", integer=True)
    elif kind == "response_lost":
        if params.get("mode", "reset") not in ("reset", "close", "stall", "goaway"):
            raise RuleError("params.mode", "must be reset, close, stall or goaway")
        _number(params, "error_code", integer=True)
    elif kind == "duplicate_create":
        _number(params, "copies", required=True, minimum=2, integer=True)
    elif kind == "duplicate_on_create":
        _number(params, "copies", minimum=2, integer=True)
    elif kind == "redirect":
        status = params.get("status", 302)
        if status not in REDIRECT_STATUSES:
            raise RuleError("params.status", f"must be one of {', '.join(map(str, REDIRECT_STATUSES))}")
        if "location" in params and not isinstance(params["location"], str):
            raise RuleError("params.location", "must be a string")
    elif kind == "slicer":
        _number(params, "average_size", minimum=1, integer=True)
        _number(params, "size_variation", minimum=0, integer=True)
        _number(params, "delay_ms")
    elif kind == "malformed":
        if params.get("body", "not_json") not in MALFORMED_BODIES:
            raise RuleError("params.body", f"must be one of {', '.join(MALFORMED_BODIES)}")
        if "status" in params:
            _number(params, "status", integer=True, minimum=200)
            if params["status"] > 299:
                raise RuleError("params.status", "must be 200-299 (a malformed success)")
    elif kind == "job_fail":
        if "code" in params and not isinstance(params["code"], str):
            raise RuleError("params.code", "must be a string")
        if "retryable" in params and not isinstance(params["retryable"], bool):
            raise RuleError("params.retryable", "must be true or false")
    elif kind in ("stuck", "transient_404"):
        _number(params, "ms", required=True)


@dataclass
class Rule:
    id: str
    endpoint: str
    type: str | None
    params: dict[str, Any] = field(default_factory=dict)
    match: dict[str, Any] = field(default_factory=dict)
    probability: float = 1.0
    after: int = 0
    times: int | None = None
    sequence: list[str] | None = None
    priority: int = 0
    stack: bool = False  # a latency that applies before whichever other wire fault fires (a chain)
    # WireMock's scenarios: the rule matches only while its scenario is in `when_state`, and
    # moves it to `set_state` when it fires (a type "ok" rule only moves it).
    scenario: str | None = None
    when_state: str = "Started"
    set_state: str | None = None
    order: int = 0
    # Runtime counters (not part of the definition).
    matched: int = 0
    applied: int = 0

    @property
    def method(self) -> str:
        return self.endpoint.split(" ", 1)[0]

    @property
    def path_pattern(self) -> list[str]:
        return [s for s in self.endpoint.split(" ", 1)[1].split("/") if s]

    def families(self) -> set[str]:
        kinds = [self.type] if self.type and self.type != "ok" else []
        kinds += [k for k in (self.sequence or []) if k != "ok"]
        return {FAMILY[k] for k in kinds} or {"wire"}  # a pass-through scenario step acts on the wire

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "endpoint": self.endpoint,
            "match": self.match,
            "type": self.type,
            "params": self.params,
            "probability": self.probability,
            "after": self.after,
            "times": self.times,
            "sequence": self.sequence,
            "priority": self.priority,
            "stack": self.stack,
            "scenario": self.scenario,
            "when_state": self.when_state,
            "set_state": self.set_state,
            "matched": self.matched,
            "applied": self.applied,
        }


def parse_rule(data: Any, *, default_id: str) -> Rule:
    """Validate a rule definition; RuleError names the first bad field."""
    if not isinstance(data, dict):
        raise RuleError("rule", "must be a JSON object")
    known = {"id", "endpoint", "match", "type", "params", "probability", "toxicity", "after", "times", "sequence",
             "priority", "stack", "scenario", "when_state", "set_state"}
    for key in data:
        if key not in known:
            raise RuleError(key, "is not a rule field")
    rule_id = data.get("id") or default_id
    if not isinstance(rule_id, str) or not rule_id or len(rule_id) > 64:
        raise RuleError("id", "must be a non-empty string of at most 64 characters")
    endpoint = data.get("endpoint", "* *")
    if endpoint == "*":
        endpoint = "* *"
    if not isinstance(endpoint, str) or " " not in endpoint:
        raise RuleError("endpoint", 'must be "METHOD /path" (e.g. "POST /v1/jobs", "* *")')
    method, path = endpoint.split(" ", 1)
    if method.upper() not in METHODS:
        raise RuleError("endpoint", f"method must be one of {', '.join(METHODS)}")
    if not (path == "*" or path.startswith("/")):
        raise RuleError("endpoint", "path must start with / (or be *)")
    endpoint = f"{method.upper()} {path}"
    kind = data.get("type")
    sequence = data.get("sequence")
    if sequence is not None:
        if not isinstance(sequence, list) or not sequence:
            raise RuleError("sequence", "must be a non-empty list of fault types or \"ok\"")
        for index, item in enumerate(sequence):
            if item != "ok" and item not in TYPES:
                raise RuleError(f"sequence[{index}]", f"unknown fault type {item!r}")
    elif kind is None:
        raise RuleError("type", "is required (or give a sequence)")
    if kind is not None and kind not in TYPES and not (kind == "ok" and data.get("scenario")):
        raise RuleError("type", f"unknown fault type {kind!r}; known: {', '.join(TYPES)}"
                        + (" (\"ok\" only in a scenario)" if kind == "ok" else ""))
    params = data.get("params") or {}
    for item in {kind, *(sequence or [])} - {None, "ok"}:
        validate_params(item, params)
    match = data.get("match") or {}
    if not isinstance(match, dict):
        raise RuleError("match", "must be an object")
    for key, value in match.items():
        if key not in ("client_ref", "header", "kind", "channel", "idempotency_key"):
            raise RuleError(f"match.{key}", "is not a match criterion (client_ref, header, kind, channel)")
        if key == "header" and not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
            raise RuleError("match.header", "must be an object of header names to values")
        if key != "header" and not isinstance(value, str):
            raise RuleError(f"match.{key}", "must be a string")
    if "toxicity" in data and "probability" in data:
        raise RuleError("toxicity", "give probability or toxicity (Toxiproxy's name for it), not both")
    probability = data.get("toxicity", data.get("probability", 1.0))
    field_name = "toxicity" if "toxicity" in data else "probability"
    if isinstance(probability, bool) or not isinstance(probability, (int, float)) or not 0 <= probability <= 1:
        raise RuleError(field_name, "must be a number between 0 and 1")
    if isinstance(probability, bool) or not isinstance(probability, (int, float)) or not 0 <= probability <= 1:
        raise RuleError("probability", "must be a number between 0 and 1")
    after = data.get("after", 0)
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise RuleError("after", "must be a non-negative integer")
    times = data.get("times")
    if times is not None and (isinstance(times, bool) or not isinstance(times, int) or times < 0):
        raise RuleError("times", "must be null or a non-negative integer")
    priority = data.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RuleError("priority", "must be an integer")
    scenario = data.get("scenario")
    for name in ("scenario", "when_state", "set_state"):
        value = data.get(name)
        if value is not None and (not isinstance(value, str) or not value or len(value) > 64):
            raise RuleError(name, "must be a non-empty string of at most 64 characters")
        if value is not None and name != "scenario" and not scenario:
            raise RuleError(name, "needs a scenario")
    stack = data.get("stack", False)
    if not isinstance(stack, bool):
        raise RuleError("stack", "must be true or false")
    if stack and ({kind, *(sequence or [])} - {None, "ok"}) - set(STACKABLE):
        raise RuleError("stack", f"only latencies stack before another fault: {', '.join(STACKABLE)}")
    rule = Rule(
        id=rule_id, endpoint=endpoint, type=kind, params=params, match=match,
        probability=float(probability), after=after, times=times, sequence=sequence, priority=priority, stack=stack,
        scenario=scenario, when_state=data.get("when_state") or "Started", set_state=data.get("set_state"),
    )
    if len(rule.families()) > 1:
        raise RuleError("sequence", "all fault types of one rule must belong to the same family")
    return rule


@dataclass(frozen=True)
class RequestFacts:
    method: str
    path: list[str]
    channel: str
    headers: dict[str, str]
    client_ref: str | None = None
    kind: str | None = None


@dataclass(frozen=True)
class Decision:
    """A matching rule's verdict for one request; type "ok" means it matched but did not fire."""

    rule_id: str
    type: str
    params: dict[str, Any]
    draw: float | None
    rng: random.Random

    @property
    def applied(self) -> bool:
        return self.type != "ok"


class FaultEngine:
    """Holds the rules; thread-safe; decides which fault (if any) each request gets."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.rules: list[Rule] = []
        self._rngs: dict[str, random.Random] = {}
        self._lock = threading.RLock()
        self._counter = 0
        self.states: dict[str, str] = {}  # scenario → its current state ("Started" until moved)

    def set_seed(self, seed: int) -> None:
        with self._lock:
            self.seed = seed
            self._rngs.clear()
            self.states.clear()
            for rule in self.rules:
                rule.matched = rule.applied = 0

    def scenarios(self) -> dict[str, str]:
        """Every scenario the rules name, with its current state."""
        with self._lock:
            return {r.scenario: self.states.get(r.scenario, "Started") for r in self.rules if r.scenario}

    def reset_scenarios(self) -> None:
        with self._lock:
            self.states.clear()

    def add(self, data: Any) -> Rule:
        with self._lock:
            self._counter += 1
            rule = parse_rule(data, default_id=f"r{self._counter}")
            if any(r.id == rule.id for r in self.rules):
                raise RuleError("id", f"a rule with id {rule.id!r} exists")
            rule.order = self._counter
            self.rules.append(rule)
            return rule

    def remove(self, rule_id: str) -> bool:
        with self._lock:
            before = len(self.rules)
            self.rules = [r for r in self.rules if r.id != rule_id]
            self._rngs.pop(rule_id, None)
            return len(self.rules) < before

    def clear(self) -> None:
        with self._lock:
            self.rules = []
            self._rngs.clear()
            self.states.clear()

    def _rng(self, rule_id: str) -> random.Random:
        if rule_id not in self._rngs:
            digest = hashlib.sha256(f"{self.seed}:{rule_id}".encode()).digest()
            self._rngs[rule_id] = random.Random(int.from_bytes(digest[:8], "big"))
        return self._rngs[rule_id]

    def decide(self, facts: RequestFacts, family: str) -> Decision | None:
        """The rule of `family` this request matched (its type "ok" if it did not fire), if any.
        Stacked rules are not chosen here (see decide_chain)."""
        return self._decide(facts, family, stacked=False)

    def decide_chain(self, facts: RequestFacts) -> tuple[list[Decision], Decision | None]:
        """The wire faults of one request, in the order they act: every stacked latency that fires
        (priority order), then the one other wire fault chosen as `decide` chooses it."""
        chain = []
        with self._lock:
            for rule in self._candidates(facts, "wire", stacked=True):
                decision = self._fire(rule)
                if decision is not None and decision.applied:
                    chain.append(decision)
        return chain, self._decide(facts, "wire", stacked=False)

    def _candidates(self, facts: RequestFacts, family: str, *, stacked: bool) -> list[Rule]:
        return sorted((r for r in self.rules if family in r.families() and r.stack == stacked and _matches(r, facts)
                       and (r.scenario is None or self.states.get(r.scenario, "Started") == r.when_state)),
                      key=lambda r: (-r.priority, r.order))

    def _fire(self, rule: Rule) -> Decision | None:
        """Count a match of `rule`: its decision if it fires, an "ok" decision if its draw missed,
        None if it is not due (after, times, sequence spent). Call under the lock."""
        rule.matched += 1
        if rule.matched <= rule.after:
            return None
        if rule.times is not None and rule.applied >= rule.times:
            return None
        rng = self._rng(rule.id)
        draw = None
        if rule.probability < 1.0:
            draw = rng.random()
            if draw >= rule.probability:
                return Decision(rule_id=rule.id, type="ok", params=rule.params, draw=draw, rng=rng)
        if rule.sequence is not None:
            index = rule.matched - rule.after - 1
            if index >= len(rule.sequence):
                return None
            kind = rule.sequence[index]
        else:
            kind = rule.type
        rule.applied += 1
        if rule.scenario and rule.set_state:
            self.states[rule.scenario] = rule.set_state
        # (A scenario step of type "ok" lets the request through: to the server, not applied.)
        return Decision(rule_id=rule.id, type=kind, params=rule.params, draw=draw, rng=rng)

    def _decide(self, facts: RequestFacts, family: str, *, stacked: bool) -> Decision | None:
        with self._lock:
            missed: Decision | None = None
            for rule in self._candidates(facts, family, stacked=stacked):
                decision = self._fire(rule)
                if decision is None:
                    continue
                if not decision.applied:
                    # This rule did not fire; a lower one still gets its own chance.
                    missed = missed or decision
                    continue
                return decision
            return missed


def _matches(rule: Rule, facts: RequestFacts) -> bool:
    method = rule.method
    if method != "*" and method != facts.method:
        return False
    pattern_text = rule.endpoint.split(" ", 1)[1]
    if pattern_text != "*":
        pattern = rule.path_pattern
        if len(pattern) != len(facts.path):
            return False
        for want, have in zip(pattern, facts.path):
            if want != "*" and want != have:
                return False
    match = rule.match
    if "channel" in match and match["channel"] != facts.channel:
        return False
    if "client_ref" in match and match["client_ref"] != facts.client_ref:
        return False
    if "kind" in match and match["kind"] != facts.kind:
        return False
    if "idempotency_key" in match and match["idempotency_key"] != facts.headers.get("idempotency-key"):
        return False
    for name, value in (match.get("header") or {}).items():
        if facts.headers.get(name.lower()) != value:
            return False
    return True
