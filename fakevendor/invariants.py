"""What the vendor knows happened, as QA checks it: double billing, jobs billed but never
fetched, concurrency peaks, requests per job."""

from __future__ import annotations

import time
from typing import Any

from fakevendor import jobs as J
from fakevendor.store import Store


def invariants(store: Store, *, uploads_max: dict[str, int], in_flight: int) -> dict[str, Any]:
    now = time.time()
    duplicates = []
    for row in store.query(
        "SELECT channel, client_ref, COUNT(*) AS n, SUM(amount_cents) AS cents, GROUP_CONCAT(job_id) AS jobs"
        " FROM ledger WHERE client_ref != '' GROUP BY channel, client_ref HAVING n > 1"
    ):
        duplicates.append({"channel": row["channel"], "client_ref": row["client_ref"], "jobs": row["jobs"].split(","),
                           "amount_cents": row["cents"]})
    jobs = [dict(r) for r in store.query("SELECT * FROM jobs")]
    never_fetched = [
        {"job_id": j["id"], "channel": j["channel"], "client_ref": j["client_ref"], "input_sha256": j["input_sha256"]}
        for j in jobs if J.job_status(j, now) == "completed" and not j.get("fetched_at")
    ]
    running = [j for j in jobs if J.job_status(j, now) in ("queued", "processing")]
    per_channel: dict[str, int] = {}
    overall = max_overlap([(j["created_at"], J.job_end(j)) for j in jobs])
    for name in {j["channel"] for j in jobs}:
        per_channel[name] = max_overlap([(j["created_at"], J.job_end(j)) for j in jobs if j["channel"] == name])
    by_endpoint = {
        r["endpoint"]: r["n"] for r in store.query("SELECT endpoint, COUNT(*) AS n FROM journal GROUP BY endpoint")
    }
    per_job: dict[str, dict[str, float]] = {}
    for r in store.query(
        "SELECT endpoint, COUNT(DISTINCT job_id) AS jobs, COUNT(*) AS total FROM journal"
        " WHERE job_id IS NOT NULL AND endpoint LIKE '% /v1/jobs/*%' GROUP BY endpoint"
    ):
        top = store.query(
            "SELECT COUNT(*) AS n FROM journal WHERE endpoint = ? AND job_id IS NOT NULL GROUP BY job_id ORDER BY n DESC LIMIT 1",
            (r["endpoint"],),
        )
        per_job[r["endpoint"]] = {"jobs": r["jobs"], "total": r["total"], "max": top[0]["n"] if top else 0,
                                  "mean": round(r["total"] / max(r["jobs"], 1), 2)}
    ledger = store.query("SELECT COUNT(*) AS n, COALESCE(SUM(amount_cents), 0) AS cents FROM ledger")[0]
    return {
        "duplicate_billed_client_refs": duplicates,
        "billed_never_fetched": never_fetched,
        "running_jobs": len(running),
        "max_concurrent_jobs": overall,
        "max_concurrent_jobs_by_channel": per_channel,
        "max_concurrent_uploads_by_channel": dict(uploads_max),
        "requests_by_endpoint": by_endpoint,
        "requests_per_job": per_job,
        "billed_jobs": ledger["n"],
        "requests_in_flight": in_flight,
        "billed_cents": ledger["cents"],
    }


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    points = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals], key=lambda p: (p[0], p[1]))
    best = current = 0
    for _, step in points:
        current += step
        best = max(best, current)
    return best
