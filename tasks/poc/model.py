"""What a POC scenario is: a small declarative object QA can write without reading the runner.

    Scenario(
        name="response-lost",
        summary="the vendor bills the job, then drops the response: Sluice adopts it",
        faults=[{"endpoint": "POST /v1/jobs", "type": "response_lost", "params": {"mode": "reset"}, "probability": 0.3}],
        workload=[Submit(share=1.0)],
        checks=[checks.all_succeeded, checks.one_billed_job_per_task],
    )

Faults go to the fake vendor, `channels`/`lanes`/`tenants` configure Sluice, `workload` says what
business systems submit through the API, `actions` happen during the run, `checks` are the
scenario's own invariants on top of the ones every scenario checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Submit:
    """A share of the run's tasks, all alike."""

    share: float = 1.0
    kind: str = "transcription"
    target_format: str = "txt"
    priority: str = "interactive"
    tenant: str = "poc"
    content: str = "wav"  # a generator name in tasks.poc.files, see contents.py
    label: str = "recording.wav"
    phase: str = "main"
    callback: str | None = None  # "ack" | "fail" (the run's notification receiver)
    count: int | None = None  # a fixed count instead of a share
    deadline_s: float | None = None  # the business deadline asked for (the API's deadline_s)


@dataclass(frozen=True)
class Action:
    """Something done during the run: at a nominal second, or when the condition holds."""

    name: str
    do: Callable[[Any], None]
    at_s: float | None = None
    when: Callable[[Any], bool] | None = None
    repeat: bool = False
    before_phase: str | None = None  # run right before this phase's tasks are submitted


@dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    observed: Any
    expected: str
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        data = {"name": self.name, "ok": self.ok, "observed": self.observed, "expected": self.expected}
        if self.detail:
            data["detail"] = self.detail
        return data


Check = Callable[[Any], Result]


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    workload: list[Submit]
    tasks: int = 20
    time_scale: float = 0.05
    budget_s: float = 600.0
    faults: list[dict[str, Any]] = field(default_factory=list)
    vendor_channels: dict[str, dict[str, Any]] = field(default_factory=dict)
    channels: dict[str, dict[str, Any]] = field(default_factory=dict)
    lanes: dict[str, dict[str, Any]] = field(default_factory=dict)
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    lanes_started: tuple[str, ...] = ("interactive", "batch")
    workers_per_lane: int = 2
    env: dict[str, str] = field(default_factory=dict)
    start_workers: bool = True  # False: the run starts them itself (an action)
    phases: tuple[str, ...] = ("main",)
    live: bool = True  # can it run against a live system (no process control needed)?
    # The vendor dialects it is written to run against (tasks/poc/dialects.py translates it).
    dialects: tuple[str, ...] = ("sluice",)
    # Tasks held for an operator (needs_operator) count as settled: the run does not wait for them.
    operator_holds: bool = False
    dialect: str = "sluice"
