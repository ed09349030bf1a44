"""The API against its own OpenAPI document, fuzzed (issue 16): schemathesis runs every
operation with every check, a fixed seed and a bounded number of examples, against a live server
with a tenant's token. Zero server errors and zero departures from the document are the pass
mark; tests/schemathesis.toml lists the refusals a schema cannot express, with their reasons."""

import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from tasks.services.tenancy import tenant_ensure, token_issue

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CONFIG = Path(settings.BASE_DIR) / "tests" / "schemathesis.toml"


@pytest.fixture
def web(transactional_db, tmp_path):
    from tasks.system import Stack

    stack = Stack(log_dir=tmp_path / "web")
    try:
        yield stack.start_web(workers=1, threads=4)
    finally:
        stack.stop_all()


def test_the_api_keeps_to_its_document_under_fuzzing(web, tmp_path):
    token = token_issue(tenant=tenant_ensure(name="fuzzed")).token
    schemathesis = Path(sys.executable).parent / "schemathesis"
    done = subprocess.run(
        [str(schemathesis), "--config-file", str(CONFIG), "run", f"{web}/api/v1/openapi.json",
         "--checks", "all", "--seed", "1", "--max-examples", "30", "--workers", "1",
         "--generation-database", "none", "--no-color", "-H", f"Authorization: Bearer {token}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    summary = done.stdout[-3000:]
    assert done.returncode == 0, summary
    assert " passed" in summary and "failure" not in summary.split("SUMMARY")[-1], summary
