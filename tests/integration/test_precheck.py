"""The restricted pre-check: each detector on generated hostile files, the sandbox's limits, and
quarantine (release, purge, recognising the same content again)."""

import pytest

from tasks.models import FileVersion, Quarantine, Task, VendorJob
from tasks.poc import files
from tasks.precheck.sandbox import run_precheck
from tests.support.flows import route, submit_file

pytestmark = pytest.mark.django_db(transaction=True)


def check(tmp_path, content: bytes, extension: str):
    path = tmp_path / "input.bin"
    path.write_bytes(content)
    return run_precheck(path, extension)


@pytest.mark.parametrize("content,extension,pages,minutes", [
    (files.wav(6), "wav", None, 0.1),
    (files.mp3_like(2000), "mp3", None, 0.87),
    (files.flac(120), "flac", None, 2.0),
    (files.ogg_vorbis(30), "ogg", None, 0.5),
    (files.pdf(4), "pdf", 4, None),
    (files.docx(), "docx", 1, None),
    (files.text(9000), "txt", 3, None),
], ids=["wav", "mp3", "flac", "ogg", "pdf", "docx", "text"])
def test_good_files_pass_with_their_cost_estimate(tmp_path, content, extension, pages, minutes):
    result = check(tmp_path, content, extension)
    assert result.verdict == "pass", result.findings
    if pages is not None:
        assert result.findings["pages"] == pages
    if minutes is not None:
        assert result.findings["audio_minutes"] == pytest.approx(minutes, abs=0.01)


@pytest.mark.parametrize("content,extension,reason", [
    (files.truncated_pdf(), "pdf", "corrupt_file"),
    (files.zip_bomb_docx(300), "docx", "zip_bomb"),
    (files.elf_executable(), "wav", "executable"),
    (files.encrypted_docx(), "docx", "encrypted_document"),
    (files.encrypted_pdf(), "pdf", "encrypted_document"),
    (files.pdf(), "wav", "type_mismatch"),
    (files.wav(), "pdf", "type_mismatch"),
    (b"PK\x03\x04" + b"\x00" * 200, "docx", "corrupt_file"),
    (files.wav()[:60], "wav", "corrupt_file"),
], ids=["truncated-pdf", "zip-bomb", "exe-as-wav", "encrypted-docx", "encrypted-pdf", "pdf-as-wav", "wav-as-pdf",
        "broken-zip", "truncated-wav"])
def test_hostile_files_are_quarantined_with_the_right_reason(tmp_path, content, extension, reason):
    result = check(tmp_path, content, extension)
    assert (result.verdict, result.reason) == ("quarantine", reason), result.findings


@pytest.mark.parametrize("container,extension", [
    (files.wav(), "wav"), (files.pdf(), "pdf"), (files.docx(), "docx"),
], ids=["wav", "pdf", "docx"])
@pytest.mark.parametrize("payload", [
    files.elf_executable(), files.windows_executable(), files.docx(), b"#!/bin/sh\nrm -rf ~\n" + b"x" * 100,
    bytes(range(256)) * 400,  # 100 kB of something that is no padding
], ids=["elf", "pe", "zip", "script", "opaque"])
def test_content_appended_after_a_container_is_quarantined_as_a_trailing_payload(tmp_path, container, extension, payload):
    result = check(tmp_path, files.with_trailing(container, payload), extension)
    assert (result.verdict, result.reason) == ("quarantine", "trailing_payload"), result.findings
    assert result.findings["trailing_bytes"] == len(payload)


@pytest.mark.parametrize("container,extension", [(files.wav(), "wav"), (files.pdf(), "pdf"), (files.docx(), "docx")],
                         ids=["wav", "pdf", "docx"])
def test_a_few_bytes_of_padding_after_a_container_pass(tmp_path, container, extension):
    result = check(tmp_path, files.with_trailing(container, b"\r\n" + b"\x00" * 500), extension)
    assert result.verdict == "pass", result.findings


def test_a_wav_carrying_a_program_never_reaches_the_vendor(vendor, api):
    task = route(submit_file(api, files.with_trailing(files.wav(), files.windows_executable()), name="memo.wav"))
    assert task.state == "FAILED" and task.error_code == "quarantined"
    assert Quarantine.objects.get().reason == "trailing_payload"
    assert not VendorJob.objects.exists() and vendor.control.journal() == []


def test_a_zip_whose_headers_understate_its_size_is_caught(tmp_path):
    result = check(tmp_path, files.zip_bomb_lying_headers(64), "docx")
    assert result.verdict == "quarantine" and result.reason in ("zip_bomb", "corrupt_file")


def test_findings_never_carry_file_content(tmp_path):
    marker = b"SECRET-CONTENT-MARKER-7731"
    result = check(tmp_path, files.with_marker(files.text(), marker), "txt")
    assert "SECRET-CONTENT-MARKER" not in repr(result.findings)


@pytest.mark.parametrize("plugin,marker,reason", [
    ("tasks.precheck.hostile.crash", b"SLUICE-PRECHECK-CRASH", "precheck_crashed"),
    ("tasks.precheck.hostile.loop", b"SLUICE-PRECHECK-LOOP", "precheck_timeout"),
    ("tasks.precheck.hostile.allocate", b"SLUICE-PRECHECK-ALLOCATE", "precheck_crashed"),
])
def test_a_pre_check_that_crashes_loops_or_allocates_is_stopped_and_the_file_quarantined(tmp_path, settings, plugin, marker, reason):
    settings.PRECHECK_PLUGINS = [plugin]
    settings.PRECHECK_CPU_S = 1
    settings.PRECHECK_WALL_S = 5
    settings.PRECHECK_MEMORY_MB = 256
    result = check(tmp_path, files.with_marker(files.text(), marker), "txt")
    assert (result.verdict, result.reason) == ("quarantine", reason), result.findings
    leftovers = [p for p in __import__("pathlib").Path(settings.FILE_UPLOAD_TEMP_DIR).glob("precheck-*")]
    assert leftovers == [], "the private temp directory must be removed"


def test_a_quarantined_file_fails_its_task_never_reaches_the_vendor_and_is_recognised_again(vendor, api):
    task = route(submit_file(api, files.truncated_pdf(), name="contract.pdf", kind="conversion", target="txt"))
    assert task.state == "FAILED" and task.error_code == "quarantined"
    entry = Quarantine.objects.get()
    assert entry.reason == "corrupt_file" and entry.detector_version and entry.tenant_id == task.tenant_id
    assert not VendorJob.objects.exists() and vendor.control.journal() == []
    again = api.post("/api/v1/files", data=files.truncated_pdf(), content_type="application/octet-stream")
    assert FileVersion.objects.get(pk=again.json()["id"]).precheck_state == "quarantined"
    refused = api.post("/api/v1/tasks", data={"file_id": again.json()["id"], "kind": "conversion", "target_format": "txt"},
                       content_type="application/json")
    assert refused.status_code == 422 and refused.json()["code"] == "file_quarantined"


def test_release_replays_the_task_in_the_unknown_risk_lane_and_purge_removes_the_content(vendor, api):
    from tasks.services.quarantine import quarantine_purge, quarantine_release

    task = route(submit_file(api, files.encrypted_pdf(), name="locked.pdf", kind="conversion", target="txt"))
    entry = Quarantine.objects.get()
    outcome = quarantine_release(entry=entry, actor="operator olga")
    assert outcome["replayed"] == 1
    replayed = Task.objects.get(pk=task.pk)
    assert replayed.state == "QUEUED" and replayed.lane_id == "unknown-risk" and replayed.generation > task.generation
    second = route(submit_file(api, files.truncated_pdf(), name="b.pdf", kind="conversion", target="txt"))
    entry = Quarantine.objects.get(file=second.file)
    path = second.file.path
    assert quarantine_purge(entry=entry, actor="operator olga") and not path.exists()
    from tasks.models import AuditEntry

    assert set(AuditEntry.objects.values_list("action", flat=True)) >= {"quarantine_release", "quarantine_purge"}


def test_a_pre_check_left_behind_by_a_dead_worker_is_killed_and_its_temp_dir_removed(tmp_path, settings, db):
    import json
    import subprocess

    from tasks.precheck.sandbox import _registry, kill_orphans

    orphan = subprocess.Popen(["sleep", "60"], start_new_session=True)
    dead_parent = subprocess.Popen(["true"])
    dead_parent.wait()
    scratch = tmp_path / "precheck-left-behind"
    scratch.mkdir()
    (_registry() / str(orphan.pid)).write_text(json.dumps({"parent": dead_parent.pid, "tmp": str(scratch)}))
    assert kill_orphans() == 1
    assert orphan.wait(timeout=5) < 0 and not scratch.exists()


def test_a_pre_check_reads_its_lane_load_once_and_its_content_quarantine_entries_only_if_any(api):
    """The step every task runs: the content's quarantine entries are read only when the task's
    own read says there are some (for the older detector's entries its verdict releases and for
    a poison release), and then once; the lane with its load once, under the dispatch lock (its
    backlog limit and its free slots), and no pass over the lane's waiting tasks when nothing else
    waits there: the task is admitted in the move that queues it."""
    from collections import Counter

    from django.db import connection
    from django.utils import timezone

    from tasks import costs
    from tasks.services.intake import task_precheck_and_route

    def precheck(task: Task) -> tuple[str, Counter]:
        from tasks.queueing import _lane_timeouts

        _lane_timeouts.clear()  # the start it sends does not read the lane again for its timeout
        kinds: Counter = Counter()

        def spy(execute, sql, params, many, context):
            kinds[costs.kind(sql)] += 1
            return execute(sql, params, many, context)

        with connection.execute_wrapper(spy):
            decision = task_precheck_and_route(task.pk, task.generation)
        return decision, kinds

    task = Task.objects.get(pk=submit_file(api))
    decision, kinds = precheck(task)
    assert decision == "queued"
    after = Task.objects.get(pk=task.pk)
    assert after.state == "QUEUED" and after.dispatched_at is not None, "admitted in the same step"
    assert kinds["SELECT tasks_quarantine"] == 0 and kinds["UPDATE tasks_quarantine"] == 0, kinds
    # The lane with its load is read once, in the statement that reads the channels' room.
    assert kinds["SELECT tasks_lanetenantload"] == 0 and kinds["SELECT tasks_lane"] == 0, kinds
    assert kinds["SELECT tasks_vendorchannel"] == 1, kinds
    # Its read and its lease in one statement (the lease's UPDATE read back as the task), and its
    # move in one statement with its history entry.
    if connection.vendor == "postgresql":
        assert kinds["WITH SELECT claimed"] == 1 and kinds["SELECT tasks_task"] == 0, kinds
        assert kinds["UPDATE tasks_task"] == 0 and kinds["WITH INSERT INTO tasks_taskevent"] == 1, kinds
    else:
        assert kinds["SELECT tasks_task"] == 0, kinds
        assert kinds["UPDATE tasks_task"] == 2 and kinds["INSERT INTO tasks_taskevent"] == 0, kinds
    # On a worker of the lane it is admitted into, the same move also claims it for that worker
    # (QUEUED, then RUNNING, each recorded), with its attempt, and hands it over as written.
    from tasks.models import Attempt, TaskEvent
    from tasks.services.intake import task_precheck_and_route_here
    from tasks.services.execution.lease import worker_id

    task = Task.objects.get(pk=submit_file(api))
    routed = task_precheck_and_route_here(task.pk, task.generation, worker_lane=task.lane_id)
    after = Task.objects.get(pk=task.pk)
    assert routed.outcome == "queued_here" and routed.task.state == after.state == "RUNNING"
    assert routed.task.generation == after.generation == task.generation + 2
    assert (after.lease_owner, after.attempts, routed.task.attempts) == (worker_id(), 1, 1)
    assert list(TaskEvent.objects.filter(task=task).order_by("at", "id").values_list("to_state", "generation")) == [
        ("ACCEPTED", 0), ("QUEUED", 1), ("RUNNING", 2)]
    assert Attempt.objects.filter(task=task, generation=2, owner=worker_id(), ended_at=None).count() == 1
    # Content an operator let out of a poison quarantine: its entry is read, once, and obeyed.
    task = Task.objects.get(pk=submit_file(api))
    Quarantine.objects.create(tenant_id=task.tenant_id, file=task.file, sha256=task.file.sha256, reason="poison",
                              detector_version="1", expires_at=timezone.now(), released_at=timezone.now())
    decision, kinds = precheck(task)
    assert kinds["SELECT tasks_quarantine"] == 1, kinds
    assert Task.objects.get(pk=task.pk).lane_id == "unknown-risk"


def _process(pid: int) -> tuple[str, dict[str, str]] | None:
    """A live (not zombie) process's command line and environment; None when it is gone."""
    from pathlib import Path

    try:
        if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
            return None
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item)
    except (OSError, IndexError):
        return None
    return command, environ


def test_each_file_is_checked_in_a_child_of_the_workers_own_small_sandbox_server(tmp_path, settings):
    """Not a fork of the worker (its memory, connections and secrets): a child of one server per
    worker, started once, holding no secrets; what a parser prints does not disturb it."""
    import os

    settings.PRECHECK_PLUGINS = ["tests.support.precheck_plugins.where"]
    first = check(tmp_path, files.text(), "txt")
    second = check(tmp_path, files.pdf(2), "pdf")
    assert first.verdict == second.verdict == "pass", (first.findings, second.findings)
    server = first.findings["forked_by"]
    assert second.findings["forked_by"] == server != os.getpid()
    command, environ = _process(server)
    assert "tasks.precheck.server" in command
    assert set(environ) <= {"PATH", "LANG"}, "the server inherits no settings or secrets"


def test_a_sandbox_server_that_died_is_replaced_at_the_next_pre_check(tmp_path, settings):
    import os
    import signal

    settings.PRECHECK_PLUGINS = ["tests.support.precheck_plugins.where"]
    server = check(tmp_path, files.text(), "txt").findings["forked_by"]
    os.kill(server, signal.SIGKILL)
    again = check(tmp_path, files.text(), "txt")
    assert again.verdict == "pass" and again.findings["forked_by"] not in (server, os.getpid())


def test_a_worker_killed_during_a_pre_check_takes_its_server_and_the_check_with_it(tmp_path, settings):
    """SIGKILL leaves nothing running: the kernel ends the server with its worker, and the
    check's child with its server; kill_orphans removes the temp directory left behind."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    data, scratch = tmp_path / "data", tmp_path / "tmp"
    scratch.mkdir()
    source = tmp_path / "input.txt"
    source.write_bytes(files.with_marker(files.text(), b"SLUICE-PRECHECK-LOOP"))
    script = (
        "import sys, django; from pathlib import Path; django.setup(); from django.conf import settings\n"
        "settings.DATA_DIR = Path(sys.argv[2]); settings.FILE_UPLOAD_TEMP_DIR = sys.argv[3]\n"
        "settings.PRECHECK_PLUGINS = ['tasks.precheck.hostile.loop']\n"
        "settings.PRECHECK_CPU_S = 120; settings.PRECHECK_WALL_S = 120\n"
        "from tasks.precheck.sandbox import run_precheck; run_precheck(Path(sys.argv[1]), 'txt')\n")
    worker = subprocess.Popen([sys.executable, "-c", script, str(source), str(data), str(scratch)],
                              env={**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings"})
    try:
        deadline = time.monotonic() + 60
        markers = []
        while not markers and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.05)
            markers = list((data / "precheck-pids").glob("*")) if (data / "precheck-pids").exists() else []
        assert markers, "the check did not start"
        time.sleep(0.1)
        child, server = int(markers[0].name), json.loads(markers[0].read_text())["parent"]
        assert _process(child) and _process(server) and server != worker.pid
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (_process(child) or _process(server)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _process(server) is None and _process(child) is None
        assert list(scratch.iterdir()), "the check's temp directory, left behind by the killed server"
        from tasks.precheck.sandbox import kill_orphans

        settings.DATA_DIR = data
        kill_orphans()
        assert list(scratch.iterdir()) == [] and list((data / "precheck-pids").iterdir()) == []
    finally:
        worker.kill()


def test_a_plugin_that_cannot_be_loaded_fails_the_step_and_quarantines_nothing(tmp_path, settings):
    """A configuration fault: the step fails (and is retried once the plugin is fixed); no file
    is judged by it."""
    from tasks.precheck.sandbox import SandboxUnavailable

    settings.PRECHECK_PLUGINS = ["tests.support.precheck_plugins.missing"]
    with pytest.raises(SandboxUnavailable, match="missing"):
        check(tmp_path, files.text(), "txt")
    settings.PRECHECK_PLUGINS = ["tests.support.precheck_plugins.where"]
    assert check(tmp_path, files.text(), "txt").verdict == "pass"


def test_a_sandbox_server_that_stops_answering_is_replaced_and_the_file_judged_by_the_next(tmp_path, settings):
    """A stopped (or overloaded) server is this host's fault, not the file's: the file is not
    quarantined as a timeout, it is checked by a new server."""
    import contextlib
    import os
    import signal

    settings.PRECHECK_PLUGINS = ["tests.support.precheck_plugins.where"]
    settings.PRECHECK_WALL_S = 1
    server = check(tmp_path, files.text(), "txt").findings["forked_by"]
    os.kill(server, signal.SIGSTOP)
    try:
        again = check(tmp_path, files.text(), "txt")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGCONT)
    assert again.verdict == "pass" and again.findings["forked_by"] != server
    assert _process(server) is None, "the stopped server was killed"


def test_a_stopping_clusters_sigterm_leaves_the_server_to_end_with_its_worker(tmp_path, settings):
    import os
    import signal

    settings.PRECHECK_PLUGINS = ["tests.support.precheck_plugins.where"]
    server = check(tmp_path, files.text(), "txt").findings["forked_by"]
    os.kill(server, signal.SIGTERM)
    assert check(tmp_path, files.text(), "txt").findings["forked_by"] == server


def test_a_pre_check_claims_its_task_once_and_leaves_a_moved_or_held_one_alone(api):
    """The pre-check's claim and read (one statement on PostgreSQL): a task another step holds is
    "busy", one no longer at the message's generation "stale"; neither is changed."""
    from datetime import timedelta

    from django.utils import timezone

    from tasks.services.execution.lease import Lease, worker_id
    from tasks.services.intake import task_precheck_and_route

    task = Task.objects.get(pk=submit_file(api))
    task_read, lease = Lease.claim_read(task.pk, "ACCEPTED", task.generation, related=("file",))
    assert lease is not None and task_read.pk == task.pk and task_read.file.pk == task.file_id
    assert task_read.lease_owner == worker_id() and task_read.lease_expires_at > timezone.now()
    # Held: a second claim gets the task but no lease, and the pre-check leaves it alone.
    again, second = Lease.claim_read(task.pk, "ACCEPTED", task.generation)
    assert again is not None and second is None
    assert task_precheck_and_route(task.pk, task.generation) == "busy"
    assert Task.objects.get(pk=task.pk).state == "ACCEPTED"
    # Stale: another generation, or a task that is not there.
    assert Lease.claim_read(task.pk, "ACCEPTED", task.generation + 1) == (None, None)
    assert task_precheck_and_route(task.pk, task.generation + 1) == "stale"
    import uuid

    assert Lease.claim_read(uuid.uuid4(), "ACCEPTED", 0) == (None, None)
    # A lease run out is claimed again.
    Task.objects.filter(pk=task.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert task_precheck_and_route(task.pk, task.generation) == "queued"


def test_a_pre_checks_claim_is_one_statement_that_reads_what_a_read_of_its_own_reads(api):
    """On both databases the claim's UPDATE returns the task with its related rows and extras
    (SQLite: each a subquery of its RETURNING), every field as `rows.select` reads it."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from tasks.rows import select
    from tasks.services.execution.lease import Lease
    from tasks.services.quarantine import content_has_entries

    task = Task.objects.get(pk=submit_file(api))
    related, extra = ("file", "lane", "tenant"), {"has_entries": content_has_entries()}
    with CaptureQueriesContext(connection) as captured:
        claimed, lease = Lease.claim_read(task.pk, "ACCEPTED", task.generation, related=related, extra=extra)
    assert lease is not None and len(captured.captured_queries) == 1, captured.captured_queries
    read = select(Task, "t.id = %s", [("id", task.pk)], related=related, extra=extra)[0]

    def fields(obj):
        return {f.attname: getattr(obj, f.attname) for f in type(obj)._meta.concrete_fields}

    assert fields(claimed) == fields(read)
    for name in related:
        assert fields(getattr(claimed, name)) == fields(getattr(read, name)), name
    assert bool(claimed.has_entries) is bool(read.has_entries) is False
    # The extra is the claimed task's own: another task of content with entries says so.
    other = Task.objects.get(pk=submit_file(api, files.wav(marker=b"other")))
    Quarantine.objects.create(tenant=other.tenant, file=other.file, sha256=other.file.sha256,
                              reason=Quarantine.Reason.POISON, detector_version="test", expires_at=timezone.now())
    claimed, lease = Lease.claim_read(other.pk, "ACCEPTED", other.generation, related=related, extra=extra)
    assert lease is not None and claimed.pk == other.pk and bool(claimed.has_entries) is True
