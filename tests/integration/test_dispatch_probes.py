"""A dispatcher's tick asks every pass whether it has work in one statement, built from the
passes' querysets. Each probe is compiled by the ORM once and then only has the values that follow
the clock computed (tasks/services/dispatch.py, `_probe_sql`): the statement must be exactly the
one the ORM would compile at that moment, on both databases."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from tasks.models import FileVersion, Task
from tasks.services import dispatch
from tasks.states import State

pytestmark = pytest.mark.django_db


MOMENTS = [timedelta(0), timedelta(seconds=-3), timedelta(days=3, microseconds=17), timedelta(days=-800)]


@pytest.mark.parametrize("name", list(dispatch._FULL_PASSES))
def test_a_probe_kept_between_ticks_asks_what_the_orm_would_ask(name):
    probe = dispatch._FULL_PASSES[name][0]
    now = timezone.now()
    dispatch._probe_sql(probe, now)
    assert dispatch._SHAPES[(probe, connection.alias, dispatch.timescale.scale())] is not None, \
        f"{name}'s probe is compiled at every tick"
    for moment in (now + shift for shift in MOMENTS):
        assert dispatch._probe_sql(probe, moment) == dispatch._compiled(probe(moment))


def test_a_probe_whose_statement_does_not_follow_the_clock_is_compiled_every_time():
    def day_started(now):  # a value that is not `now` less a fixed time
        return Task.objects.filter(due_at__lte=now.replace(hour=0, minute=0, second=0, microsecond=0))

    now = timezone.now().replace(hour=12)
    assert dispatch._probe_sql(day_started, now) == dispatch._compiled(day_started(now))
    assert dispatch._SHAPES[(day_started, connection.alias, dispatch.timescale.scale())] is None
    later = now + timedelta(days=1, hours=5)
    assert dispatch._probe_sql(day_started, later) == dispatch._compiled(day_started(later))


def test_a_tick_finds_work_that_fell_due_and_compiles_no_queryset(tenant, monkeypatch):
    file = FileVersion.objects.create(tenant=tenant, sha256="cd" * 32, size=10, detected_type="audio/x-wav",
                                      extension="wav", label="a.wav", storage_name="x")
    task = Task.objects.create(tenant=tenant, file=file, kind="transcription", target_format="txt",
                               state=State.RETRY_WAIT, due_at=timezone.now() + timedelta(hours=1),
                               deadline_at=timezone.now() + timedelta(days=1))
    now = timezone.now()
    probes = {name: (probe, now) for name, (probe, _) in dispatch._SHORT_PASSES.items()}
    dispatch._which_have_rows(probes)  # the shapes are kept
    compiled = []  # the ORM's compilations from here on (each still made, and recorded)
    original = dispatch._compiled
    monkeypatch.setattr(dispatch, "_compiled", lambda queryset: compiled.append(queryset) or original(queryset))
    with CaptureQueriesContext(connection) as statements:
        assert "retries_due" not in dispatch._which_have_rows(probes)
        later = {name: (probe, task.due_at + timedelta(seconds=1)) for name, (probe, _) in probes.items()}
        assert "retries_due" in dispatch._which_have_rows(later)
    assert len(statements.captured_queries) == 2
    assert compiled == []
