"""A scenario run: the system it drives, what it submitted, and what it saw.

The run talks to Sluice the way business systems do (the HTTP API) and to the fake vendor the
way QA does (its control API). It reads Sluice's database only to follow progress and collect
evidence.
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from fakevendor.control import VendorControl
from tasks.models import Task
from tasks.poc import contents
from tasks.poc.model import Scenario, Submit
from tasks.poc.receiver import Receiver
from tasks.states import TERMINAL_STATES


@dataclass
class Accepted:
    id: str
    tenant: str
    spec: Submit
    label: str
    submitted_at: float
    sha256: str


@dataclass
class RunContext:
    scenario: Scenario
    seed: int
    tasks: int
    time_scale: float
    web_url: str
    vendor_url: str
    control: VendorControl
    tokens: dict[str, str]
    live: bool = False
    stack: Any = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    accepted: list[Accepted] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    cancels: dict[str, int] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    receiver: Receiver | None = None
    secrets: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)  # wall clock, as the logs stamp their lines
    phase: str = "main"
    quiet: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.web_url, timeout=60, trust_env=False)
        self.secrets.update(self.tokens.values())

    # --- time ---------------------------------------------------------------------------------
    def scaled(self, nominal_s: float) -> float:
        return nominal_s * self.time_scale

    def elapsed_nominal(self) -> float:
        return (time.monotonic() - self.started) / self.time_scale

    def sleep(self, nominal_s: float) -> None:
        time.sleep(self.scaled(nominal_s))

    # --- driving Sluice like a business system -----------------------------------------------
    def submit_all(self, specs: list[tuple[Submit, int]]) -> None:
        with ThreadPoolExecutor(max_workers=6) as pool:
            list(pool.map(lambda item: self.submit(*item), specs))

    def submit(self, spec: Submit, index: int) -> str | None:
        marker = f"SLUICE-SECRET-{self.run_id}-{index}-{secrets.token_hex(3)}"
        label = f"{marker}-{spec.label}"
        content = contents.make(spec.content, index=index, marker=marker.encode())
        self.secrets.update({label, marker})
        token = self.tokens[spec.tenant]
        headers = {"Authorization": f"Bearer {token}"}
        stored = self._post("/api/v1/files", content=content, headers={
            **headers, "Content-Type": "application/octet-stream", "X-Filename": label})
        if stored is None or stored.status_code != 201:
            self.rejected.append({"stage": "file", "status": getattr(stored, "status_code", None), "index": index})
            return None
        body: dict[str, Any] = {
            "file_id": stored.json()["id"], "kind": spec.kind, "target_format": spec.target_format,
            "priority": spec.priority,
        }
        if spec.callback and self.receiver is not None:
            body["callback_url"] = self.receiver.url(spec.callback)
        if spec.deadline_s is not None:
            body["deadline_s"] = spec.deadline_s
        key = f"poc-{self.run_id}-{index}"
        for _ in range(20):
            answer = self._post("/api/v1/tasks", json=body, headers={**headers, "Idempotency-Key": key})
            if answer is not None and answer.status_code == 202:
                accepted = Accepted(id=answer.json()["id"], tenant=spec.tenant, spec=spec, label=label,
                                    submitted_at=time.monotonic(), sha256=stored.json()["sha256"])
                with self._lock:
                    self.accepted.append(accepted)
                return accepted.id
            if answer is not None and answer.status_code in (429, 503):
                # A business system backs off as told, then tries again with the same key.
                self.rejected.append({"stage": "task", "status": answer.status_code,
                                      "code": answer.json().get("code"), "index": index})
                time.sleep(min(float(answer.headers.get("Retry-After", "1")), 5))
                continue
            self.rejected.append({"stage": "task", "status": getattr(answer, "status_code", None), "index": index})
            return None
        return None

    def _post(self, path: str, **kwargs: Any) -> httpx.Response | None:
        for attempt in range(3):
            try:
                return self.http.post(path, **kwargs)
            except httpx.TransportError:
                time.sleep(0.2 * (attempt + 1))
        return None

    def cancel(self, task_id: str) -> int:
        tenant = next(a.tenant for a in self.accepted if a.id == task_id)
        answer = self.http.post(f"/api/v1/tasks/{task_id}/cancel", headers={"Authorization": f"Bearer {self.tokens[tenant]}"})
        with self._lock:
            self.cancels[task_id] = answer.status_code
        return answer.status_code

    # --- following progress ----------------------------------------------------------------------
    def states(self, *, phase: str | None = None) -> dict[str, str]:
        ids = [a.id for a in self.accepted if phase is None or a.spec.phase == phase]
        return dict(Task.objects.filter(pk__in=ids).values_list("pk", "state")) if ids else {}

    def all_terminal(self, *, phase: str | None = None) -> bool:
        states = self.states(phase=phase)
        expected = [a for a in self.accepted if phase is None or a.spec.phase == phase]
        return len(states) == len(expected) and all(s in TERMINAL_STATES for s in states.values())

    def all_settled(self, *, phase: str | None = None) -> bool:
        """Every task terminal, or (where the scenario holds tasks for an operator) waiting for one."""
        if not self.scenario.operator_holds:
            return self.all_terminal(phase=phase)
        ids = [a.id for a in self.accepted if phase is None or a.spec.phase == phase]
        rows = Task.objects.filter(pk__in=ids).values_list("state", "waiting_reason")
        return len(rows) == len(ids) and all(s in TERMINAL_STATES or w == "needs_operator" for s, w in rows)

    def progress(self, label: str = "") -> None:
        if self.quiet:
            return
        states = self.states()
        counts: dict[str, int] = {}
        for value in states.values():
            counts[value] = counts.get(value, 0) + 1
        done = sum(v for k, v in counts.items() if k in TERMINAL_STATES)
        summary = " ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        sys.stderr.write(
            f"\r[{self.scenario.name}] {label}{done}/{len(self.accepted)} terminal · {summary} · "
            f"{time.monotonic() - self.started:5.1f}s\x1b[K"
        )
        sys.stderr.flush()
