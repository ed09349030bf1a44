"""Invariants. Each returns observed vs expected, so a failure explains itself."""

from __future__ import annotations

import math
from collections import defaultdict
from datetime import timedelta
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from tasks.models import BreakerTransition, Quarantine, VendorCall
from tasks.poc.evidence import Evidence
from tasks.poc.model import Result
from tasks.states import TERMINAL_STATES, State
from tasks.storage import result_exists, stored_results


# --- every scenario ---------------------------------------------------------------------------------
def lost_tasks(ev: Evidence) -> Result:
    """Every accepted task is terminal, or visibly waiting with a reason."""
    missing = [a.id for a in ev.ctx.accepted if a.id not in ev.tasks]
    unexplained = [
        t for t in ev.tasks.values()
        if t.state not in TERMINAL_STATES and t.due_at is None and t.lease_expires_at is None
        and not (t.state == State.QUEUED or (t.state == State.ACCEPTED and t.deferred))
        and t.waiting_reason != "needs_operator"
    ]
    observed = len(missing) + len(unexplained)
    detail = f"missing {missing[:3]}, unexplained {[str(t.pk) for t in unexplained[:3]]}" if observed else ""
    return Result("lost_tasks", observed == 0, observed, "== 0", detail)


def undetected_duplicate_billing(ev: Evidence) -> Result:
    """Jobs the vendor billed for one task — across every channel, attempt and client_ref — beyond
    the first, that Sluice's incident for the task does not name."""
    named: dict[str, set[str]] = {}
    for incident in ev.incidents:
        named[str(incident.task_id)] = {*incident.duplicate_job_ids, incident.kept_job_id}
    undetected = 0
    over = 0
    for task_id, jobs in ev.billed_by_task().items():
        if len(jobs) < 2:
            continue
        over += 1
        known = named.get(task_id)
        undetected += len(jobs) - 1 if not known else len({j for _, j in jobs} - known)
    return Result("undetected_duplicate_billing", undetected == 0, undetected, "== 0",
                  f"{over} task(s) billed more than once, per the vendor's ledger" if over else "")


def unattended_tasks(ev: Evidence) -> Result:
    """Non-terminal tasks with neither a lease nor a due time: nothing would ever move them.

    QUEUED tasks waiting for admission are due whenever their lane has room (the dispatcher looks
    at each of them every tick), and so are deferred ACCEPTED ones; a dispatched start has its
    message out (resent if lost). A task held for an operator (needs_operator) is attended by one:
    it is on the console's list of tasks to decide, and its business deadline still applies."""
    bad = [
        t for t in ev.tasks.values()
        if t.state not in TERMINAL_STATES and t.due_at is None and t.lease_expires_at is None
        and t.state != State.QUEUED and not (t.state == State.ACCEPTED and t.deferred)
        and t.waiting_reason != "needs_operator"
    ]
    detail = "; ".join(f"{t.pk} {t.state}/{t.phase or '-'}" for t in bad[:3])
    return Result("unattended_tasks", not bad, len(bad), "== 0", detail)


def budget_violations(ev: Evidence) -> Result:
    """Concurrency seen at the vendor above the channel's configured budget."""
    over = []
    jobs = ev.invariants.get("max_concurrent_jobs_by_channel", {})
    uploads = ev.invariants.get("max_concurrent_uploads_by_channel", {})
    for name, channel in ev.channels.items():
        if jobs.get(name, 0) > channel.max_inflight_jobs:
            over.append(f"{name} jobs {jobs[name]} > {channel.max_inflight_jobs}")
        if uploads.get(name, 0) > channel.max_concurrent_uploads:
            over.append(f"{name} uploads {uploads[name]} > {channel.max_concurrent_uploads}")
    return Result("budget_violations", not over, len(over), "== 0", "; ".join(over))


def late_writes_accepted(ev: Evidence) -> Result:
    """Writes by a fenced-off attempt that changed anything."""
    bad = []
    for task_id, events in ev.events.items():
        terminal = [e for e in events if e.to_state in TERMINAL_STATES]
        generations = [e.generation for e in events if e.to_state]
        if len(terminal) > 1 and not any(e.to_state == State.QUEUED and e.from_state in TERMINAL_STATES for e in events):
            bad.append(f"{task_id}: {len(terminal)} terminal states")
        if generations != sorted(generations) or len(set(generations)) != len(generations):
            bad.append(f"{task_id}: generations not strictly increasing")
        task = ev.tasks.get(task_id)
        success = next((e for e in reversed(events) if e.to_state == State.SUCCEEDED), None)
        if task and success and task.result_path:
            published = Path(task.result_path).name.split("-", 1)[0]
            if published != f"g{success.generation - 1}":
                bad.append(f"{task_id}: result of {published} published at g{success.generation - 1}")
    return Result("late_writes_accepted", not bad, len(bad), "== 0", "; ".join(bad[:3]))


def secrets_in_logs(ev: Evidence) -> Result:
    """The run's original filenames, file contents (markers) and tokens in any log line or stored error."""
    needles = sorted(s for s in ev.ctx.secrets if s)
    found: dict[str, int] = defaultdict(int)
    scanned = 0
    for path in ev.log_files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        scanned += 1
        for needle in needles:
            if needle in text:
                found[path.name] += text.count(needle)
    stored = "\n".join(ev.stored_texts())
    for needle in needles:
        if needle in stored:
            found["database"] += stored.count(needle)
    observed = sum(found.values())
    detail = f"scanned {scanned} log files and stored errors for {len(needles)} secrets"
    if found:
        detail += f"; found in {dict(found)}"
    return Result("secrets_in_logs", observed == 0, observed, "== 0", detail)


COMMON = (lost_tasks, undetected_duplicate_billing, budget_violations, late_writes_accepted, secrets_in_logs,
          unattended_tasks)


# --- building blocks for scenarios -----------------------------------------------------------------------
def all_succeeded(ev: Evidence, *, phase: str | None = None) -> Result:
    ids = [a.id for a in ev.ctx.accepted if phase is None or a.spec.phase == phase]
    done = sum(1 for i in ids if ev.tasks.get(i) and ev.tasks[i].state == State.SUCCEEDED)
    name = "all_succeeded" + (f"_{phase}" if phase else "")
    failures = {ev.tasks[i].error_code for i in ids if ev.tasks.get(i) and ev.tasks[i].state != State.SUCCEEDED}
    return Result(name, done == len(ids) and bool(ids), done, f"== {len(ids)}", f"others: {failures}" if failures else "")


def one_billed_job_per_task(ev: Evidence) -> Result:
    """Each succeeded task was billed exactly once (no retry, reconcile or fallback paid twice),
    and nothing else was billed, per the vendor's ledger."""
    billed = ev.billed_by_task()
    succeeded = {tid for tid, t in ev.tasks.items() if t.state == State.SUCCEEDED}
    twice = sorted(tid for tid, jobs in billed.items() if len(jobs) > 1)
    others = sum(len(jobs) for tid, jobs in billed.items() if tid not in succeeded)
    total = ev.invariants.get("billed_jobs", 0)
    ok = not twice and others == 0 and total == len(succeeded)
    return Result("one_billed_job_per_task", ok, total, f"== {len(succeeded)} (succeeded tasks)",
                  f"billed twice: {twice[:3]}; billed for unsucceeded tasks: {others}" if not ok else "")


def completed_jobs_fetched(ev: Evidence) -> Result:
    """No job the vendor completed (and billed) was left unfetched for a task that wanted it."""
    ids = set(ev.tasks)
    left = [j for j in ev.invariants.get("billed_never_fetched", [])
            if ((j.get("client_ref") or "").rsplit("-", 1)[0] in ids or ev.task_of_digest(j.get("input_sha256")))
            and j["job_id"] not in {dup for i in ev.incidents for dup in i.duplicate_job_ids}]
    return Result("completed_jobs_abandoned", not left, len(left), "== 0", "; ".join(j["job_id"] for j in left[:3]))


def downloads_not_repolled(ev: Evidence) -> Result:
    """Once a job's result download began, a failed download was retried as a download: the job
    was not polled again."""
    first_download: dict[str, float] = {}
    for entry in ev.journal:
        if entry["endpoint"] == "GET /v1/jobs/*/result" and entry["job_id"]:
            first_download.setdefault(entry["job_id"], entry["ts"])
    repolled = {e["job_id"] for e in ev.journal if e["endpoint"] == "GET /v1/jobs/*" and e["job_id"] in first_download
                and e["ts"] > first_download[e["job_id"]]}
    failed = sum(1 for e in ev.journal if e["endpoint"] == "GET /v1/jobs/*/result" and e["status"] != 200)
    return Result("downloads_retried_without_polling", not repolled and failed > 0,
                  {"repolled_jobs": len(repolled), "failed_downloads": failed}, "repolled == 0, failed > 0")


def no_dead_letters(ev: Evidence) -> Result:
    from tasks.models import DeadLetter

    count = DeadLetter.objects.filter(task_id__in=list(ev.tasks)).count()
    return Result("dead_letters", count == 0, count, "== 0")


def waited_for(reason: str) -> Any:
    """Some task waited durably with this waiting reason."""

    def check(ev: Evidence) -> Result:
        tasks = {tid for tid, events in ev.events.items() if any((e.data or {}).get("waiting_reason") == reason for e in events)}
        return Result(f"waited_{reason}", bool(tasks), len(tasks), "> 0 tasks")

    return check


def requests_per_task_under(bound: float) -> Any:
    def check(ev: Evidence) -> Result:
        per_task = len(ev.journal) / max(len(ev.tasks), 1)
        return Result("vendor_requests_per_task", per_task <= bound, round(per_task, 2), f"<= {bound}",
                      f"{len(ev.journal)} requests for {len(ev.tasks)} tasks")

    return check


def vendor_lost_jobs_handled(ev: Evidence) -> Result:
    """Jobs the vendor forgot were noticed as lost (not polled forever) and reported in billing."""
    lost = [j for j in ev.vendor_jobs if j.status == "lost"]
    reported = {dup for i in ev.incidents for dup in i.duplicate_job_ids}
    unreported = [j.vendor_job_id for j in lost if j.vendor_job_id not in reported]
    return Result("vendor_lost_jobs_reported", bool(lost) and not unreported,
                  {"lost": len(lost), "unreported": len(unreported)}, "lost > 0, unreported == 0")


def malformed_answers_classified(ev: Evidence) -> Result:
    calls = VendorCall.objects.filter(task_id__in=list(ev.tasks))
    malformed = calls.filter(error_class="MalformedResponse")
    by_decision = {d: malformed.filter(decision=d).count() for d in ("reconcile", "retry")}
    redirected = calls.filter(status_code__gte=300, status_code__lt=400)
    refused = redirected.filter(decision="fail").count()
    ok = malformed.exists() and redirected.exists() and refused == redirected.count() and by_decision["reconcile"] > 0
    return Result("garbled_answers_classified", ok,
                  {"malformed": malformed.count(), **by_decision, "redirects": redirected.count(), "redirects_refused": refused},
                  "malformed > 0 (creates reconciled, reads retried), every redirect refused")


def reconciliations_adopted_lost_jobs(ev: Evidence) -> Result:
    lost = len(ev.journal_where(endpoint="POST /v1/jobs", outcome_prefix="response_lost"))
    adopted = sum(1 for j in ev.vendor_jobs if j.adopted and j.duplicate_of_id is None)
    return Result("lost_responses_adopted", adopted >= lost > 0, adopted, f">= {lost} (responses lost)")


def retries_waited_retry_after(ev: Evidence) -> Result:
    """After a 429/503 with Retry-After, the same operation came back no sooner than told."""
    violations, checked, extra = [], 0, []
    by_key: dict[tuple, list[dict]] = defaultdict(list)
    for entry in ev.journal:
        # Reads of one job are tied by its id; creates and uploads by the operation's client_ref.
        ident = entry["job_id"] if "/jobs/*" in entry["endpoint"] else entry["client_ref"] or entry["idempotency_key"]
        key = (entry["endpoint"], ident)
        if key[1]:
            by_key[key].append(entry)
    for entries in by_key.values():
        for first, following in zip(entries, entries[1:]):
            if first["status"] not in (429, 503) or not first["retry_after"]:
                continue
            told = _retry_after_s(first)
            waited = (following["ts"] - first["ts"]) / ev.ctx.time_scale
            checked += 1
            extra.append(waited - told)
            if waited < told * 0.95 - 0.5:
                violations.append(f"{first['endpoint']} waited {waited:.2f}s < {told}s")
    spread = (max(extra) - min(extra)) if len(extra) > 1 else 0.0
    ok = not violations and checked > 0 and spread > 0
    detail = f"{checked} rate-limited requests checked; jitter spread {spread:.2f}s" + (f"; {violations[:3]}" if violations else "")
    return Result("retries_waited_retry_after", ok, len(violations), "== 0 (and jitter on top)", detail)


def _retry_after_s(entry: dict[str, Any]) -> float:
    value = entry["retry_after"]
    if value.isdigit():
        return float(value)
    when = parsedate_to_datetime(value).timestamp()
    return max(when - math.floor(entry["ts"]), 0.0)


def both_retry_after_forms_seen(ev: Evidence) -> Result:
    values = [e["retry_after"] for e in ev.journal if e["retry_after"]]
    seconds = sum(1 for v in values if v.isdigit())
    dates = len(values) - seconds
    return Result("retry_after_both_forms", seconds > 0 and dates > 0, {"seconds": seconds, "http_date": dates}, "> 0 each")


def retries_spread(ev: Evidence, *, window_share: float = 0.1, limit: float = 0.35) -> Result:
    """Retries of a herd spread out: no window of 10% of their span holds more than 35% of them."""
    firsts: dict[str, float] = {}
    retries: list[float] = []
    for entry in ev.journal_where(endpoint="POST /v1/jobs"):
        ref = entry["client_ref"]
        if ref in firsts:
            if firsts[ref] is not None:
                retries.append(entry["ts"])
                firsts[ref] = None
        else:
            firsts[ref] = entry["ts"]
    if len(retries) < 5:
        return Result("retries_spread", False, len(retries), ">= 5 retries to judge", "not enough retries happened")
    retries.sort()
    span = retries[-1] - retries[0]
    width = span * window_share
    crowded = max(sum(1 for t in retries if start <= t <= start + width) for start in retries) / len(retries)
    return Result("retries_spread", crowded <= limit and span > 0, round(crowded, 3), f"<= {limit} of retries in any {int(window_share * 100)}% window",
                  f"{len(retries)} retries over {span / ev.ctx.time_scale:.1f} nominal s")


def polls_per_task_minute(ev: Evidence, *, bound: float = 2.0) -> Result:
    polls = ev.journal_where(endpoint="GET /v1/jobs/*")
    minutes = 0.0
    for job in ev.vendor_jobs:
        requests = [e["ts"] for e in polls if e["job_id"] == job.vendor_job_id]
        if requests:
            created = job.created_at.timestamp()
            minutes += max((max(requests) - created) / ev.ctx.time_scale / 60.0, 1.0)
    rate = round(len(polls) / minutes, 3) if minutes else 0.0
    return Result("polls_per_task_minute", 0 < rate <= bound, rate, f"<= {bound}", f"{len(polls)} status requests over {minutes:.1f} task-minutes")


def breaker_opened_and_closed(ev: Evidence, *, channel: str = "primary") -> Result:
    transitions = list(BreakerTransition.objects.filter(channel_id=channel).order_by("at").values_list("to_state", flat=True))
    opened = "OPEN" in transitions
    closed_after = opened and "CLOSED" in transitions[transitions.index("OPEN"):]
    return Result("breaker_opened_then_closed", opened and closed_after, " → ".join(transitions) or "none",
                  "OPEN … HALF_OPEN → CLOSED")


def some_tasks_on(ev: Evidence, channel: str, *, phase: str | None = None) -> Result:
    ids = [a.id for a in ev.ctx.accepted if phase is None or a.spec.phase == phase]
    count = sum(1 for i in ids if ev.tasks.get(i) and ev.tasks[i].channel_id == channel and ev.tasks[i].state == State.SUCCEEDED)
    name = f"succeeded_on_{channel}" + (f"_{phase}" if phase else "")
    return Result(name, count > 0, count, "> 0")


def none_succeeded(ev: Evidence, *, phase: str) -> Result:
    ids = [a.id for a in ev.ctx.accepted if a.spec.phase == phase]
    count = sum(1 for i in ids if ev.tasks.get(i) and ev.tasks[i].state == State.SUCCEEDED)
    return Result(f"none_succeeded_{phase}", count == 0 and bool(ids), count, f"== 0 of {len(ids)}")


def nothing_billed(ev: Evidence, *, phase: str) -> Result:
    ids = {a.id for a in ev.ctx.accepted if a.spec.phase == phase}
    billed = sum(1 for j in ev.vendor_jobs if str(j.task_id) in ids)
    return Result(f"nothing_billed_{phase}", billed == 0, billed, "== 0")


def uploads_replayed_from_byte_zero(ev: Evidence) -> Result:
    """Each operation whose upload was reset later sent the whole file."""
    resets = ev.journal_where(outcome_prefix="reset mid-body")
    sizes = {a.id: ev.tasks[a.id].file.size for a in ev.ctx.accepted if a.id in ev.tasks}
    replayed = 0
    for reset in resets:
        ref = reset["client_ref"] or ""
        task_id = ref.rsplit("-", 1)[0]
        later = [e for e in ev.journal if e["client_ref"] == ref and e["ts"] > reset["ts"] and e["status"] in (200, 201)
                 and e["endpoint"] in ("POST /v1/uploads", "POST /v1/jobs")]
        if any(e["bytes_in"] == sizes.get(task_id) for e in later):
            replayed += 1
    return Result("resets_replayed_in_full", replayed == len(resets) and resets, replayed, f"== {len(resets)} resets")


def duplicates_cancelled(ev: Evidence) -> Result:
    """Every extra job Sluice found was cancelled at the vendor, unless it had already finished."""
    extras = [j for j in ev.vendor_jobs if j.duplicate_of_id is not None]
    left_running = [j for j in extras if j.terminal_at is None]
    cancelled = sum(1 for j in extras if j.status == "canceled")
    return Result("duplicates_stopped", bool(extras) and not left_running, {"extras": len(extras), "cancelled": cancelled,
                  "still_running": len(left_running)}, "extras > 0, still_running == 0")


def slots_all_released(ev: Evidence) -> Result:
    observed = ev.open_slots + ev.live_vendor_jobs
    return Result("budget_slots_released", observed == 0, {"open_slots": ev.open_slots, "live_jobs": ev.live_vendor_jobs}, "== 0")


def exactly_one_terminal_state(ev: Evidence) -> Result:
    bad = [tid for tid, events in ev.events.items() if sum(1 for e in events if e.to_state in TERMINAL_STATES) != 1]
    return Result("exactly_one_terminal_state", not bad, len(bad), "== 0 tasks with more or less than one")


def executions_never_overlap(ev: Evidence) -> Result:
    """A new vendor job of a task starts only after the previous one was confirmed ended."""
    jobs_by_task: dict[str, list] = defaultdict(list)
    for job in ev.vendor_jobs:
        if job.duplicate_of_id is None:
            jobs_by_task[str(job.task_id)].append(job)
    overlaps = 0
    for jobs in jobs_by_task.values():
        jobs.sort(key=lambda j: j.created_at)
        for earlier, later in zip(jobs, jobs[1:]):
            if earlier.terminal_at is None or earlier.terminal_at > later.created_at:
                overlaps += 1
    return Result("overlapping_executions", overlaps == 0, overlaps, "== 0")


def no_orphaned_results(ev: Evidence) -> Result:
    """Every kept result (in the bucket, or under RESULTS_DIR) belongs to its task, and every task's
    result is there."""
    published = {t.result_path for t in ev.tasks.values() if t.result_path}
    kept = {name for tid in ev.tasks for name, _ in stored_results(tid)}
    orphans = kept - published
    missing = [p for p in published if not result_exists(p)]
    return Result("orphaned_result_files", not orphans and not missing, len(orphans), "== 0", f"missing {len(missing)}" if missing else "")


def notifications_at_most_once(ev: Evidence) -> Result:
    receiver = ev.ctx.receiver
    if receiver is None:
        return Result("notifications_at_most_once", False, "no receiver", "a receiver")
    acked = receiver.acknowledged()
    twice = {k: v for k, v in acked.items() if v > 1}
    return Result("notifications_at_most_once", not twice and receiver.bad_signatures == 0, len(twice), "== 0 events acknowledged twice",
                  f"{len(acked)} events acknowledged; bad signatures {receiver.bad_signatures}")


def quarantined_with_reason(ev: Evidence, expected: dict[str, str]) -> Result:
    """Each bad file (by content name) was quarantined with the right reason."""
    wrong = []
    for accepted in ev.ctx.accepted:
        reason = expected.get(accepted.spec.content)
        if reason is None:
            continue
        task = ev.tasks.get(accepted.id)
        entry = Quarantine.objects.filter(sha256=accepted.sha256).first()
        if task is None or task.error_code != "quarantined" or entry is None or entry.reason != reason:
            wrong.append(f"{accepted.spec.content}: {getattr(entry, 'reason', None)} (task {getattr(task, 'state', None)})")
    return Result("quarantined_with_right_reason", not wrong, len(wrong), "== 0 wrong or missing", "; ".join(wrong))


def bad_files_never_reached_the_vendor(ev: Evidence, contents: set[str]) -> Result:
    bad_ids = {a.id for a in ev.ctx.accepted if a.spec.content in contents}
    calls = VendorCall.objects.filter(task_id__in=bad_ids).count()
    journal = sum(1 for e in ev.journal if (e["client_ref"] or "").rsplit("-", 1)[0] in bad_ids)
    return Result("bad_files_reached_vendor", calls == 0 and journal == 0, calls + journal, "== 0")


def queue_wait_p95_under(ev: Evidence, *, lane: str, bound_s: float) -> Result:
    p95 = ev.p95(ev.queue_waits_s(lane=lane))
    return Result(f"{lane}_p95_queue_wait_s", p95 <= bound_s, p95, f"<= {bound_s}")


def failing_notification_retried_without_rerun(ev: Evidence) -> Result:
    receiver = ev.ctx.receiver
    ids = [a.id for a in ev.ctx.accepted if a.spec.callback == "fail"]
    if receiver is None or not ids:
        return Result("failing_notification_retried", False, 0, "a task with a failing endpoint")
    tries = [receiver.attempts_for_task(i) for i in ids]
    reruns = sum(1 for i in ids if ev.tasks.get(i) and ev.tasks[i].attempts > 1)
    return Result("failing_notification_retried_without_rerun", min(tries) >= 2 and reruns == 0,
                  {"deliveries": tries, "task_reruns": reruns}, "deliveries >= 2, reruns == 0")


def expired_only_past_deadline(ev: Evidence) -> Result:
    early = []
    for task in ev.tasks.values():
        if task.state != State.EXPIRED or not task.queue_deadline_at:
            continue
        expired = next((e.at for e in ev.events[str(task.pk)] if e.to_state == State.EXPIRED), None)
        if expired and expired < task.queue_deadline_at and task.error_code != "shed":
            early.append(str(task.pk))
    return Result("expired_only_past_deadline", not early, len(early), "== 0")


def tenant_running_within_quota(ev: Evidence, tenant: str, limit: int) -> Result:
    """Reconstructed from attempts: the tenant never had more executions at once than its quota."""
    points = []
    for accepted in ev.ctx.accepted:
        if accepted.tenant != tenant:
            continue
        for attempt in ev.attempts.get(accepted.id, []):
            points.append((attempt.started_at.timestamp(), 1))
            points.append(((attempt.ended_at or attempt.started_at).timestamp(), -1))
    points.sort(key=lambda p: (p[0], p[1]))
    peak = current = 0
    for _, step in points:
        current += step
        peak = max(peak, current)
    return Result(f"quota_max_running_{tenant}", peak <= limit, peak, f"<= {limit}")


def fair_share(ev: Evidence, *, lane: str, weights: dict[str, float], tolerance: float) -> Result:
    """While every weighted tenant had work waiting in the lane, admissions followed the weights.

    An admission is the moment the dispatcher gave the task a slot (its `dispatched_at`, for tasks
    with one attempt; otherwise its first start), and a tenant was waiting while it had a task
    queued and not yet admitted."""
    starts: list[tuple[float, str]] = []
    queued: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for accepted in ev.ctx.accepted:
        task = ev.tasks.get(accepted.id)
        if task is None or task.lane_id != lane or accepted.tenant not in weights:
            continue
        events = ev.events[accepted.id]
        q = next((e.at.timestamp() for e in events if e.to_state == State.QUEUED), None)
        r = next((e.at.timestamp() for e in events if e.to_state == State.RUNNING), None)
        if task.attempts == 1 and task.dispatched_at is not None:
            r = task.dispatched_at.timestamp()
        if q and r:
            starts.append((r, accepted.tenant))
            queued[accepted.tenant].append((q, r))
    contested = []
    for at, tenant in starts:
        if all(any(q <= at < r or (q <= at and r >= at) for q, r in queued[t]) for t in weights):
            contested.append(tenant)
    if len(contested) < 6:
        return Result(f"fair_share_{lane}", False, len(contested), ">= 6 contested starts to judge")
    total_weight = sum(weights.values())
    shares = {t: round(contested.count(t) / len(contested), 3) for t in weights}
    worst = max(abs(shares[t] - weights[t] / total_weight) for t in weights)
    expected = {t: round(w / total_weight, 3) for t, w in weights.items()}
    return Result(f"fair_share_{lane}", worst <= tolerance, shares, f"{expected} ± {tolerance}", f"{len(contested)} contested starts")


def cancel_answers_match_outcomes(ev: Evidence) -> Result:
    """A cancel answered 409 means success had won; one accepted (202) means the task ended CANCELLED."""
    wrong = []
    for task_id, status in ev.ctx.cancels.items():
        state = ev.tasks[task_id].state if task_id in ev.tasks else None
        if status == 409 and state != State.SUCCEEDED:
            wrong.append(f"{task_id}: 409 but {state}")
        if status == 202 and state != State.CANCELLED:
            wrong.append(f"{task_id}: 202 but {state}")
    return Result("cancel_answers_match_outcomes", not wrong and bool(ev.ctx.cancels), len(wrong), "== 0",
                  f"{len(ev.ctx.cancels)} cancels; " + "; ".join(wrong[:3]))


def race_exercised(ev: Evidence) -> Result:
    states = [ev.tasks[t].state for t in ev.ctx.cancels if t in ev.tasks]
    won = {"cancel": states.count(State.CANCELLED), "success": states.count(State.SUCCEEDED)}
    return Result("both_outcomes_seen", won["cancel"] > 0 and won["success"] > 0, won, "> 0 each")


def cancelled_leave_no_result(ev: Evidence) -> Result:
    traces = [str(t.pk) for t in ev.tasks.values()
              if t.state == State.CANCELLED and (t.result_path or next(stored_results(t.pk), None))]
    return Result("cancelled_tasks_left_no_result", not traces, len(traces), "== 0")


def late_results_rejected(ev: Evidence) -> Result:
    """Every task cancelled while its result was downloading refused that result when it came in
    (and at least one was)."""
    cancelled = ev.ctx.notes.get("cancelled_mid_download", [])
    refused = [t for t in cancelled if any("late result discarded" in e.reason for e in ev.events.get(t, []))]
    kept = [t for t in cancelled if ev.tasks.get(t) is not None and ev.tasks[t].result_path]
    observed = {"cancelled_mid_download": len(cancelled), "late_results_refused": len(refused), "results_kept": len(kept)}
    ok = bool(cancelled) and len(refused) == len(cancelled) and not kept
    return Result("late_results_rejected", ok, observed,
                  "every task cancelled mid-download refused its late result (at least one)")


def outcomes_by_content(ev: Evidence, expected: dict[str, tuple[str, ...]]) -> Result:
    wrong = []
    for accepted in ev.ctx.accepted:
        allowed = expected.get(accepted.spec.content)
        task = ev.tasks.get(accepted.id)
        if allowed and (task is None or task.state not in allowed):
            wrong.append(f"{accepted.spec.content}: {getattr(task, 'state', None)} ({getattr(task, 'error_code', '')})")
    return Result("outcomes_as_expected", not wrong, len(wrong), f"== 0 ({expected})", "; ".join(wrong[:4]))


def noted(name: str, key: str, expected: str = "recorded") -> Any:
    def check(ev: Evidence) -> Result:
        value = ev.ctx.notes.get(key)
        return Result(name, value is not None, value, expected)

    return check


def outcomes_by_error(ev: Evidence, allowed: dict[str, tuple[str, ...]]) -> Result:
    """Every task ended in an allowed state with an allowed error code."""
    wrong = [f"{t.pk} {t.state} ({t.error_code})" for t in ev.tasks.values()
             if t.state not in allowed or (t.error_code or "") not in allowed[t.state]]
    return Result("outcomes_as_expected", not wrong, len(wrong), f"== 0 outside {allowed}", "; ".join(wrong[:3]))


def held_for_operator(ev: Evidence) -> Result:
    """Every create whose answer was lost, at a vendor that cannot be searched, holds for an operator:
    nothing was resent for it."""
    lost = {e["task_id"] for e in ev.journal_where(endpoint="POST /v1/jobs", outcome_prefix="response_lost")}
    held = {tid for tid, t in ev.tasks.items() if t.state == State.RECONCILING and t.waiting_reason == "needs_operator"}
    resent = {tid for tid in lost if len(ev.journal_where(endpoint="POST /v1/jobs", task_id=tid)) > 1}
    ok = bool(lost) and lost <= held and not resent
    return Result("ambiguous_creates_held_for_operator", ok,
                  {"lost_answers": len(lost), "held": len(held), "resent": len(resent)}, "held ⊇ lost > 0, resent == 0")


def one_billed_job_per_task_or_held(ev: Evidence) -> Result:
    """No task was billed twice: a succeeded one once, one held for an operator at most once (its
    lost create), per the vendor's ledger."""
    billed = ev.billed_by_task()
    twice = sorted(tid for tid, jobs in billed.items() if len(jobs) > 1)
    succeeded = [tid for tid, t in ev.tasks.items() if t.state == State.SUCCEEDED]
    unbilled = [tid for tid in succeeded if not billed.get(tid)]
    ok = not twice and not unbilled
    return Result("no_task_billed_twice", ok, {"billed_twice": len(twice), "succeeded_unbilled": len(unbilled)},
                  "== 0 each", "; ".join(twice[:3]))


def started_by_deadline(ev: Evidence) -> Result:
    """Of any two tasks of a lane waiting at the same time, the one with the earlier deadline was
    admitted first (earliest deadline first, within quotas)."""
    admitted = {}
    for tid, task in ev.tasks.items():
        first_queued = next((e.at for e in ev.events[tid] if e.to_state == State.QUEUED), None)
        if first_queued and task.dispatched_at is None:
            task_start = next((e.at for e in ev.events[tid] if e.to_state == State.RUNNING), None)
        else:
            task_start = task.dispatched_at or next((e.at for e in ev.events[tid] if e.to_state == State.RUNNING), None)
        # It has waited since it last entered the queue before that start (a task sent back to
        # the queue after an admission waits anew).
        queued = max((e.at for e in ev.events[tid] if e.to_state == State.QUEUED and task_start and e.at <= task_start),
                     default=first_queued)
        if queued and task_start:
            admitted[tid] = (queued, task_start, min(task.deadline_at, task.queue_deadline_at or task.deadline_at))
    inversions, pairs = [], 0
    # A pass stamps its tasks with the moment it took the admission lock, then reads the lane and
    # grants slots one after the other (on a loaded 2-core machine that takes up to a second): a
    # task whose entry into the queue committed after that read was not seen by the pass.
    seen = timedelta(seconds=1.5)
    for a, (qa, sa, da) in admitted.items():
        for b, (qb, sb, db) in admitted.items():
            # b was waiting when a was admitted, and b's deadline was earlier: an inversion.
            if a != b and qb <= sa - seen and sb > sa and ev.tasks[a].lane_id == ev.tasks[b].lane_id:
                pairs += 1
                if db < da:
                    inversions.append(f"{a[:8]} before {b[:8]}")
    return Result("started_by_earliest_deadline", pairs > 0 and not inversions, len(inversions),
                  "== 0 inversions", f"{pairs} contested pairs; " + "; ".join(inversions[:3]))


def zombie_killed_in_time(ev: Evidence) -> Result:
    """A step that outlived its attempt was killed by django-q2 within the execution timeout plus
    the grace (and django-q2's 3 s guard), said so in a log line, and its lane went on working."""
    import json as _json

    from tasks.queueing import step_timeout_s

    kills = []
    for path in ev.log_files:
        for line in path.read_text(errors="replace").splitlines():
            if '"step_killed"' in line:
                try:
                    kills.append(_json.loads(line))
                except ValueError:
                    continue
    if not kills:
        return Result("zombie_killed_in_time", False, 0, "a step_killed log line", "no step was killed")
    lane = "interactive"
    bound = step_timeout_s(lane) + 3 + 2  # + django-q2's guard buffer + scheduling slack
    worst = max(k.get("elapsed_s", 0) for k in kills)
    killed_at = min(k["ts"] for k in kills)
    later = sum(1 for events in ev.events.values() for e in events
                if e.to_state == State.RUNNING and e.at.timestamp() > killed_at)
    ok = worst <= bound and later > 0
    return Result("zombie_killed_in_time", ok, {"killed": len(kills), "elapsed_s": worst, "starts_after_kill": later},
                  f"elapsed <= {bound}s (execution timeout + grace), starts after > 0")


def engine_left_nothing(ev: Evidence) -> Result:
    """Every converter of the run is gone and its temporary files with it."""
    from tasks.models import VendorJob
    from tasks.vendors.local import root

    ids = list(VendorJob.objects.filter(task_id__in=[a.id for a in ev.ctx.accepted], channel_id="local")
               .values_list("vendor_job_id", flat=True))
    temp = [j for j in ids if (root() / "jobs" / j / "tmp").exists()]
    running = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        running += [j for j in ids if j.encode() in cmdline]
    return Result("engine_left_nothing", bool(ids) and not temp and not running,
                  {"engine_jobs": len(ids), "temp_dirs": len(temp), "converters_running": len(running)},
                  "jobs > 0, temp dirs == 0, converters == 0")


def normal_documents_not_starved(ev: Evidence, *, normal: str, heavy: str) -> Result:
    """Normal documents keep converting while heavy ones hold the engine: each started before the
    last heavy one finished (they were not queued behind the whole heavy burst)."""
    def times(content: str) -> list[tuple[Any, Any]]:
        rows = []
        for accepted in ev.ctx.accepted:
            task = ev.tasks.get(accepted.id)
            if accepted.spec.content == content and task is not None:
                rows.append((task.started_at, task.finished_at))
        return rows

    heavy_ends = [end for _, end in times(heavy) if end]
    normal_starts = [start for start, _ in times(normal)]
    late = [s for s in normal_starts if s is None or (heavy_ends and s > max(heavy_ends))]
    return Result("normal_documents_not_starved", bool(heavy_ends) and bool(normal_starts) and not late, len(late),
                  "== 0 normal documents started after the heavy burst ended")


def goaways_over_http2(ev: Evidence) -> Result:
    """Sluice spoke HTTP/2 to the vendor, and the vendor's GOAWAYs reached it (both kinds)."""
    vendor = [e for e in ev.journal if e["endpoint"].split(" ", 1)[-1].startswith(("/v1", "/v2"))]
    protocols = sorted({e.get("protocol") or "?" for e in vendor})
    refused = sum(1 for e in vendor if e["outcome"] == "goaway")
    cut_off = sum(1 for e in vendor if e["outcome"] == "response_lost:goaway")
    observed = {"protocols": protocols, "goaway_refused": refused, "goaway_after_processing": cut_off}
    return Result("goaways_over_http2", protocols == ["HTTP/2"] and refused > 0 and cut_off > 0, observed,
                  "every request over HTTP/2, both kinds of GOAWAY seen")
