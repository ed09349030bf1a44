"""Running one scenario: set the system up, apply the fault plan, drive the workload through the
API, wait, collect evidence, check invariants, report.

`run_isolated` starts its own system (fake vendor, web, dispatcher, a cluster per lane) against the
scratch database this process was started with (see the `poc` command). `run_live` drives the
running system instead.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from django.conf import settings

from fakevendor.control import VendorControl
from tasks.models import Lane, Tenant, TenantQuota, VendorChannel
from tasks.poc import checks
from tasks.poc.context import RunContext
from tasks.poc.evidence import Evidence
from tasks.poc.model import Scenario, Submit
from tasks.poc.receiver import Receiver
from tasks.services.tenancy import tenant_ensure, token_issue
from tasks.system import Stack

QUIESCE_S = 30.0  # nominal seconds to let notifications and vendor clean-up finish after the last task


def plan(scenario: Scenario, tasks: int) -> dict[str, list[tuple[Submit, int]]]:
    """Spread `tasks` over the workload: fixed counts first, the rest by share (largest remainder)."""
    fixed = [s for s in scenario.workload if s.count is not None]
    shared = [s for s in scenario.workload if s.count is None]
    remaining = max(tasks - sum(s.count for s in fixed), 0)
    total_share = sum(s.share for s in shared) or 1.0
    exact = [(s, remaining * s.share / total_share) for s in shared]
    counts = {id(s): int(x) for s, x in exact}
    leftover = remaining - sum(counts.values())
    for s, x in sorted(exact, key=lambda item: item[1] - int(item[1]), reverse=True)[:leftover]:
        counts[id(s)] += 1
    for s in fixed:
        counts[id(s)] = s.count
    by_phase: dict[str, list[tuple[Submit, int]]] = {p: [] for p in scenario.phases}
    index = 0
    # Interleave the specs so tenants and kinds arrive mixed, as they would in real traffic.
    pending = {id(s): counts[id(s)] for s in scenario.workload}
    while any(pending.values()):
        for spec in scenario.workload:
            if pending[id(spec)]:
                by_phase.setdefault(spec.phase, []).append((spec, index))
                pending[id(spec)] -= 1
                index += 1
    return by_phase


def configure(scenario: Scenario, *, vendor_url: str | None) -> dict[str, str]:
    """Sluice's side of the scenario: channels, lanes, tenants; returns the tenants' tokens."""
    for channel in VendorChannel.objects.all():
        values = dict(scenario.channels.get(channel.name, {}))
        if vendor_url and channel.name in ("primary", "fallback"):
            values["base_url"] = f"{vendor_url}/{channel.name}"
        if channel.name == "local" and "local" not in scenario.channels:
            values["enabled"] = False  # the fake vendor serves the fault scenarios; converter-budget uses the engine
        if values:
            VendorChannel.objects.filter(pk=channel.pk).update(**values)
        from tasks.vendors.breaker import reset_retry_budget

        reset_retry_budget(VendorChannel.objects.get(pk=channel.pk))
    for name, values in scenario.lanes.items():
        Lane.objects.filter(pk=name).update(**values)
    tokens = {}
    names = {s.tenant for s in scenario.workload} | set(scenario.tenants)
    for name in sorted(names):
        tenant = tenant_ensure(name=name)
        quota = scenario.tenants.get(name, {})
        if quota:
            TenantQuota.objects.filter(tenant=tenant).update(**quota)
        tokens[name] = token_issue(tenant=tenant, name="poc").token
    return tokens


def run_isolated(scenario: Scenario, *, seed: int, tasks: int, time_scale: float, workdir: Path, quiet: bool = False) -> dict[str, Any]:
    env = {
        "SLUICE_TIME_SCALE": str(time_scale),
        "SLUICE_DISPATCH_TICK_S": "0.05",
        "SLUICE_CALLBACK_ALLOW_PRIVATE": "1",
        "SLUICE_LANE_WORKERS": ",".join(f"{lane}={scenario.workers_per_lane}" for lane in settings.LANES),
        **scenario.env,
    }
    stack = Stack(log_dir=workdir / "logs", env=env)
    try:
        vendor_url = stack.start_vendor(time_scale=time_scale, seed=seed, channels=scenario.vendor_channels)
        tokens = configure(scenario, vendor_url=vendor_url)
        web_url = stack.start_web()
        if scenario.start_workers:
            start_workers(stack, scenario)
        ctx = RunContext(
            scenario=scenario, seed=seed, tasks=tasks, time_scale=time_scale, web_url=web_url, vendor_url=vendor_url,
            control=VendorControl(vendor_url, settings.FAKEVENDOR_ADMIN_TOKEN), tokens=tokens, stack=stack, quiet=quiet,
        )
        return execute(ctx)
    finally:
        stack.stop_all()


def start_workers(stack: Stack, scenario: Scenario) -> None:
    stack.start_dispatcher()
    stack.start_cluster(None, workers=2)
    for lane in scenario.lanes_started:
        stack.start_cluster(lane, workers=scenario.workers_per_lane)


def run_live(scenario: Scenario, *, seed: int, tasks: int, quiet: bool = False) -> dict[str, Any]:
    tokens = configure(scenario, vendor_url=None)
    ctx = RunContext(
        scenario=scenario, seed=seed, tasks=tasks, time_scale=float(settings.TIME_SCALE),
        web_url=settings.POC_LIVE_URL, vendor_url=settings.FAKEVENDOR_URL,
        control=VendorControl(settings.FAKEVENDOR_URL, settings.FAKEVENDOR_ADMIN_TOKEN), tokens=tokens, live=True,
        quiet=quiet,
    )
    try:
        return execute(ctx)
    finally:
        ctx.control.clear_rules()


def execute(ctx: RunContext) -> dict[str, Any]:
    scenario = ctx.scenario
    started = time.monotonic()
    ctx.control.reset(faults=True, state=not ctx.live, journal=True)
    ctx.control.set_seed(ctx.seed)
    for name, values in scenario.vendor_channels.items():
        ctx.control.channel(name, **values)
    for rule in scenario.faults:
        ctx.control.add_rule(rule)
    if any(s.callback for s in scenario.workload):
        secrets = dict(Tenant.objects.filter(name__in=ctx.tokens).values_list("name", "callback_secret"))
        ctx.receiver = Receiver(secrets)
    actions = ActionRunner(ctx)
    actions.start()
    budget_at = time.monotonic() + ctx.scaled(scenario.budget_s)
    try:
        for phase, specs in plan(scenario, ctx.tasks).items():
            ctx.phase = phase
            actions.before_phase(phase)
            ctx.submit_all(specs)
            while not ctx.all_settled(phase=phase) and time.monotonic() < budget_at:
                ctx.progress(f"{phase}: " if len(scenario.phases) > 1 else "")
                time.sleep(0.2)
        quiesce(ctx, until=min(budget_at, time.monotonic() + ctx.scaled(QUIESCE_S)))
    finally:
        actions.stop()
        ctx.progress()
        if not ctx.quiet:
            sys.stderr.write("\n")
    from tasks.services.billing import billing_reconcile

    billing_reconcile()
    evidence = Evidence.collect(ctx)
    results = [check(evidence) for check in checks.COMMON] + [check(evidence) for check in scenario.checks]
    if ctx.receiver is not None:
        ctx.receiver.stop()
    metrics = evidence.metrics()
    metrics.update(ctx.notes)
    metrics["tasks_accepted"] = len(ctx.accepted)
    return {
        "scenario": scenario.name,
        "dialect": scenario.dialect,
        "seed": ctx.seed,
        "tasks": ctx.tasks,
        "time_scale": ctx.time_scale,
        "live": ctx.live,
        "passed": all(r.ok for r in results),
        "duration_s": round(time.monotonic() - started, 2),
        # Durations in the metrics are scenario time (wall time divided by the time scale).
        "scenario_duration_s": round((time.monotonic() - started) / (ctx.time_scale or 1.0), 1),
        "invariants": [r.as_dict() for r in results],
        "metrics": metrics,
    }


def quiesce(ctx: RunContext, *, until: float) -> None:
    """Let what follows the last task settle: notifications, cancels of extra vendor jobs."""
    from tasks.models import Notification, VendorJob

    ids = [a.id for a in ctx.accepted]
    while time.monotonic() < until:
        pending_notes = Notification.objects.filter(task_id__in=ids, status__in=("pending", "delivering"))
        if ctx.receiver is not None and any(s.callback == "fail" for s in ctx.scenario.workload):
            pending_notes = pending_notes.exclude(url__endswith="/fail")
        live_jobs = VendorJob.objects.filter(task_id__in=ids, terminal_at__isnull=True, cancel_requested_at__isnull=False)
        # The run is not over while the vendor is still answering someone (a fenced attempt's
        # slow download, for instance): its late write must be seen being refused.
        vendor_busy = ctx.control.invariants().get("requests_in_flight", 0) > 0
        if (not pending_notes.exists() and not live_jobs.exists() and not vendor_busy
                and ctx.all_settled()):
            if not (ctx.receiver is not None and _failing_deliveries_short(ctx)):
                return
        ctx.progress("settling: ")
        time.sleep(0.2)


def _failing_deliveries_short(ctx: RunContext) -> bool:
    """With an always-failing endpoint, give its retries time to happen (at least two tries)."""
    failing = [a.id for a in ctx.accepted if a.spec.callback == "fail"]
    return any(ctx.receiver.attempts_for_task(i) < 2 for i in failing)


class ActionRunner:
    """Runs the scenario's timed and conditional actions next to the workload, each in its own
    thread so a slow one never delays another."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self._stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._loop, args=(action,), daemon=True)
            for action in ctx.scenario.actions if not action.before_phase
        ]
        self.last_error: dict[str, str] = {}
        self.succeeded: set[str] = set()

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self.threads:
            thread.join(timeout=10)
        failed = {name: error for name, error in self.last_error.items() if name not in self.succeeded}
        if failed:
            self.ctx.notes["action_errors"] = failed

    def before_phase(self, phase: str) -> None:
        for action in self.ctx.scenario.actions:
            if action.before_phase == phase:
                self._run(action)

    def _run(self, action) -> bool:
        try:
            action.do(self.ctx)
            return True
        except Exception as exc:
            self.last_error[action.name] = f"{type(exc).__name__}: {exc}"
            return False

    def _loop(self, action) -> None:
        from django.db import connection

        try:
            while not self._stop.is_set():
                due = action.at_s is not None and self.ctx.elapsed_nominal() >= action.at_s
                try:
                    ready = action.when(self.ctx) if action.when else False
                except Exception:
                    ready = False
                if (due or ready) and self._run(action):
                    self.succeeded.add(action.name)
                    if not action.repeat:
                        return
                time.sleep(0.02)
        finally:
            connection.close()
