"""What operators do to tasks, lanes and channels. Every action goes through the lifecycle
services (never an UPDATE of state) and says, when it does nothing, why."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django.utils import timezone

from tasks.errors import SluiceError
from tasks.lifecycle import record_event, task_update
from tasks.models import ChannelHealth, DeadLetter, Lane, Task, VendorChannel
from tasks.scheduling.channels import serves
from tasks.services.audit import audit
from tasks.services.cancel import task_cancel
from tasks.services.dispatch import dispatch_soon
from tasks.services.execution.reconcile import operator_decides
from tasks.services.replay import replay_refusal, task_replay
from tasks.states import TERMINAL_STATES, State
from tasks.vendors import breaker


@dataclass(frozen=True)
class Outcome:
    done: bool
    reason: str = ""


def retry_now(task: Task, actor: str) -> Outcome:
    """Skip the wait: a task in RETRY_WAIT (or RECONCILING) goes at once."""
    if task.state not in (State.RETRY_WAIT, State.RECONCILING):
        return Outcome(False, f"not waiting to retry ({task.state})")
    if task_update(task.pk, state=task.state, generation=task.generation, due_at=timezone.now(), enqueued_at=None):
        return Outcome(True)
    return Outcome(False, "it moved on meanwhile")


def cancel(task: Task, actor: str) -> Outcome:
    if task.state in TERMINAL_STATES:
        return Outcome(False, f"already {task.state}")
    try:
        result = task_cancel(task_id=task.pk, actor=actor, reason=f"cancelled by {actor}")
    except SluiceError as error:
        return Outcome(False, error.detail)
    return Outcome(result.changed, "" if result.changed else "a cancel was already requested")


def replay(task: Task, actor: str) -> Outcome:
    refusal = replay_refusal(task)
    if refusal:
        return Outcome(False, refusal)
    return Outcome(True) if task_replay(task=task, actor=actor) else Outcome(False, "it moved on meanwhile")


def discard_dead_letter(task: Task, actor: str) -> Outcome:
    updated = DeadLetter.objects.filter(task=task, resolved_at__isnull=True).update(
        resolved_at=timezone.now(), resolution="discarded", resolved_by=actor[:150]
    )
    return Outcome(bool(updated), "" if updated else "no open dead letter")


def resend_accepting_duplicate(task: Task, actor: str) -> Outcome:
    """For a task whose vendor cannot be searched: send the operation again although the vendor
    may hold a job for it already (a second charge is then detected and reported)."""
    if task.waiting_reason != "needs_operator":
        return Outcome(False, f"not waiting for an operator ({task.state})")
    done = operator_decides(task, decision="resend", actor_name=actor)
    return Outcome(done, "" if done else "it moved on meanwhile")


def mark_not_created(task: Task, actor: str) -> Outcome:
    """The operator checked the vendor's own console: no job exists for this task; send it again."""
    if task.waiting_reason != "needs_operator":
        return Outcome(False, f"not waiting for an operator ({task.state})")
    done = operator_decides(task, decision="not_created", actor_name=actor)
    return Outcome(done, "" if done else "it moved on meanwhile")


def move_channel(task: Task, actor: str, *, to: str = "") -> Outcome:
    """Send a queued task to another channel (an operator routing around an outage). Only a task
    not yet dispatched moves: it holds no vendor operation that could be processed, so moving it
    can not bill twice."""
    channel = VendorChannel.objects.filter(pk=to).first()
    if channel is None or not channel.enabled:
        return Outcome(False, f"there is no enabled channel {to!r}")
    if task.state != State.QUEUED or task.dispatched_at is not None:
        return Outcome(False, f"only queued tasks not yet dispatched move ({task.state})")
    if not serves(channel, task.kind):
        return Outcome(False, f"channel {channel.name} does not do {task.kind}")
    if task.channel_id == channel.name:
        return Outcome(False, f"already on {channel.name}")
    abandoned = [c for c in (task.abandoned_channels or []) if c != channel.name]
    if not task_update(task.pk, state=State.QUEUED, generation=task.generation,
                       expect={"dispatched_at__isnull": True, "channel_id": task.channel_id},
                       channel_id=channel.name, abandoned_channels=abandoned):
        return Outcome(False, "it moved on meanwhile")
    record_event(task.pk, generation=task.generation, actor=actor,
                 reason=f"moved from channel {task.channel_id or '—'} to {channel.name} by {actor}")
    dispatch_soon(task.lane_id)
    return Outcome(True)


TASK_ACTIONS: dict[str, tuple[str, Callable[..., Outcome], str]] = {
    # name: (permission, function, label)
    "retry_now": ("tasks.operate_tasks", retry_now, "Retry now"),
    "cancel": ("tasks.operate_tasks", cancel, "Cancel"),
    "replay": ("tasks.operate_tasks", replay, "Replay (same task, new generation)"),
    "discard": ("tasks.manage_quarantine", discard_dead_letter, "Discard dead letter"),
    "resend_accept_duplicate": ("tasks.operate_tasks", resend_accepting_duplicate,
                                "Resend (I accept a possible duplicate)"),
    "mark_not_created": ("tasks.operate_tasks", mark_not_created, "Mark as not created, then resend"),
    "move_channel": ("tasks.operate_tasks", move_channel, "Move to another channel"),
}
# What the console says before an action that cannot be taken back.
WARNINGS = {
    "cancel": "Cancel this task? Its work so far is lost and the vendor job is stopped; this cannot be undone.",
    "replay": "Replay this task? It runs again as a new generation, and the vendor may bill it again.",
    "resend_accept_duplicate": "Send this task again although the vendor may hold a job for it (a possible second charge)?",
    "mark_not_created": "Send this task again as never received by the vendor?",
    "discard": "Discard this dead letter? It is closed without a replay.",
}
# Actions that take a parameter, and its name (the console asks for it).
ACTION_PARAMS = {"move_channel": "to"}
# Actions that need the operator to confirm what they assert, in these words.
CONFIRMATIONS = {
    "resend_accept_duplicate": "I accept that the vendor may bill this task twice.",
    "mark_not_created": "I checked the vendor's own records: it holds no job for this task.",
}


def applicable(action: str, task: Task) -> bool:
    """Whether offering this action on this task makes sense (the action re-checks when run)."""
    if action == "retry_now":
        return task.state in (State.RETRY_WAIT, State.RECONCILING)
    if action == "cancel":
        return task.state not in TERMINAL_STATES
    if action == "replay":
        return task.state in (State.FAILED, State.EXPIRED)
    if action == "discard":
        return DeadLetter.objects.filter(task=task, resolved_at__isnull=True).exists()
    if action == "move_channel":
        return task.state == State.QUEUED and task.dispatched_at is None
    if action in ("resend_accept_duplicate", "mark_not_created"):
        return task.state == State.RECONCILING and task.waiting_reason == "needs_operator"
    return False


def lane_change(*, lane: Lane, actor: str, **changes) -> Lane:
    """Pause, resume or resize a lane while it runs."""
    allowed = {"paused", "max_running", "max_queued", "queue_deadline_s", "execution_timeout_s", "overflow_policy",
               "early_close_pct", "aging_s"}
    unknown = set(changes) - allowed
    if unknown:
        raise ValueError(f"cannot change {unknown}")
    before = {k: getattr(lane, k) for k in changes}
    Lane.objects.filter(pk=lane.pk).update(**changes)
    audit(actor=actor, action="lane_change", target_type="lane", target_id=lane.pk, done=1,
          detail={"before": before, "after": changes})
    lane.refresh_from_db()
    if not lane.paused:
        dispatch_soon(lane.pk)
    return lane


def breaker_force(*, channel: VendorChannel, state: str, actor: str) -> bool:
    before = breaker.health_for(channel).breaker_state
    moved = breaker.force(channel, state, actor=actor)
    audit(actor=actor, action="breaker_force", target_type="channel", target_id=channel.pk, done=int(moved),
          detail={"from": before, "to": state})
    return moved


BREAKER_CHOICES = (ChannelHealth.Breaker.FORCED_OPEN, ChannelHealth.Breaker.CLOSED, ChannelHealth.Breaker.DISABLED)
