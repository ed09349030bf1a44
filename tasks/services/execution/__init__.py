"""The steps a worker runs for a task: start (claim + upload + create), poll, fetch, reconcile, cancel.

Each step is a short django-q2 task. Between steps nothing holds a worker: the task row says what
is due next (`due_at`) and the dispatcher sends the next message. A step first takes a lease on
the task at its current (state, generation); every write afterwards is a compare-and-set on that
generation, so a step that was fenced (watchdog, cancel, deadline) can no longer change anything.
No vendor call happens inside a transaction.

One module per concept: `lease`, `guard` (running a step under its lease), `start`, `poll` (poll
and fetch), `reconcile`, `cancel`, `jobs` (vendor-job records and clean-up) and `retry` (what a
failure leads to).
"""

from tasks.services.execution.cancel import step_cancel
from tasks.services.execution.jobs import step_billing_audit, step_probe, step_vendor_job_cleanup
from tasks.services.execution.lease import Lease
from tasks.services.execution.poll import step_fetch, step_poll
from tasks.services.execution.reconcile import step_reconcile
from tasks.services.execution.start import claim, claim_attempt, new_operation_fields, step_start

__all__ = ["Lease", "claim", "claim_attempt", "new_operation_fields", "step_billing_audit", "step_cancel", "step_fetch", "step_poll", "step_probe", "step_reconcile",
           "step_start", "step_vendor_job_cleanup"]
