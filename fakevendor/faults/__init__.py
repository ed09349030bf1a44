"""Fault rules: validation, matching and deterministic draws.

A rule matches requests by endpoint (method + path pattern, `*` = one segment) and optional
criteria; `after` skips the first N matches, `times` caps how many get the fault, `probability`
draws from the rule's own generator (derived from the global seed and the rule id), and an
explicit `sequence` of fault types (or "ok") replaces `type` for successive matches.

Each fault type is a module of its own (fakevendor/faults/kinds/, listed in registry.py) that
declares its parameters, where it acts and its behaviour. Types fall in three families; a
request gets at most one rule of each family (stacked latencies aside): wire (what happens on the
socket), create (how a job create behaves), job (what the created job does later).
"""

from __future__ import annotations

import hashlib
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from fakevendor.faults.base import Fault, Param, RuleError, coerce_param
from fakevendor.faults.registry import FAULTS

TYPES = tuple(FAULTS)
WIRE = tuple(n for n, f in FAULTS.items() if f.family == "wire")
CREATE = tuple(n for n, f in FAULTS.items() if f.family == "create")
JOB = tuple(n for n, f in FAULTS.items() if f.family == "job")
FAMILY = {n: f.family for n, f in FAULTS.items()}
# Wire types a rule may stack (`"stack": true`): they delay a request and let it go on, so they
# chain with whichever other wire fault then fires, in priority order (Toxiproxy's toxic chain).
STACKABLE = tuple(n for n, f in FAULTS.items() if f.stackable)
# The parameters of each fault type, declared once in its module: the console's fault forms are
# generated from these, and rules are validated against them.
PARAMETERS: dict[str, tuple[Param, ...]] = {n: f.params for n, f in FAULTS.items()}
METHODS = ("GET", "POST", "PUT", "DELETE", "*")

__all__ = ["CREATE", "FAMILY", "FAULTS", "JOB", "METHODS", "PARAMETERS", "STACKABLE", "TYPES", "WIRE", "Decision",
           "Fault", "FaultEngine", "Param", "RequestFacts", "Rule", "RuleError", "coerce_param", "parse_rule",
           "validate_params"]


def validate_params(kinds: set[str], params: Any) -> None:
    """Check a rule's parameters against the schemas of its fault types (one type, or a sequence's)."""
    if not isinstance(params, dict):
        raise RuleError("params", "must be an object")
    known = {p.name for kind in kinds for p in FAULTS[kind].params}
    for key in params:
        if key not in known:
            names = ", ".join(sorted(known)) or "none"
            raise RuleError(f"params.{key}", f"is not a parameter of {'/'.join(sorted(kinds))} (known: {names})")
    for kind in kinds:
        FAULTS[kind].validate(params)


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
    validate_params({kind, *(sequence or [])} - {None, "ok"}, params)
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
