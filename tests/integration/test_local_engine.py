"""The local conversion engine with the real LibreOffice and poppler: generated documents of each
input type convert to valid outputs, converters are killed at their budget and leave nothing
behind, a create sent twice is one job, a cancel stops the converter, and a business user who
uploads a .docx through the portal downloads a real PDF of it."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tasks import engine
from tasks.models import Task, VendorChannel
from tasks.poc import documents
from tasks.vendors.local import LocalEngineAdapter, root
from tasks.vendors.protocol import JobRequest, Operation

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def installed():
    if not engine.installed():
        pytest.fail("LibreOffice or poppler-utils is missing: run `make engine` (make test and make run do).")


def document(kind: str, tmp_path: Path) -> Path:
    """One generated document of this type (pptx and doc are saved by LibreOffice from ODF/OOXML)."""
    makers = {"docx": lambda: documents.docx(pages=3), "odt": lambda: documents.odf("odt"), "rtf": documents.rtf,
              "xlsx": documents.xlsx, "ods": lambda: documents.odf("ods"), "odp": lambda: documents.odf("odp", pages=2),
              }
    if kind in makers:
        path = tmp_path / f"input.{kind}"
        path.write_bytes(makers[kind]())
        return path
    origin = {"pptx": ("odp", "pptx"), "doc": ("docx", "doc:MS Word 97"), "pdf": ("docx", "pdf")}[kind]
    source = document(origin[0], tmp_path)
    out = tmp_path / f"saved-{kind}"
    subprocess.run([engine.soffice(), "--headless", f"-env:UserInstallation=file://{tmp_path}/profile", "--convert-to",
                    origin[1], "--outdir", str(out), str(source)], check=True, capture_output=True, timeout=120)
    return next(out.iterdir())


def convert(path: Path, target: str, *, key: str = "", lane: str | None = None) -> tuple[LocalEngineAdapter, str]:
    channel = VendorChannel.objects.get(name="local")
    adapter = LocalEngineAdapter(channel)
    adapter.lane = lane
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    key = key or uuid.uuid4().hex  # each operation its own key, as Sluice's are
    operation = Operation(client_ref=f"ref-{key}", idempotency_key=key)
    receipt = adapter.upload(path, size=path.stat().st_size, sha256=sha, operation=operation)
    created = adapter.create_job(JobRequest(kind="conversion", target_format=target, operation=operation,
                                            upload_ref=receipt.upload_id, sha256=sha))
    return adapter, created.job.id


def finished(adapter: LocalEngineAdapter, job_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = adapter.get_job(job_id)
        if view.terminal:
            return view
        time.sleep(0.2)
    raise AssertionError(f"engine job {job_id} did not finish")


def pages(pdf: Path) -> int:
    info = subprocess.run(["pdfinfo", str(pdf)], capture_output=True, text=True, check=True).stdout
    return int(next(line.split()[-1] for line in info.splitlines() if line.startswith("Pages:")))


def leftovers(job_id: str) -> list[str]:
    """Processes still running for this job (their command line names it, or they work in it)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (job_id.encode() in (proc / "cmdline").read_bytes()
                                        or job_id in os.readlink(proc / "cwd")):
                found.append(proc.name)
        except OSError:
            continue
    return found


@pytest.mark.parametrize("kind,target,expected_pages", [
    ("docx", "pdf", 3), ("doc", "pdf", 3), ("odt", "pdf", 1), ("rtf", "pdf", 1), ("xlsx", "pdf", 1), ("ods", "pdf", 1),
    ("odp", "pdf", 2), ("pptx", "pdf", 2), ("docx", "html", None), ("docx", "txt", None), ("odt", "txt", None),
    ("pdf", "txt", None), ("xlsx", "txt", None), ("docx", "md", None),
])
def test_each_input_type_converts_to_a_valid_output(tmp_path, kind, target, expected_pages):
    adapter, job_id = convert(document(kind, tmp_path), target)
    view = finished(adapter, job_id)
    assert view.status == "completed", view
    out = tmp_path / f"result.{target}"
    fetched = adapter.fetch_result(job_id, out, target_format=target)
    assert fetched.sha256 == view.result_sha256 and fetched.size == out.stat().st_size > 0
    if target == "pdf":
        assert out.read_bytes()[:5] == b"%PDF-" and pages(out) == expected_pages
        text = subprocess.run(["pdftotext", str(out), "-"], capture_output=True, text=True).stdout
    else:
        text = out.read_text(errors="replace")
    assert "Sluice" in text  # the marker word (a spreadsheet's narrow column shows only its start)
    assert not (root() / "jobs" / job_id / "tmp").exists()


def test_a_create_sent_twice_is_one_job_and_jobs_are_found_by_client_ref(tmp_path):
    path = document("rtf", tmp_path)
    key = uuid.uuid4().hex
    adapter, first = convert(path, "pdf", key=key)
    _, second = convert(path, "pdf", key=key)
    assert first == second
    finished(adapter, first)
    found = adapter.find_jobs(Operation(client_ref=f"ref-{key}", idempotency_key=key))
    assert [job.id for job in found] == [first]


@pytest.mark.parametrize("marker,codes", [
    ("SLUICE-ENGINE-LOOP", {"engine_cpu_exceeded", "engine_timeout"}),
    ("SLUICE-ENGINE-ALLOCATE", {"engine_out_of_memory"}),
    ("SLUICE-ENGINE-CRASH", {"engine_crashed"}),
])
def test_a_document_that_loops_allocates_or_crashes_is_stopped_at_its_budget_and_leaves_nothing(
        tmp_path, settings, marker, codes):
    settings.ENGINE_TEST_MARKERS = True
    settings.ENGINE_BUDGETS = {**settings.ENGINE_BUDGETS,
                               "default": {"cpu_s": 2, "memory_mb": 512, "output_mb": 10, "wall_s": 8}}
    path = tmp_path / "hostile.rtf"
    path.write_bytes(documents.rtf(f"{marker} hostile"))
    adapter, job_id = convert(path, "pdf")
    started = time.monotonic()
    view = finished(adapter, job_id, timeout=30)
    assert view.status == "failed" and view.error_code in codes, view
    assert time.monotonic() - started < 20
    assert not (root() / "jobs" / job_id / "tmp").exists()
    assert leftovers(job_id) == []


def test_a_cancel_kills_the_running_converter(tmp_path, settings):
    settings.ENGINE_TEST_MARKERS = True
    path = tmp_path / "slow.rtf"
    path.write_bytes(documents.rtf("SLUICE-ENGINE-LOOP slow"))
    adapter, job_id = convert(path, "pdf")
    deadline = time.monotonic() + 10
    while adapter.get_job(job_id).status != "processing" and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    assert leftovers(job_id)
    assert adapter.cancel_job(job_id).status == "canceled"
    deadline = time.monotonic() + 5
    while leftovers(job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(job_id) == []
    assert not (root() / "jobs" / job_id / "tmp").exists()


def test_a_libreoffice_stopped_at_its_wall_clock_leaves_nothing_in_tmp(tmp_path, settings):
    settings.ENGINE_WARM_POOL = {**settings.ENGINE_WARM_POOL, "interactive": 0}  # its own LibreOffice
    settings.ENGINE_BUDGETS = {**settings.ENGINE_BUDGETS, "default": {**settings.ENGINE_BUDGETS["default"], "wall_s": 2}}
    left_in_tmp = _libreoffice_leftovers_in_tmp()
    path = tmp_path / "long.docx"
    path.write_bytes(documents.docx("A long report", pages=600, lines=12))  # some 4 s of LibreOffice
    adapter, job_id = convert(path, "pdf", lane="interactive")
    view = finished(adapter, job_id, timeout=30)
    assert view.status == "failed" and view.error_code == "engine_timeout", view
    assert leftovers(job_id) == [] and not (root() / "jobs" / job_id / "tmp").exists()
    assert _libreoffice_leftovers_in_tmp() - left_in_tmp == set()


def test_without_the_engine_its_channel_is_off_and_says_why(monkeypatch, settings, caplog):
    from tasks.services.setup import local_engine_ensure

    monkeypatch.setattr(shutil, "which", lambda name: None)
    channel = local_engine_ensure()
    assert not channel.enabled
    assert "local_engine_unavailable" in caplog.text


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_business_user_uploads_a_docx_in_the_portal_and_downloads_a_real_pdf(client, system, tenant, tmp_path):
    from django.core.files.uploadedfile import SimpleUploadedFile

    from tasks.services.tenancy import tenant_user_ensure
    from tests.conftest import wait_for

    VendorChannel.objects.filter(name="local").update(enabled=True)  # the system fixture's vendor set it aside
    user, password = tenant_user_ensure(username="eve", tenant=tenant)
    assert client.login(username="eve", password=password)
    answer = client.post("/tasks/new/", {
        "file": SimpleUploadedFile("minutes.docx", documents.docx("Board minutes", pages=2)), "kind": "conversion",
        "target_format": "pdf", "priority": "interactive",
    })
    assert answer.status_code == 302, answer.content[:500]
    task = Task.objects.get()
    wait_for(lambda: Task.objects.get(pk=task.pk).state in ("SUCCEEDED", "FAILED"), timeout=120,
             message="the conversion to finish")
    task.refresh_from_db()
    assert task.state == "SUCCEEDED" and task.channel_id == "local", (task.state, task.error_code, task.error_message)
    download = client.get(f"/tasks/{task.pk}/download/")
    if download.status_code == 302:  # the result is in a bucket: a pre-signed link to it
        import httpx

        download = httpx.get(download["Location"], timeout=30)
        disposition, body = download.headers["content-disposition"], download.content
    else:
        disposition, body = download["Content-Disposition"], b"".join(download.streaming_content)
    assert download.status_code == 200 and 'filename="minutes.pdf"' in disposition
    pdf = tmp_path / "minutes.pdf"
    pdf.write_bytes(body)
    assert pdf.read_bytes()[:5] == b"%PDF-" and pages(pdf) == 2
    assert "Board minutes" in subprocess.run(["pdftotext", str(pdf), "-"], capture_output=True, text=True).stdout


def test_the_console_names_the_engine_or_says_it_is_not_installed(client, monkeypatch):
    from django.urls import reverse

    from console.staff import staff_ensure
    from tasks import engine as engine_module

    user, password = staff_ensure(username="viewer-engine", role="viewer", actor="test")
    client.login(username=user.username, password=password)
    page = client.get(reverse("admin:tasks_vendorchannel_change", args=["local"])).content.decode()
    assert "LibreOffice 7" in page and "poppler" in page
    monkeypatch.setattr(engine_module, "installed", lambda: False)
    page = client.get(reverse("admin:tasks_vendorchannel_change", args=["local"])).content.decode()
    assert "Engine not installed" in page and "make engine" in page


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_document_that_keeps_crashing_the_engine_is_poison_for_this_engine_version_until_an_upgrade(
        vendor, api, tmp_path, monkeypatch):
    """Real workers and the real engine: a document that crashes the converter three times is
    quarantined (the verdict names the engine version, and every job records it); the same
    content uploaded again is recognised at once; once another engine version converts, the
    verdict is lifted and the content goes through the pre-check and into a lane again."""
    from tasks.models import Quarantine, VendorJob
    from tasks.services.quarantine import poison_binding, poison_reevaluate
    from tasks.system import Stack
    from tests.conftest import TEST_TIME_SCALE, run_until, wait_for
    from tests.support.flows import route, submit_file

    VendorChannel.objects.exclude(name="local").update(enabled=False)
    VendorChannel.objects.filter(name="local").update(enabled=True)
    content = documents.rtf("SLUICE-ENGINE-CRASH a poison document")
    stack = Stack(log_dir=tmp_path / "s", env={"SLUICE_TIME_SCALE": str(TEST_TIME_SCALE), "SLUICE_DISPATCH_TICK_S": "0.05",
                                               "SLUICE_ENGINE_TEST_MARKERS": "1"})
    try:
        stack.start_dispatcher()
        stack.start_all_clusters(workers=1)
        failed = [run_until(submit_file(api, content, name="poison.rtf", kind="conversion", target="pdf"), timeout=90)
                  for _ in range(3)]
        # The verdict is taken by the worker just after the third task's move to FAILED commits.
        wait_for(lambda: Quarantine.objects.filter(reason=Quarantine.Reason.POISON).exists(), timeout=30,
                 message="the poison verdict")
    finally:
        stack.stop_all()
    assert [(t.state, t.error_code) for t in failed] == [("FAILED", "vendor_engine_crashed")] * 3, \
        [(t.state, t.error_code, t.error_message) for t in failed]
    version = engine.engine_version()
    assert set(VendorJob.objects.filter(task__in=failed).values_list("engine_version", flat=True)) == {version}
    from django.test import Client
    from django.urls import reverse

    from console.staff import staff_ensure

    viewer = Client()
    user, password = staff_ensure(username="viewer-poison", role="viewer", actor="test")
    viewer.login(username=user.username, password=password)
    page = viewer.get(reverse("admin:tasks_task_change", args=[failed[0].pk])).content.decode()
    assert f"data-engine-version>{version}<" in page.replace("&#x27;", "'")
    entry = Quarantine.objects.get(reason=Quarantine.Reason.POISON, released_at__isnull=True)
    assert entry.converter_version == version and entry.findings["engine_version"] == version
    stored = api.post("/api/v1/files", data=content, content_type="application/octet-stream", HTTP_X_FILENAME="again.rtf")
    again = api.post("/api/v1/tasks", content_type="application/json",
                     data={"file_id": stored.json()["id"], "kind": "conversion", "target_format": "pdf"})
    assert again.status_code == 422 and again.json()["code"] == "file_quarantined", again.content
    assert poison_reevaluate() == 0, "the same engine version keeps its verdict"

    upgraded = "LibreOffice 99.1 + poppler 99.0"  # what `soffice --version` would say after an upgrade
    monkeypatch.setattr(engine, "engine_version", lambda: upgraded)
    assert not poison_binding(entry)
    assert poison_reevaluate() == 1
    entry.refresh_from_db()
    assert entry.released_at is not None and upgraded in entry.released_by
    retried = route(submit_file(api, content, name="poison-retry.rtf", kind="conversion", target="pdf"))
    assert retried.state == "QUEUED" and retried.lane_id == "unknown-risk", (retried.state, retried.error_code)


def _libreoffice_leftovers_in_tmp() -> set[str]:
    return {path.name for path in Path("/tmp").iterdir()
            if path.name.startswith("OSL_PIPE_") or (path.name.startswith("lu") and path.name.endswith(".tmp"))}


def test_warm_converters_are_reused_then_recycled_and_end_when_idle(tmp_path, settings):
    from tasks.engine import warm

    if not warm.available():
        pytest.fail("Debian's python3-uno is missing: run `make engine` (make test and make run do).")
    settings.ENGINE_WARM_RECYCLE_AFTER = 2
    settings.ENGINE_WARM_IDLE_S = 2.0
    settings.ENGINE_WARM_POOL = {**settings.ENGINE_WARM_POOL, "interactive": 1}
    slot = root() / "warm" / "interactive" / "0"
    for lane_slot in (root() / "warm").glob("*/*"):
        warm.kill(lane_slot)  # instances of earlier tests were started with other settings
    left_in_tmp = _libreoffice_leftovers_in_tmp()
    instances, bridges, supervisors = [], [], []
    for index in range(3):
        path = tmp_path / f"memo-{index}.docx"
        path.write_bytes(documents.docx(f"Warm memo {index}", pages=2))
        adapter, job_id = convert(path, "pdf", lane="interactive")
        view = finished(adapter, job_id)
        assert view.status == "completed", view
        status = __import__("json").loads((root() / "jobs" / job_id / "status.json").read_text())
        assert status["converter"] == "warm" and status["warm_instance"]["conversion"] == [1, 2, 1][index], status
        out = tmp_path / f"memo-{index}.pdf"
        adapter.fetch_result(job_id, out, target_format="pdf")
        assert pages(out) == 2
        instances.append(status["warm_instance"]["soffice_pid"])
        bridges.append(status["warm_instance"]["bridge_pid"])
        supervisors.append(status["warm_instance"]["supervisor_pid"])
        if index == 1:  # used up: the supervisor retires it once it is free
            deadline = time.monotonic() + 5
            while (slot / "state.json").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
    assert instances[0] == instances[1] != instances[2]
    # The UNO bridge lives with its instance: a conversion costs no Python start and no new connection.
    assert bridges[0] == bridges[1] != bridges[2]
    # The retired instance's profile and socket went with it.
    assert not (slot / f"uno-{supervisors[0]}.sock").exists() and not (slot / f"profile-{supervisors[0]}").exists()
    deadline = time.monotonic() + 10  # idle: it ends by itself, its group and profile with it
    while (slot / "state.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not (slot / "state.json").exists() and not list(slot.glob("profile-*")) and not list(slot.glob("uno-*.sock"))
    # Nor did the two instances leave anything in the machine's /tmp: LibreOffice's named pipes
    # (osl puts them there whatever TMPDIR says, and a killed instance does not remove them) and
    # its certificate store's scratch directories.
    assert _libreoffice_leftovers_in_tmp() - left_in_tmp == set()
    assert not Path(f"/proc/{bridges[2]}").exists() or b"uno_convert" not in Path(f"/proc/{bridges[2]}/cmdline").read_bytes()
    assert not Path(f"/proc/{instances[2]}").exists() or b"soffice" not in Path(f"/proc/{instances[2]}/cmdline").read_bytes()


def _one_warm_instance(tmp_path, settings) -> tuple[Path, dict, set[str]]:
    """A single interactive warm instance that has just converted a memo: its slot, its state, and
    what LibreOffice had left in /tmp before it started."""
    from tasks.engine import warm

    if not warm.available():
        pytest.fail("Debian's python3-uno is missing: run `make engine` (make test and make run do).")
    settings.ENGINE_WARM_POOL = {**settings.ENGINE_WARM_POOL, "interactive": 1}
    slot = root() / "warm" / "interactive" / "0"
    for lane_slot in (root() / "warm").glob("*/*"):
        warm.kill(lane_slot)
    left_in_tmp = _libreoffice_leftovers_in_tmp()
    path = tmp_path / "memo.docx"
    path.write_bytes(documents.docx("Warm memo", pages=1))
    adapter, job_id = convert(path, "pdf", lane="interactive")
    assert finished(adapter, job_id).status == "completed"
    return slot, __import__("json").loads((slot / "state.json").read_text()), left_in_tmp


def test_a_killed_warm_converter_leaves_nothing_behind(tmp_path, settings):
    from tasks.engine import warm

    slot, state, left_in_tmp = _one_warm_instance(tmp_path, settings)
    assert _libreoffice_leftovers_in_tmp() - left_in_tmp, "a running instance has its pipes in /tmp"
    warm.kill(slot)  # as a conversion that overran, or an operator's restart, does
    assert not (slot / "state.json").exists() and not list(slot.glob("profile-*")), list(slot.iterdir())
    assert _libreoffice_leftovers_in_tmp() - left_in_tmp == set()
    assert not Path(f"/proc/{state['soffice_pid']}").exists() or b"soffice" not in Path(
        f"/proc/{state['soffice_pid']}/cmdline").read_bytes()


def test_a_warm_converter_whose_files_are_removed_ends_and_leaves_nothing_in_tmp(tmp_path, settings):
    from tasks.engine import warm

    slot, state, left_in_tmp = _one_warm_instance(tmp_path, settings)
    shutil.rmtree(slot)  # the data directory removed under it (a POC run's scratch, an operator's wipe)
    deadline = time.monotonic() + 10
    while warm._alive(state["supervisor_pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not warm._alive(state["supervisor_pid"])
    assert _libreoffice_leftovers_in_tmp() - left_in_tmp == set()


@pytest.mark.parametrize("source,target,expect", [
    ("docx", "html", b"<html"), ("odt", "txt", b""), ("docx", "md", b""), ("xlsx", "html", b"<html"),
])
def test_html_and_text_exports_use_the_warm_converters_too(tmp_path, source, target, expect):
    from tasks.engine import warm

    if not warm.available():
        pytest.fail("Debian's python3-uno is missing: run `make engine` (make test and make run do).")
    adapter, job_id = convert(document(source, tmp_path), target, lane="interactive")
    view = finished(adapter, job_id)
    assert view.status == "completed", view
    status = __import__("json").loads((root() / "jobs" / job_id / "status.json").read_text())
    assert status["converter"] == "warm"
    out = tmp_path / f"out.{target}"
    adapter.fetch_result(job_id, out, target_format=target)
    body = out.read_bytes()
    assert expect.lower() in body.lower() and b"Sluice marker words" in body, body[:300]


def test_a_document_the_warm_converter_fails_on_gets_a_fresh_libreoffice_before_it_is_a_failure(tmp_path, settings):
    from tasks.engine import warm

    if not warm.available():
        pytest.fail("Debian's python3-uno is missing: run `make engine` (make test and make run do).")
    settings.ENGINE_TEST_MARKERS = True
    path = tmp_path / "memo.rtf"  # plain bytes: the marker is seen (a .docx is compressed)
    path.write_bytes(documents.rtf("SLUICE-ENGINE-WARM-CRASH Sluice marker words"))
    adapter, job_id = convert(path, "pdf", lane="interactive")
    view = finished(adapter, job_id)
    assert view.status == "completed", view
    status = __import__("json").loads((root() / "jobs" / job_id / "status.json").read_text())
    assert status["converter"] == "cold" and status["warm_failed"] == "engine_crashed"
    out = tmp_path / "memo.pdf"
    adapter.fetch_result(job_id, out, target_format="pdf")
    assert pages(out) == 1 and "Sluice marker words" in subprocess.run(["pdftotext", str(out), "-"], capture_output=True,
                                                                         text=True).stdout
